"""How far behind its peers a NoLoCo (or SPES) node is, and what it does about it: shorter
rounds while a pull still reaches its peers' round, a skip to their round past that.

Pure rules, no hosts and no clock: node/algorithms/noloco/pairing.py measures ``lead`` (the
rounds its peers told it, and how long ago they reached them), node/algorithms/noloco/
__init__.py turns it into ``outer_go``'s ``steps`` and ``skip`` (docs/training.md: "A
slower node keeps to its peers' rounds", "Further behind than a pull reaches").
"""

import math
from collections.abc import Iterable

# A pull may bring a payload of up to this many rounds past ours: a node a moment behind
# its peers found their outboxes holding the next round's payload and went alone (one outer
# step ahead is as near our φ as an honest partner's; the worker's bounds still apply). Two:
# a slower node keeping up by shorter rounds (``catch_up_steps``) runs one to two rounds
# behind its peers (simulate --slow-node 2: behind by 2 in some rounds, alone in those).
PULL_AHEAD_ROUNDS = 2
# How far behind its peers a node counts itself at most (``lead_of``): its next round is
# shortened to H / (1 + lead) steps, never below 1/(1 + MAX_LAG) of H.
MAX_LAG = 3
# A node that far behind its peers' boundaries, in rounds, shortens its next round too, not
# only one whole rounds behind. Less: the pairing window of the one ahead (half a round,
# node/algorithms/noloco/pairing.py ``PREFER_SHARE``, ``NEAR_BOUNDARY``) waits for it, and
# pairing aligns the two. More: the one ahead hears "never, not near" from it, pairs with
# another, and nothing ever aligns them: beside a CPU hog, 4 SPES nodes (micro-moe, rounds
# of ~1.2 s) paired as two fixed pairs ~1 s apart for 13 rounds against the schedule, and
# in another run one pair fell 3 rounds behind the other with no lag seen, each laggard's
# partner vouching for its round; the halves' shared weights drifted apart until every
# payload between them was refused.
CATCH_UP_FROM = 0.5
# What a peer told us counts this many of our rounds (a pair behind together hears the
# pair ahead one peer a round, by the schedule; two peers' word is needed), or until we
# caught up on it (``Pairing.caught_up``).
LEAD_MEMORY_ROUNDS = 3
# One node skips at most one in this many of the run's rounds (``rounds_to_skip``): a late
# joiner beside 3 CPU hogs skipped 9 of its 26.
SKIPS_AT_MOST_ONE_IN = 3


def catch_up_steps(steps_per_round: int, lead: float) -> int:
    """Inner steps of our next round when our peers are ``lead`` rounds ahead of us (a
    fraction of a round counts, from ``CATCH_UP_FROM``): fewer, so a slow node keeps to its
    peers' rounds (and can pair, or pull a round ahead) instead of falling further behind
    each round, and a node half a round or more behind its peers' boundaries comes back to
    them; H when it is not behind."""
    if lead < CATCH_UP_FROM:
        return steps_per_round
    return max(1, math.ceil(steps_per_round / (1 + min(MAX_LAG, lead))))


def rounds_to_skip(lag: int, *, skipped: int = 0, rounds: int = 1 << 62) -> int:
    """Rounds to leave out when our peers are ``lag`` rounds ahead: all of them once not
    even a pull reaches their round (``PULL_AHEAD_ROUNDS``), else none. Shorter rounds
    (``catch_up_steps``) close a gap only where inner steps are most of a round; where
    pairing and the outer step are (rounds of a fraction of a second: the micro model, a
    loaded machine) a node behind stayed behind: a late joiner in a full run of the suite
    went alone in 24 of 26 rounds, 2-3 rounds behind its peers to the end, and its replica
    drifted from theirs. Its skipped rounds' steps are not taken (the run's round, not a
    step count, is what peers must share). ``lag``: ``Pairing.vouched_lag`` (whole rounds), two peers'
    word (never one's, even as our only peer), at most ``MAX_LAG`` a round; and at most
    one in ``SKIPS_AT_MOST_ONE_IN`` of the run's ``rounds`` in all (``skipped`` so far), so members
    lying together about their rounds cost a node at most that share of its rounds."""
    budget = max(0, rounds // SKIPS_AT_MOST_ONE_IN - skipped)
    return min(lag, budget) if lag > PULL_AHEAD_ROUNDS else 0


def skip_horizon(rounds: int, round_index: int, lag: int) -> int:
    """The rounds a node's skips may be a share of (``rounds_to_skip``'s ``rounds``): the
    run's budget, or in a run until its nodes stop (``rounds`` 0) the rounds up to where a
    skip of ``lag`` after round ``round_index`` lands: members lying together cost such a
    node at most that share of its rounds so far, not of 2^30."""
    return rounds or round_index + 1 + lag


def lead_of(leads: Iterable[float], *, peers: int) -> float:
    """How many rounds our peers are ahead of us (``Pairing`` keeps what each told us in
    our last ``LEAD_MEMORY_ROUNDS`` rounds, as rounds ahead of ours then, a fraction for how
    long ago it reached its round): the second-highest of them, so one peer claiming a far
    round cannot shorten our rounds (a liar answering first, before an honest peer accepted,
    did: a second reader's probe); one peer's word only when it is our only peer
    (``peers``); 0 if they are not ahead, ``MAX_LAG`` at most."""
    ordered = sorted(leads, reverse=True)
    if not ordered or (len(ordered) < 2 and peers > 1):
        return 0.0
    return max(0.0, min(float(MAX_LAG), ordered[min(1, len(ordered) - 1)]))
