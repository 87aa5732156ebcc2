"""Who trains which expert: the lease rule, the same on every node, and our claims.

A lease is a signed claim in the run's document (protocol/runstate/state.py: expert →
{owner, epoch, round, sig}); the view keeps the best claim per expert (higher epoch; at one
epoch the lower hash rank). ``assign`` turns the view and the set of *active* trainers into
an owner for every expert, a pure function, so every node that sees the same claims and the
same active peers computes the same owners:

1. An expert whose best claim names an active trainer stays with it.
2. The others (never claimed, or their owner is no longer active) go, in expert order, each
   to the active trainer holding fewest experts, ties broken by ``rank`` (a hash of the
   run, the expert and the peer: no peer is always first).
3. Then, while the most loaded trainer holds at least two more experts than the least
   loaded, the least loaded takes one from the most loaded (ties by rank both ways): the
   one of its experts that ranks first for the taker. A joiner is handed experts this way
   until the load is even. Each move lowers the sum of squared loads, so this ends.

Active: a trainer member that is live (heartbeats within the peer TTL), that has not said
it finished its rounds (its experts would stay frozen for the nodes still training: they
go to those), and that has not lapsed. A node starting or restarting its worker says it
is not training too, but keeps what it holds: a worker restart takes seconds, and an owner
that stays away lapses as below. An owner (we first saw its claim at least ``lapse_rounds`` of our rounds
ago: our rounds, not the round a claim names, which its signer chooses) lapses when it
missed ``lapse_rounds`` of *its* rounds: its own round, as it tells askers, is that far
past its newest version; or when it has not answered us for ``lapse_rounds`` of our
rounds and at least ``SILENT_S`` (a killed node: well before its liveness expires; the
floor keeps a busy peer whose answer is late from lapsing when rounds take a second). A slow owner that publishes each
of its rounds never lapses: nodes train at their own pace, without a barrier. We are
active while we train.

A node writes a claim (epoch one above the view's, its own signature) for each expert the
rule gives it that the view does not already give it; the old owner sees the better claim
and lets the expert go at its next round boundary. When views differ for a moment (a peer's
liveness expires a little sooner on one node), two nodes may claim one expert at one epoch:
the lower rank wins everywhere once the document has merged, so every expert ends with one
owner. Each expert has an owner as long as one trainer is active: rule 2 gives orphans out
whenever anyone is. With more trainers than experts, some own none (they still train the
shared weights and route through the frozen experts).

A peer we banned (it sent a version our worker refused, say) counts neither as active nor
as an owner: the view we run the rule on leaves out its claims and falls back, per expert,
to the best claim of someone else (``RunState.leases_apart_from``). Its claims still stand
in the document for nodes that have not banned it, so two honest nodes may disagree on an
expert until both have banned it; without the fall-back, the banned owner, running this
rule on its own view, took an expert back from whoever replaced it (the replacement had
left it one short), that node claimed it again next round, and so on to the end of the
run: a claim war whose last claim decided who held the expert when the run ended.

A claim war costs its fighter. By the rule an owner loses an expert only once it lapsed,
or for balance (the loser the most loaded by two or more, so it still holds at least as
many as the taker afterwards); so while views agree, no honest node takes an expert from
an owner we count active leaving it fewer experts than the taker. When the taker lost that
expert itself within ``FIGHT_MEMORY_ROUNDS`` of our rounds (a take-back), and did so
once before in that time (the first is excused: a node that banned a war's fighter takes
back, once, what it lost to it, in the view of a node that has not banned it yet), we
suspect a war; if the loser is still active once it has had the time to lapse
(``lapse_rounds`` of our rounds and ``SILENT_S``: a taker whose view saw it lapse a
little before ours is excused), the taker earns a penalty point (``LeaseKeeper.fights``;
points decay). Five and it is banned, and a banned peer's claims are left out as above:
the war ends. Without it a member that claimed experts it was not given (any signed claim
of a higher epoch wins the document) could take them back every round from the owners
that took them back by the rule; a member fighting by turns over every expert runs out of
ones it has not lost within the memory. A take-back is seen for sure by its victim (the
claim it replaced is the victim's own); others see it if they looked between the two
claims.

Not defended: a member can take an expert it has not lost lately from its owner (a claim
of a higher epoch); the owner, one short, takes one of its experts back by the rule at its
next round, so such a member holds at most one expert more than its share at a time and
costs the run a hand-over per round until it has lost each expert once. Its versions are
bounded by the worker like any other (training/spes.py).
"""

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from protocol.runstate.state import LeaseRecord, RunState, sign_lease

logger = logging.getLogger("node.training")

# An owner silent for its lapse rounds is lapsed only once it has been silent this long too.
SILENT_S = 10.0
# How long a peer's loss of an expert is remembered (a claim war's take-backs, above): a
# member fighting by turns over every expert runs out of ones it has not lost within it.
FIGHT_MEMORY_ROUNDS = 64


def rank(run_id: str, expert: int, peer_id: str) -> bytes:
    return hashlib.sha256(f"swarmtrain-lease\0{run_id}\0{expert}\0{peer_id}".encode()).digest()


