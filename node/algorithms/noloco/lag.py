"""How far behind its peers a NoLoCo (or SPES) node is, and what it does about it: shorter
rounds while a pull still reaches its peers' round, a skip to their round past that.

Pure rules, no hosts and no clock: node/algorithms/noloco/pairing.py measures ``lag`` (the
rounds its peers told it), node/algorithms/noloco/__init__.py turns it into ``outer_go``'s
``steps`` and ``skip`` (docs/training.md: "A slower node keeps to its peers' rounds",
"Further behind than a pull reaches").
"""

# A pull may bring a payload of up to this many rounds past ours: a node a moment behind
# its peers found their outboxes holding the next round's payload and went alone (one outer
# step ahead is as near our φ as an honest partner's; the worker's bounds still apply). Two:
# a slower node keeping up by shorter rounds (``catch_up_steps``) runs one to two rounds
# behind its peers (simulate --slow-node 2: behind by 2 in some rounds, alone in those).
PULL_AHEAD_ROUNDS = 2
# How far behind its peers a node counts itself at most (``lag``): its next round is
# shortened to H / (1 + lag) steps, never below 1/(1 + MAX_LAG) of H.
MAX_LAG = 3
# One node skips at most one in this many of the run's rounds (``rounds_to_skip``): a late
# joiner beside 3 CPU hogs skipped 9 of its 26.
SKIPS_AT_MOST_ONE_IN = 3


def catch_up_steps(steps_per_round: int, lag: int) -> int:
    """Inner steps of our next round when our peers are ``lag`` rounds ahead of us: fewer,
    so a slow node keeps to its peers' rounds (and can pair, or pull a round ahead) instead
    of falling further behind each round; H when it is not behind."""
    return max(1, -(-steps_per_round // (1 + min(MAX_LAG, max(0, lag)))))


def rounds_to_skip(lag: int, *, skipped: int = 0, rounds: int = 1 << 62) -> int:
    """Rounds to leave out when our peers are ``lag`` rounds ahead: all of them once not
    even a pull reaches their round (``PULL_AHEAD_ROUNDS``), else none. Shorter rounds
    (``catch_up_steps``) close a gap only where inner steps are most of a round; where
    pairing and the outer step are (rounds of a fraction of a second: the micro model, a
    loaded machine) a node behind stayed behind: a late joiner in a full run of the suite
    went alone in 24 of 26 rounds, 2-3 rounds behind its peers to the end, and its replica
    drifted from theirs. Its skipped rounds' steps are not taken (the run's round, not a
    step count, is what peers must share). ``lag``: ``Pairing.vouched_lag``, two peers'
    word (never one's, even as our only peer), at most ``MAX_LAG`` a round; and at most
    one in ``SKIPS_AT_MOST_ONE_IN`` of the run's ``rounds`` in all (``skipped`` so far), so members
    lying together about their rounds cost a node at most that share of its rounds."""
    budget = max(0, rounds // SKIPS_AT_MOST_ONE_IN - skipped)
    return min(lag, budget) if lag > PULL_AHEAD_ROUNDS else 0


def lag_of(ours: int, theirs: dict[str, int], *, peers: int) -> int:
    """How many rounds our peers are ahead of round ``ours``, by the rounds they told us
    (peer → round; a partner that accepted us is at ours, a pull's payload says its round):
    the second-highest of them, so one peer claiming a far round cannot shorten our rounds
    (a liar answering first, before an honest peer accepted, did: a second reader's probe);
    one peer's word only when it is our only peer (``peers``); 0 if they are not ahead."""
    rounds = sorted(theirs.values(), reverse=True)
    if not rounds or (len(rounds) < 2 and peers > 1):
        return 0
    return max(0, min(MAX_LAG, rounds[min(1, len(rounds) - 1)] - ours))