def assign(
    num_experts: int, leases: Mapping[int, LeaseRecord], active: Sequence[str], *, run_id: str
) -> dict[int, str]:
    """Every expert's owner by the rule above; {} when nobody is active."""
    if not active:
        return {}
    peers = sorted(set(active))
    owners = {e: lease.owner for e, lease in leases.items() if e < num_experts and lease.owner in peers}
    load = Counter({p: 0 for p in peers})
    load.update(owners.values())
    for expert in range(num_experts):
        if expert not in owners:
            chosen = min(peers, key=lambda p: (load[p], rank(run_id, expert, p)))
            owners[expert] = chosen
            load[chosen] += 1
    while True:
        most = min(peers, key=lambda p: (-load[p], rank(run_id, -1, p)))
        least = min(peers, key=lambda p: (load[p], rank(run_id, -1, p)))
        if load[most] - load[least] < 2:
            return owners
        expert = min((e for e, p in owners.items() if p == most), key=lambda e: rank(run_id, e, least))
        owners[expert] = least
        load[most] -= 1
        load[least] += 1


@dataclass(frozen=True, slots=True)
class Release:
    """An expert changing hands, as the view saw it (``from_peer`` None: its first owner)."""

    expert: int
    from_peer: str | None
    to_peer: str
    round: int
    epoch: int

    def report(self) -> dict[str, object]:
        return {"expert": self.expert, "from": self.from_peer, "to": self.to_peer, "round": self.round}


@dataclass(frozen=True, slots=True)
class Progress:
    """What we know of each owner's progress (node/algorithms/spes/experts.py keeps it)."""

    newest: Mapping[str, int]
    """The round of its newest version we saw."""
    reported: Mapping[str, int]
    """Its own round, as it last told us."""
    answered: Mapping[str, tuple[int, float]]
    """Our round, and the time (trio's clock), when it last answered us."""
    listening: tuple[int, float] = (0, -math.inf)
    """Our round and the time when we began asking: a peer that never answered has been
    silent since then, not since its lease (a joiner has not asked anyone yet)."""
    training: Mapping[str, bool] | None = None
    """Per peer, False once it said it finished its rounds (node/algorithms/spes/ tells); a
    peer not in it counts as training; None: nobody asked (tests)."""


def still_training(said: Mapping[str, bool], reported: Mapping[str, int], last_round: int) -> dict[str, bool]:
    """``Progress.training`` from what peers said in their heads (their worker in its rounds
    or not, and their round): False only for a peer not training whose round is the run's
    last (it finished); one starting or restarting its worker keeps its experts."""
    return {p: training or reported.get(p, 0) < last_round for p, training in said.items()}


def lapsed(
    peer_id: str, since: int | None, progress: Progress, our_round: int, lapse_rounds: int, *, now: float
) -> bool:
    """Whether ``peer_id``, as an owner, missed ``lapse_rounds`` of its rounds or went
    silent for that many of ours (and ``SILENT_S``; see above). ``since``: our round when
    we first saw its newest claim (None: it holds none). Our rounds, not the round its
    claim names: a claim signing a far round would otherwise never lapse."""
    if since is None or our_round - since < lapse_rounds:
        return False
    answered_round, answered_at = progress.answered.get(peer_id, progress.listening)
    silent = our_round - max(answered_round, since) >= lapse_rounds and now - answered_at >= SILENT_S
    its_round = progress.reported.get(peer_id)
    missed = its_round is not None and its_round - 1 - progress.newest.get(peer_id, -1) >= lapse_rounds
    return silent or missed


class LeaseKeeper:
    """Our side of the rule: the owners now, the claims we must write, the hand-overs seen."""

    def __init__(
        self,
        state: RunState,
        *,
        seed: bytes,
        peer_id: str,
        lapse_rounds: int,
        banned: Callable[[str], bool] = lambda _: False,
    ) -> None:
        self._state = state
        self._banned = banned
        self._seed = seed
        self.peer_id = peer_id
        self._lapse_rounds = lapse_rounds
        self.num_experts = 0
        self.releases: list[Release] = []
        self._seen: dict[int, LeaseRecord] = {}
        self._first_seen: dict[LeaseRecord, int] = {}
        """Our round when we first saw each claim (lapses count from there)."""
        self._lost: dict[tuple[int, str], int] = {}
        """(expert, peer) → our round when that peer lost the expert (kept ``FIGHT_MEMORY_ROUNDS``)."""
        self._took_back: dict[tuple[int, str], int] = {}
        """(expert, peer) → our round of that peer's last take-back of a war (above)."""
        self._active: set[str] = set()
        """The owners we counted active at the last look (``active``)."""
        self._now = 0.0
        """When that look was (trio's clock): a take-back seen since is stamped with it."""
        self._suspects: list[tuple[str, str, str, int, float]] = []
        """Take-backs of a war not yet counted: (taker, loser, why, our round, time) for each;
        counted once the loser has stayed active as long as it takes to lapse."""
        self.fights: list[tuple[str, str]] = []
        """(peer, why) for each take-back of a claim war seen (above): to penalize, then clear."""

    def view(self) -> dict[int, LeaseRecord]:
        """Per expert, the best claim whose owner we have not banned."""
        return self._state.leases_apart_from(self._banned)

    def lease(self, expert: int) -> LeaseRecord | None:
        """``view()`` of one expert."""
        return self._state.lease_apart_from(expert, self._banned)

    def active(self, trainers: Sequence[str], progress: Progress, our_round: int, *, now: float) -> list[str]:
        """We (while training) and the live trainers that say they train and have not lapsed."""
        held: dict[str, int] = {}
        for lease in self.view().values():
            held[lease.owner] = max(held.get(lease.owner, -1), self._first_seen.get(lease, our_round))

        def why_not(p: str) -> str | None:
            if self._banned(p):
                return "banned"
            if progress.training is not None and not progress.training.get(p, True):
                return "finished its rounds"
            if lapsed(p, held.get(p), progress, our_round, self._lapse_rounds, now=now):
                return "lapsed: silent or missing its rounds"
            return None

        reasons = {p: why_not(p) for p in trainers if p != self.peer_id}
        others = [p for p, reason in reasons.items() if reason is None]
        for peer in sorted(self._active - {self.peer_id, *others}):
            # Why an owner's experts may move (a flapping peer shows here first).
            logger.info("round %d: %s counts as active no more (%s)", our_round, peer, reasons.get(peer) or "not live")
        self._active = {self.peer_id, *others}
        self._now = now
        suspects, self._suspects = self._suspects, []
        for suspect in suspects:
            taker, loser, why, seen_round, seen_at = suspect
            if loser not in self._active:
                continue  # it lapsed for us too: the taker's view was ahead of ours
            if our_round - seen_round >= self._lapse_rounds and now - seen_at >= SILENT_S:
                logger.warning("%s %s: a claim the lease rule does not make", taker, why)
                self.fights.append((taker, why))
            else:
                self._suspects.append(suspect)
        self.observe(our_round)
        return sorted(self._active)

    def owners(self, active: Sequence[str]) -> dict[int, str]:
        return assign(self.num_experts, self.view(), active, run_id=self._state.run_id)

    def claims(self, owners: Mapping[int, str], round_index: int) -> list[bytes]:
        """Write our claim on each expert the rule gives us and the view does not; the
        document updates to push."""
        updates = []
        view, best = self.view(), self._state.leases
        for expert, owner in sorted(owners.items()):
            lease = view.get(expert)
            if owner != self.peer_id or (lease is not None and lease.owner == self.peer_id):
                continue
            top = best.get(expert)  # a banned peer's claim too: ours must beat it everywhere
            epoch = 1 if top is None else top.epoch + 1
            record = sign_lease(LeaseRecord(expert, self.peer_id, epoch, round_index), self._seed, self._state.run_id)
            try:
                updates.append(self._state.put_lease(record))
            except ValueError as exc:  # a better claim arrived meanwhile: the rule runs again next time
                logger.info("no claim on expert %d: %s", expert, exc)
                continue
            logger.info(
                "round %d: claimed expert %d (epoch %d, from %s)", round_index, expert, epoch, lease and lease.owner
            )
        self.observe(round_index)
        return updates

    def observe(self, our_round: int) -> None:
        """Note every change of hands in the view since the last look, and when we first
        saw each claim; a take-back of a claim war (above) goes to ``fights``."""
        view = self.view()
        loads = Counter(lease.owner for lease in view.values())
        self._lost = {k: r for k, r in self._lost.items() if our_round - r < FIGHT_MEMORY_ROUNDS}
        self._took_back = {k: r for k, r in self._took_back.items() if our_round - r < FIGHT_MEMORY_ROUNDS}
        for expert, lease in sorted(view.items()):
            self._first_seen.setdefault(lease, our_round)
            before = self._seen.get(expert)
            if before != lease and (before is None or lease.owner != before.owner):
                previous = None if before is None else before.owner
                self.releases.append(Release(expert, previous, lease.owner, lease.round, lease.epoch))
                if previous is not None:
                    self._fight(expert, lease.owner, previous, loads, our_round)
                    self._lost[(expert, previous)] = our_round
            self._seen[expert] = lease

    def _fight(self, expert: int, taker: str, loser: str, loads: Counter[str], our_round: int) -> None:
        lost = self._lost.get((expert, taker))
        if (
            taker == self.peer_id
            or lost is None
            or loser not in self._active
            or loads[loser] >= loads[taker]  # by the rule the loser still holds at least as many
        ):
            return
        before = self._took_back.get((expert, taker))
        self._took_back[(expert, taker)] = our_round
        if before is not None:  # the first is excused (see above)
            why = f"claimed expert {expert} back from {loser} again, {our_round - lost} round(s) after losing it"
            self._suspects.append((taker, loser, why, our_round, self._now))

    def mine(self) -> list[int]:
        """The experts our best-known claims give us."""
        return sorted(e for e, lease in self.view().items() if lease.owner == self.peer_id and e < self.num_experts)
