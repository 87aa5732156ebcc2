"""Pairing for one NoLoCo round, without a barrier: ask one peer at a time, never wait long.

Protocol flow (``/swarmtrain/pair/1.0.0``), one question per stream:

    asker                                       asked
    {t: "pair?", v: 1, round, nbytes} ─────────▶ accepts if it is at the same round boundary,
                                                 unpaired, not itself asking, and its payload
                                                 has the same size
                                      ◀───────── {t: "accept", v: 1} or
                                                 {t: "busy", v: 1, retry, reason, round, since}
                                                 (its round, and the seconds since it reached it)
    after "accept" each sends its payload to the other (protocol/net/exchange.py, same round)

Who may pair: only members of the run (``is_member``: a signed member record we hold),
one question per peer at a time. A partner must start sending within ``NO_SHOW_S`` of the
pairing; one that does not is penalized (two no-shows ban) and dropped, and we look for another while the
bound lasts (a stranger who asks everyone and never sends costs each node at most that
long per try, and is banned after a few). Transfers are authorized here (``authorize``):
only our partner's (or the asked peer's) payload of our size for our round gets a buffer.

A node at a boundary ``offer``s its payload, then ``find_partner`` asks live peers in
random order; "busy" means try another. Meanwhile it accepts the first peer that asks it.
A node asking someone answers "busy, asking someone" (it holds its asking lock), except to
the peer it is asking itself when that one has the smaller id: two nodes asking each other
at the same moment pair at once (``_takes_while_asking``). After a "busy, asking someone"
the asker pauses a random time proportional to
how long its questions take (``backoff_s``) before it asks anyone again, so the time nodes
spend asking stays a fraction of their time at the boundary even on a loaded machine:
with a fixed pause of 50–300 ms, a 16-node soak on 2 cores (one question taking seconds)
had every node asking whenever it was asked, and 75 of 80 rounds went alone after waiting
out the 30 s bound. A "busy" says whether
to ask again: a peer paired for our round, or already past it, never will be free for it
(retry false), and once no candidate is left we go on alone at once instead of waiting
out the bound. Everything is
bounded by ``timeout_s``: with no partner by then, the round goes on alone (NoLoCo skips
the γ term), and a slow or dead peer never holds anyone longer than that.

Whom to ask first: a schedule every node computes alike. Greedy pairing alone kept the
same pairs round after round: two nodes that paired reach their next boundary together
(they waited for each other's payload) and pair again before anyone else is there; in a
4-node run (micro, H = 20, 30 rounds) a node had last round's partner again in 23 of 29
rounds, two halves of the swarm trained apart for 14 rounds in a row, and their replicas
drifted (the partner check saw 6× our update at the crossing). NoLoCo's mixing needs a
random partner each round. So each round has a scheduled partner: the members (our
live partners and us) sorted by a hash of (the run, the round, the peer id) and paired
in that order (``scheduled_partner``; an odd one out has none). For a share of our round
time (``PREFER_SHARE``, half; at most a quarter of the bound) from our boundary we pair only
with it: the one of the two with the smaller id asks it every sweep, the other mostly
waits to be asked (it asks at its boundary, then once a second, to hear a "never"), and
anyone else asking hears "later" (waiting for this round's partner). The scheduled
partner saying "never" (past the round, far behind, gone), or the window ending, sends
us back to asking everyone as before. The worker trains on meanwhile (``outer.overlap``:
half a round by default), so the wait costs the overlapped steps' staleness, not compute.
The window is the run's ``outer.overlap`` share at most (the steps the worker trains
while we pair; none with overlap 0). What it costs, bounded by the window each time: a
member (the run id and the members are public) can grind a peer id that is a victim's
scheduled partner in many chosen rounds (a second reader found one for 8 of 20 rounds
among 60,000 ids, chance ~3) and answer "later" there: the victim waits out the window
and pulls instead of pairing, and no penalty follows. Views of the members that differ
(a peer one node banned, a joiner still starting, a node past its expected boundary that
keeps answering "later") make the schedule disagree for some nodes: each loses at most
the window, then pairs or pulls as before.

Pulls: pairs leave one node out whenever an odd number reach a round together, and a node
that reached it late (a joiner still starting up, a restarted one) finds everyone paired or
gone on. Such a node asks for a pull instead:

    {t: "pull?", v: 1, round, nbytes} ───────▶ accepted while our outbox still holds that
                                                round's payload or the next one's (from our
                                                boundary until our worker's next one), once
                                                per peer per round
                                      ◀───────── {t: "accept"} (then our payload, one way) or "busy"

The puller averages with our φ; we do not take its payload (our round is done or paired).
Measured before pulls: a late NoLoCo joiner, one round behind its peers for good, had a
partner in 0 of 6 rounds. The worker does not overwrite the outbox before ``close_pulls``
(node/algorithms/noloco/__init__.py calls it at the worker's ``inner_done``), which waits for pulls
under way at most ``pull_grace_s`` for the payload's size, then cuts them: a slow puller
delays our round by at most that, once per round.
"""

import hashlib
import logging
import math
import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from node.algorithms.noloco.lag import LEAD_MEMORY_ROUNDS, MAX_LAG, PULL_AHEAD_ROUNDS, lead_of
from protocol import wire
from protocol.errors import ProtocolError
from protocol.net.exchange import Payload, TensorSpec, send_tensors
from protocol.net.hostlike import StreamLike, TensorHostLike
from protocol.ratelimit import UNLIMITED, RateLimit

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/pair/1.0.0"
VERSION = 1
MAX_FRAME_NBYTES = 4096
ASK_TIMEOUT_S = 5.0
# How long a partner may take to start sending its payload after the pairing: the honest
# one starts at once (its header travels in milliseconds), so this only bounds a no-show.
NO_SHOW_S = 10.0
# A no-show costs its victim up to NO_SHOW_S and a partner for the round: two of them ban
# (an honest node does it only by crashing mid-round, twice within the penalty decay).
NO_SHOW_POINTS = 3
# Pause between sweeps over the candidates (peers may reach their boundary any moment).
RETRY_PAUSE_S = (0.05, 0.3)
# The "busy" reason of a node that is itself asking someone, and the backoff after one: up
# to this many times our recent question time (an average), so a node asks a quarter or
# less of the time it waits at a boundary however slow questions get.
ASKING = "asking someone"
BACKOFF_TIMES_ASK = 6.0
ASK_TIME_WEIGHT = 0.2
# The "never" reason of a node that will start from a peer's state (``Pairing.joining``).
JOINING = "joining: starting from a peer's state"
# The end of the pairing bound kept for a pull (at most a quarter of the bound).
PULL_RESERVE_S = 5.0
# A node asked to pair for the round after its last boundary answers "later" only when it
# expects that boundary within this share of its own round's computing time (by its recent
# rounds); else "never": an asker that kept asking a slow node waited out most of its bound
# each round (a node at half speed among 4: the odd one of the others waited ~25 s a round).
# Half a round: what an asker's worker trains on meanwhile by default (``outer.overlap``);
# with a quarter (and pulls one round ahead), in one run on a loaded machine, one of the
# three full-speed nodes beside a slow one went alone in 12 of 30 rounds. Where the next
# boundary is expected, and the computing time, come from ``next_boundary`` and
# ``compute_sample``, not from boundary-to-boundary times: those count waits to pair, and
# a node whose first pairing waited for its peer's worker to start (0.28 s of a 0.42 s
# round, micro) said "not near" 0.16 s after its boundary and came ms later: its peer, in
# a run of two, went alone (tests/test_cli_e2e.py's int8 pair, in 7 of 48 runs).
NEAR_BOUNDARY = 0.5
ROUND_TIME_WEIGHT = 0.3
# How long from our boundary we pair only with the round's scheduled partner: this share of
# our round time (by our recent rounds), at most a quarter of the pairing bound; before we
# know our round time, FIRST_PREFER_S. A quarter let most pairs miss their schedule in a
# micro run (rounds of ~0.55 s: 74 of 116 as scheduled, the same partner as last round in
# 72%); half: 96 of 114, and 48 of 48 with tiny's ~7 s rounds (docs/training.md).
PREFER_SHARE = 0.5
FIRST_PREFER_S = 2.0
WAITING_FOR_PARTNER = "waiting for this round's partner"
# The larger id's pause between its asks of its scheduled partner. Its first ask is at its
# boundary: when it waited this long first, a node a round behind its peers (windows are
# half a round: under this on a fast model or a loaded machine) waited out its window at
# every boundary for a partner already past it, and stayed behind.
SCHEDULED_SLOW_ASK_S = 1.0
# At most this share of a round for how long before us a peer reached a round ("since"):
# under one, so a lead's whole rounds stay the rounds it told.
SINCE_SHARE_MAX = 0.95
# A "since" that is not a finite float of seconds, at least 0 (an honest node never sends one).
BAD_SINCE_POINTS = 1
# A peer saying it is at a round past the run's last lies (an honest one stops there):
# its word is dropped, and costs it this (it would make us skip rounds: ``rounds_to_skip``).
PAST_THE_RUN_POINTS = 1


def scheduled_partner(seed: str, round_index: int, me: str, peers: Iterable[str]) -> str | None:
    """Our partner of round ``round_index`` by the run's schedule (None: the odd one out):
    ``peers`` and ``me`` sorted by a hash of (``seed``, the round, the id), paired in that
    order. Every node with the same view of the members computes the same pairs."""

    def rank(peer_id: str) -> bytes:
        return hashlib.blake2b(f"{seed}\x00{round_index}\x00{peer_id}".encode(), digest_size=16).digest()

    members = sorted({*peers, me}, key=rank)
    i = members.index(me)
    if i % 2:
        return members[i - 1]
    return members[i + 1] if i + 1 < len(members) else None


def next_boundary(boundary_at: float, paired_at: float, compute_s: float, overlap: float) -> float:
    """When a node expects its next boundary: its worker takes a round's steps in
    ``compute_s``, up to the ``overlap`` share of them while the node pairs (from
    ``boundary_at`` to ``paired_at``; training/algorithms/rounds.py stops those at the
    pairing's end), and the rest after it. A short pairing: a round after the last
    boundary; a long one (past the overlapped steps): the rest after the pairing's end."""
    return max(boundary_at + compute_s, paired_at + (1.0 - overlap) * compute_s)


def compute_sample(boundary_s: float, after_pairing_s: float, overlap: float) -> float:
    """A round's computing time from what was seen of it (``next_boundary`` turned round):
    ``boundary_s`` from boundary to boundary, ``after_pairing_s`` from the pairing's end to
    the next boundary. A pairing shorter than the overlapped steps hid in the round; a
    longer one added its excess, and only the steps after it count."""
    if overlap >= 1.0:
        return boundary_s
    return min(boundary_s, after_pairing_s / (1.0 - overlap))


def _averaged(average: float | None, sample: float) -> float:
    """A moving average of round times (``ROUND_TIME_WEIGHT``): the first sample as it is."""
    return sample if average is None else average + ROUND_TIME_WEIGHT * (sample - average)


def backoff_s(ask_s: float, draw: float) -> float:
    """The pause after a "busy, asking someone" (``draw`` uniform in [0, 1)): as short as a
    sweep's pause on an idle machine, growing with ``ask_s``, how long a question takes."""
    low, high = RETRY_PAUSE_S
    return low + draw * (max(high, BACKOFF_TIMES_ASK * ask_s) - low)


PAYLOAD_NAME = "noloco"
# How long the worker waits for pulls under way when it needs its outbox back: a fixed part
# plus the payload at 100 Mbit/s (an honest pull over loopback or a LAN takes milliseconds).
PULL_GRACE_S = 5.0
PULL_GRACE_BYTES_PER_S = 12.5e6


def pull_grace_s(nbytes: int) -> float:
    return PULL_GRACE_S + nbytes / PULL_GRACE_BYTES_PER_S


@dataclass(slots=True)
class _Round:
    index: int
    outbox: memoryview
    inbox: memoryview
    partner: str | None = None
    asking: str | None = None
    early: bytes | None = None
    """The payload of the peer we are asking, if it came before its "accept" reached us."""
    received: bool = False
    started: bool = False
    """The partner's transfer began (its header was authorized)."""
    sends: list[trio.Event] = field(default_factory=list)
    """One per send of our outbox (to each partner we had this round), set when it ended."""
    no_shows: set[str] = field(default_factory=set)
    pulled: bool = False
    """``partner`` is a peer we pull from: it takes no payload from us."""
    pulling: bool = False
    """We ask for pulls: the payload may be of a round up to ``PULL_AHEAD_ROUNDS`` past ours."""
    told: dict[str, float] = field(default_factory=dict)
    """How many rounds ahead of ours each peer we asked is: by its busy answers (its round,
    less ours, plus how long before us it reached it as a share of our computing time), 0
    if it accepted, a pulled payload's round less ours."""
    scheduled: str | None = None
    """This round's scheduled partner, while we still wait for it (None: not, or no more)."""
    scheduled_until: float = 0.0
    """When we stop waiting for it (trio time)."""
    scheduled_ask_at: float = 0.0
    """When the larger id of the two asks it next (trio time)."""

    def waiting_for_scheduled(self) -> bool:
        return self.scheduled is not None and trio.current_time() < self.scheduled_until


@dataclass(slots=True)
class _Pulls:
    """Pulls of one round's payload from our outbox (valid until ``close_pulls``)."""

    index: int
    outbox: memoryview
    by: set[str] = field(default_factory=set)
    sends: list[tuple[trio.CancelScope, trio.Event]] = field(default_factory=list)


class Pairing:
    def __init__(
        self,
        host: TensorHostLike,
        *,
        send_timeout_s: float,
        is_member: Callable[[str], bool],
        upload_limit: RateLimit = UNLIMITED,
        rounds: int = 1 << 62,
        schedule_seed: str = "",
        prefer_share: float = PREFER_SHARE,
        overlap: float = 0.0,
    ) -> None:
        self._host = host
        self._overlap = min(1.0, max(0.0, overlap))
        """The share of a round's steps the worker takes while we pair (0: it waits)."""
        self._schedule_seed = schedule_seed
        """What the partner schedule hashes besides the round (the run's id)."""
        self._prefer_share = min(PREFER_SHARE, prefer_share)
        """The window's share of our round time: at most the run's ``outer.overlap`` (the
        steps the worker trains while we pair), so the wait stalls no compute; 0: none."""
        self._rounds = rounds
        """The run's rounds: no honest peer says it is at a round past them."""
        self._is_member = is_member
        self._asked_by: set[str] = set()
        """Peers whose question we are answering: one at a time each."""
        self._send_timeout_s = send_timeout_s
        self._upload_limit = upload_limit
        self._round: _Round | None = None
        self._last_round = -1
        self._asking = trio.Lock()
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._pulls: _Pulls | None = None
        self._ask_s = 0.0
        """How long our questions take (a moving average): the scale of our backoff."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.pulls_served = 0
        self.last_pulled = False
        """The last round's partner payload was a pull."""
        self.lead = 0.0
        """How many rounds our peers were ahead of our last round (``lead_of``; fractions
        of a round for how long before us they reached it)."""
        self.lag = 0
        """``lead``'s whole rounds."""
        self.vouched_lag = 0
        """``lag`` by two peers' word at least, even when only one is live (what skips rounds)."""
        self._leads: dict[str, tuple[int, float]] = {}
        """Peer → (our round when it told us, its lead in rounds then): ``lead``'s input, for
        ``LEAD_MEMORY_ROUNDS`` (a pair behind together hears the pair ahead one peer a round)."""
        self._boundary_at: float | None = None
        self._round_s: float | None = None
        """Our rounds' time, boundary to boundary (a moving average)."""
        self._paired_at: float | None = None
        """When our last pairing ended (the worker's steps to our next boundary went on)."""
        self._compute_s: float | None = None
        """A round's computing time (``compute_sample``, a moving average): ``_near``'s scale."""
        self._short = 1.0
        """The share of a round's steps our worker takes this round: under 1 when shortened
        (``caught_up``), for when we expect our boundary and for the round's time samples."""
        self.joining = False
        """We will start from a peer's state (a joiner from its start, a resync from its
        decision), at a round after its next boundary: an asker hears "never" (with "later",
        a lone trainer at its boundary asked us until its sweep ended while we waited for
        that very boundary: ~15 s in a test of 0.1 s rounds)."""

    @property
    def round_s(self) -> float | None:
        """Our rounds' time, boundary to boundary (a moving average; None before two boundaries)."""
        return self._round_s

    async def run(self, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve, deadline_s=ASK_TIMEOUT_S)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def authorize(self, peer_id: str, round_index: int, nbytes: int) -> str | None:
        """TensorReceiver check before any allocation: only our partner's payload for this round."""
        current = self._round
        if current is None or not self._round_ok(current, peer_id, round_index):
            return "not at that round boundary"
        if peer_id not in (current.partner, current.asking) or current.received:
            return "not our partner now"
        if nbytes != len(current.inbox):
            return f"our payload is {len(current.inbox)} bytes"
        if peer_id == current.partner:
            current.started = True
            self._notify()
        return None

    async def accept_payload(self, peer_id: str, payload: Payload) -> None:
        """TensorReceiver callback: keep our partner's payload for this round, drop others."""
        current = self._round
        if (
            current is None
            or not self._round_ok(current, peer_id, payload.round)
            or peer_id not in (current.partner, current.asking)
        ):
            logger.info("ignored a payload from %s for round %d (not our partner now)", peer_id, payload.round)
            return
        if len(payload.data) != len(current.inbox) or payload.specs[0].name != PAYLOAD_NAME:
            logger.warning("partner %s sent %d bytes, we expect %d", peer_id, len(payload.data), len(current.inbox))
            return
        self.bytes_received += len(payload.data)
        if current.pulling:
            # A pull's payload says where its sender is.
            current.told[peer_id] = max(current.told.get(peer_id, 0.0), float(payload.round - current.index))
        if peer_id != current.partner:
            # The peer accepted and sent before its "accept" reached us: keep it for a moment.
            current.early = bytes(payload.data)
            return
        current.inbox[:] = payload.data
        current.received = True
        self._notify()

    @staticmethod
    def _round_ok(current: _Round, peer_id: str, round_index: int) -> bool:
        """A payload of our round, or, from the peer we pull from, of a round a little past it."""
        if round_index == current.index:
            return True
        pulled_from = current.pulling and peer_id in (current.partner, current.asking)
        return pulled_from and 0 < round_index - current.index <= PULL_AHEAD_ROUNDS

    async def find_partner(
        self, round_index: int, outbox: memoryview, inbox: memoryview, candidates: list[str], *, timeout_s: float
    ) -> str | None:
        """Pair for this round and fill ``inbox`` with the partner's payload; the partner, or None."""
        await self.close_pulls(grace=False)  # the outbox holds this round's payload now
        now = trio.current_time()
        if self._boundary_at is not None and round_index == self._last_round + 1:
            # A shortened round counts as the whole round it stood for.
            left_out = (1.0 - self._short) * (self._compute_s or 0.0)
            self._round_s = _averaged(self._round_s, now - self._boundary_at + left_out)
            if self._paired_at is not None:
                computing = compute_sample(now - self._boundary_at, now - self._paired_at, self._overlap)
                self._compute_s = _averaged(self._compute_s, computing / self._short)
        self._short = 1.0
        self._boundary_at = now
        current = _Round(round_index, outbox, inbox)
        current.scheduled = scheduled_partner(self._schedule_seed, round_index, self._host.peer_id, candidates)
        prefer_s = FIRST_PREFER_S if self._round_s is None else self._prefer_share * self._round_s
        current.scheduled_until = now + (min(prefer_s, timeout_s / 4) if self._prefer_share > 0 else 0.0)
        current.scheduled_ask_at = now  # the larger id asks at once too (SCHEDULED_SLOW_ASK_S)
        self._round = current
        self._pulls = _Pulls(round_index, outbox)
        # The end of the bound is kept for a pull: peers behind us keep us asking ("later")
        # until it, while one a round ahead may still hold this round's payload.
        sweep_until = trio.current_time() + timeout_s - min(PULL_RESERVE_S, timeout_s / 4)
        try:
            with trio.move_on_after(timeout_s):
                while True:
                    await self._pair(current, candidates, sweep_until=sweep_until)
                    if current.partner is None:
                        await self._pull(current, candidates)
                    if current.partner is None:
                        return None  # nobody left who could pair for this round
                    if await self._await_payload(current):
                        break
                    # A no-show: penalized; look for someone else while the bound lasts.
                    candidates = [p for p in candidates if p not in current.no_shows]
                for sent in current.sends:  # the outbox is ours to reuse only once every send ended
                    await sent.wait()
            return current.partner if current.received else None
        finally:
            self.last_pulled = current.pulled and current.received
            self._remember_leads(round_index, current.told, candidates)
            self._round = None
            self._last_round = max(self._last_round, round_index)
            self._paired_at = trio.current_time()

    def _remember_leads(self, round_index: int, told: dict[str, float], candidates: Collection[str]) -> None:
        """What peers told us at round ``round_index`` (rounds ahead of it), with what our
        ``candidates`` (the live trainers: a peer gone or banned since counts no more) told
        in our last ``LEAD_MEMORY_ROUNDS`` rounds: ``lead``, ``lag``, ``vouched_lag``."""
        for peer_id, lead in told.items():
            self._leads[peer_id] = (round_index, lead)
        for peer_id, (at, _) in list(self._leads.items()):
            if at <= round_index - LEAD_MEMORY_ROUNDS or peer_id not in candidates:
                del self._leads[peer_id]
        leads = [lead for _, lead in self._leads.values()]
        self.lead = lead_of(leads, peers=len(candidates))
        self.lag = int(self.lead)
        self.vouched_lag = int(lead_of(leads, peers=max(2, len(candidates))))

    def caught_up(self, steps_share: float) -> None:
        """Our next round is shortened to ``steps_share`` of its steps (or rounds skipped)
        for ``lead``: what peers told us until now is spent (they were ahead of where we
        will be), and we expect our next boundary that much sooner (``_near``: a node
        catching up that judged by whole rounds said "never, not near" to the very peer
        ahead it was catching up with)."""
        self._leads.clear()
        self._short = min(1.0, max(0.0, steps_share)) or 1.0

    def worker_started(self) -> None:
        """Our worker (re)started (after a crash, a resync): the time since our last boundary
        was its start, not a round. Left in, one restart of 30 s in rounds of 1 s made our
        round time 9.7 s (a window of ~5 s at each boundary, idle in SPES) and our computing
        time as long, for rounds after (a second reader's finding). What peers told us
        before is stale too."""
        self._boundary_at = None
        self._short = 1.0
        self._leads.clear()
        self.joining = False  # started: from a peer's state, or ours (``_join`` clears it too)

    async def _await_payload(self, current: _Round) -> bool:
        """Until the partner's payload is in; False (and the partner penalized and dropped)
        if its transfer did not start within ``NO_SHOW_S``."""
        partner = current.partner
        assert partner is not None
        with trio.move_on_after(NO_SHOW_S):
            while not (current.started or current.received):
                changed = self._changed
                if current.started or current.received:
                    break
                await changed.wait()
        if not (current.started or current.received):
            current.no_shows.add(partner)
            current.partner = None
            reason = f"paired for round {current.index} and never sent its payload"
            await self._host.punish(partner, reason, points=NO_SHOW_POINTS)
            return False
        while not current.received:
            changed = self._changed
            if current.received:
                break
            await changed.wait()
        return True

    async def _pair(self, current: _Round, candidates: list[str], *, sweep_until: float) -> None:
        allowed = [
            p
            for p in candidates
            if self._host.tensor_refusal(p) is None and self._is_member(p) and p not in current.no_shows
        ]
        order = random.sample(allowed, len(allowed))
        if current.scheduled not in allowed:
            current.scheduled = None
        while current.partner is None:
            if not order:
                return  # everyone is paired for this round or already past it: go on alone now
            if current.waiting_for_scheduled():
                await self._pair_scheduled(current, order, sweep_until=sweep_until)
                continue
            for peer_id in list(order):
                if current.partner is not None or trio.current_time() >= sweep_until:
                    return
                async with self._asking:
                    if current.partner is not None:
                        return
                    answer = await self._ask_to_pair(current, peer_id)
                    if current.partner is not None:
                        return
                    if answer == "never":
                        order.remove(peer_id)
                if answer == "asking":
                    # It is asking someone, as we were: back off before asking anyone again.
                    changed = self._changed
                    # The question may have outlasted the sweep (a loaded peer): no pause then.
                    pause = min(backoff_s(self._ask_s, random.random()), sweep_until - trio.current_time())
                    pause = max(pause, 0.0)
                    with trio.move_on_after(pause):
                        await changed.wait()  # or someone paired with us meanwhile
            if not order:
                return  # the sweep heard "never" from everyone left: on to a pull, no pause
            changed = self._changed
            with trio.move_on_after(random.uniform(*RETRY_PAUSE_S)):
                await changed.wait()  # someone paired with us, or a pause before the next sweep
            if trio.current_time() >= sweep_until:
                return  # what is left of the bound is for a pull

    async def _ask_to_pair(self, current: _Round, peer_id: str) -> str:
        """Ask ``peer_id`` to pair (our asking lock held); on "accept" it is our partner and
        our payload starts out. The answer (``_ask``'s)."""
        current.asking = peer_id
        try:
            answer = await self._ask(peer_id, current)
        finally:
            current.asking = None
        if current.partner is not None:
            return answer  # our scheduled partner asked us meanwhile and we took it (``_answer``)
        if answer == "accept":
            current.partner = peer_id
            if current.early is not None:
                current.inbox[:] = current.early
                current.received = True
            self._start_sending(current)
        else:
            current.early = None
        return answer

    async def _pair_scheduled(self, current: _Round, order: list[str], *, sweep_until: float) -> None:
        """One sweep of the window for this round's scheduled partner: the smaller id asks it
        every sweep, the other at its boundary and then every ``SCHEDULED_SLOW_ASK_S``
        (mostly it is asked; asked while asking, it takes the smaller id's question), so a
        partner that cannot come (past the round, far behind, gone) says so to either; its
        "never" ends the window."""
        scheduled = current.scheduled
        assert scheduled is not None
        lower = self._host.peer_id < scheduled
        if lower or trio.current_time() >= current.scheduled_ask_at:
            async with self._asking:
                if current.partner is not None:
                    return
                answer = await self._ask_to_pair(current, scheduled)
                if current.partner is not None:
                    return  # it accepted, or asked us meanwhile and we took it
            if answer == "never":
                if scheduled in order:
                    order.remove(scheduled)
                current.scheduled = None
                return
            # Slower still where questions are slow (a loaded machine): the smaller id's asks
            # must find us not asking.
            gap = max(SCHEDULED_SLOW_ASK_S, BACKOFF_TIMES_ASK * self._ask_s)
            current.scheduled_ask_at = trio.current_time() + gap
        deadline = trio.current_time() + random.uniform(*RETRY_PAUSE_S) if lower else current.scheduled_ask_at
        changed = self._changed
        if current.partner is not None:
            return
        with trio.move_on_at(min(deadline, current.scheduled_until, sweep_until)):
            await changed.wait()  # it asked us and we paired, or the pause is over

    async def _pull(self, current: _Round, candidates: list[str]) -> None:
        """Nobody can pair with us for this round: take one peer's payload of it one way."""
        allowed = [
            p
            for p in candidates
            if self._host.tensor_refusal(p) is None and self._is_member(p) and p not in current.no_shows
        ]
        for peer_id in random.sample(allowed, len(allowed)):
            async with self._asking:
                if current.partner is not None:
                    return  # someone asked us to pair meanwhile
                current.pulling = True
                current.asking = peer_id
                try:
                    answer = await self._ask(peer_id, current, question="pull?")
                finally:
                    current.asking = None
                if answer == "accept":
                    current.partner = peer_id
                    current.pulled = True
                    if current.early is not None:
                        current.inbox[:] = current.early
                        current.received = True
                    return
                current.early = None

    async def _ask(self, peer_id: str, current: _Round, *, question: str = "pair?") -> str:
        """ "accept", "busy" (ask again later), "asking" (ask again later: it is asking
        someone) or "never" (it cannot pair for this round)."""
        started = trio.current_time()
        try:
            with trio.fail_after(ASK_TIMEOUT_S):
                stream = await self._host.open_stream(peer_id, PROTOCOL_ID, timeout_s=ASK_TIMEOUT_S)
                try:
                    await wire.send(stream, question, VERSION, {"round": current.index, "nbytes": len(current.outbox)})
                    reply = await wire.receive(
                        stream, msg_types=frozenset({"accept", "busy"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES
                    )
                finally:
                    await stream.close()
        except (ProtocolError, trio.TooSlowError) as exc:
            # Unreachable or silent now: it will not be our partner this round (a dead peer
            # stays "live" until its TTL runs out; asking it again would only burn the bound).
            logger.debug("asking %s to pair: %s", peer_id, exc)
            return "never"
        took = trio.current_time() - started
        self._ask_s += ASK_TIME_WEIGHT * (took - self._ask_s)
        told = reply.get("round")
        if reply["t"] == "accept" and question == "pair?":
            current.told[peer_id] = 0.0  # it pairs for our round: it is at it
        elif type(told) is int and self._rounds <= told < 1 << 62:
            reason = f"said it is at round {told} of {self._rounds}"
            await self._host.punish(peer_id, reason, points=PAST_THE_RUN_POINTS)
        elif type(told) is int and -1 <= told < 1 << 62:
            since = reply.get("since")
            if since is not None and not (type(since) is float and 0.0 <= since < math.inf):
                # An honest node says a finite float of seconds, never negative.
                await self._host.punish(peer_id, f"said it reached its round {since!r} s ago", points=BAD_SINCE_POINTS)
                since = None
            ahead = max(-1.0 - MAX_LAG, min(1.0 + MAX_LAG, float(told - current.index)))
            current.told[peer_id] = ahead + self._since_share(since)
        if reply["t"] == "accept":
            return "accept"
        if reply.get("retry") is False:
            return "never"
        return "asking" if reply.get("reason") == ASKING else "busy"

    async def _serve(self, stream: StreamLike) -> None:
        if stream.peer_id in self._asked_by:
            await wire.send(stream, "busy", VERSION, {"retry": True, "reason": "one question at a time"})
            return
        self._asked_by.add(stream.peer_id)
        try:
            await self._answer(stream)
        finally:
            self._asked_by.discard(stream.peer_id)

    async def _answer(self, stream: StreamLike) -> None:
        request = await wire.receive(
            stream, msg_types=frozenset({"pair?", "pull?"}), version=VERSION, max_nbytes=MAX_FRAME_NBYTES
        )
        round_index = wire.get_int(request, "round", lo=0, hi=1 << 62)
        nbytes = wire.get_int(request, "nbytes", lo=0, hi=1 << 40)
        current = self._round
        refusal = self._host.tensor_refusal(stream.peer_id)
        # "never": the asker should stop asking us for this round; "later": ask again.
        if not self._is_member(stream.peer_id):
            verdict: tuple[str, str] | None = ("never", "not a member of this run")
        elif refusal is not None:
            verdict = ("never", refusal)
        elif request["t"] == "pull?":
            await self._answer_pull(stream, round_index, nbytes)
            return
        elif current is None:
            if self._last_round >= round_index:
                verdict = ("never", "past that round")
            elif self.joining:
                verdict = ("never", JOINING)
            elif self._near(round_index):
                verdict = ("later", "computing")
            else:
                verdict = ("never", "behind: not near that round")
        elif current.index != round_index:
            # At an earlier boundary: "later" still (with "never" here, the never-sending
            # partner of tests/adversarial/test_training.py was no longer banned).
            verdict = ("never", "past that round") if current.index > round_index else ("later", "behind")
        elif current.partner is not None:
            verdict = ("never", "already paired")
        elif nbytes != len(current.outbox):
            verdict = ("never", f"payload of {nbytes} bytes, ours is {len(current.outbox)}")
        elif current.waiting_for_scheduled() and stream.peer_id != current.scheduled:
            verdict = ("later", WAITING_FOR_PARTNER)
        elif self._asking.locked() and not self._takes_while_asking(current, stream.peer_id):
            verdict = ("later", ASKING)
        else:
            verdict = None
        if verdict is not None:
            await wire.send(
                stream, "busy", VERSION, {"retry": verdict[0] == "later", "reason": verdict[1], **self._at()}
            )
            return
        assert current is not None
        current.partner = stream.peer_id
        await wire.send(stream, "accept", VERSION, {})
        self._start_sending(current)
        self._notify()

    def _takes_while_asking(self, current: _Round, asker: str) -> bool:
        """Asked while we ask someone: whether we take the question anyway. Our scheduled
        partner of the smaller id is the one who asks: taken even while we ask it ourselves,
        only to hear a "never". And two nodes asking each other to pair at once pair by id:
        the smaller id's question is taken, the larger's hears "asking" (both used to hear
        "asking" and back off, up to 0.3 s a round or more on a loaded machine: a pair
        behind its peers, asking each other once their scheduled partners said "never",
        lost that each round and stayed behind)."""
        if asker >= self._host.peer_id:
            return False
        scheduled = asker == current.scheduled and current.waiting_for_scheduled()
        return scheduled or (asker == current.asking and not current.pulling)

    async def _answer_pull(self, stream: StreamLike, round_index: int, nbytes: int) -> None:
        pulls = self._pulls
        if pulls is None or not 0 <= pulls.index - round_index <= PULL_AHEAD_ROUNDS:
            reason = "not holding that round's payload"
        elif nbytes != len(pulls.outbox):
            reason = f"payload of {nbytes} bytes, ours is {len(pulls.outbox)}"
        elif stream.peer_id in pulls.by:
            reason = "already pulled this round"
        else:
            pulls.by.add(stream.peer_id)
            # Counted before the "accept" goes out: a close_pulls during that write waits
            # for this send too (else it would read an outbox the worker is rewriting).
            scope, sent = trio.CancelScope(), trio.Event()
            pulls.sends.append((scope, sent))
            try:
                await wire.send(stream, "accept", VERSION, {})
            except BaseException:
                sent.set()
                raise
            assert self._nursery is not None
            self._nursery.start_soon(self._send_pull, stream.peer_id, pulls, scope, sent)
            return
        await wire.send(stream, "busy", VERSION, {"retry": False, "reason": reason, **self._at()})

    def _at(self) -> dict[str, int | float]:
        """The round we are at (at its boundary, or the last one we reached), and the seconds
        since we reached it: busy answers say both, so a node behind its peers learns by how
        far (``lead``), fractions of a round too."""
        at: dict[str, int | float] = {"round": self._round.index if self._round is not None else self._last_round}
        if self._boundary_at is not None:
            at["since"] = round(trio.current_time() - self._boundary_at, 3)
        return at

    def _since_share(self, since: object) -> float:
        """A peer's "since" (seconds since it reached the round it told) less our own time
        at our boundary, as a share of our round's computing time (what a shortened round
        saves; what ``_near`` judges by, so a peer too far ahead to wait for us is half a
        round ahead by this too): how far before us it reached it, in [0, SINCE_SHARE_MAX]
        (a stranger's word: anything else counts as 0; no computing time yet: 0)."""
        if type(since) is not float or self._compute_s is None or self._boundary_at is None:
            return 0.0
        ours = trio.current_time() - self._boundary_at
        share = (since - ours) / self._compute_s
        return min(SINCE_SHARE_MAX, share) if share > 0.0 else 0.0  # also a NaN

    def _near(self, round_index: int) -> bool:
        """Whether we expect to reach ``round_index``'s boundary soon (computing towards it)."""
        if self._boundary_at is None or self._paired_at is None or self._compute_s is None:
            return True  # no rounds to judge by yet (a node just started or restarted): ask again
        if round_index != self._last_round + 1:
            return False
        expected = next_boundary(self._boundary_at, self._paired_at, self._compute_s * self._short, self._overlap)
        return expected - trio.current_time() <= NEAR_BOUNDARY * self._compute_s

    async def _send_pull(self, peer_id: str, pulls: _Pulls, scope: trio.CancelScope, sent: trio.Event) -> None:
        payload = Payload(pulls.index, (TensorSpec(PAYLOAD_NAME, "uint8", (len(pulls.outbox),)),), pulls.outbox)
        try:
            with scope:
                await send_tensors(
                    self._host, peer_id, payload, timeout_s=self._send_timeout_s, limit=self._upload_limit
                )
                self.bytes_sent += len(pulls.outbox)
                self.pulls_served += 1
        except ProtocolError as exc:
            logger.info("sending round %d payload to %s (a pull) failed: %s", pulls.index, peer_id, exc)
        finally:
            sent.set()

    async def close_pulls(self, *, grace: bool = True) -> None:
        """Our outbox is about to be overwritten: no pull reads it once this returns. Pulls
        under way get ``pull_grace_s`` to finish (none with ``grace`` false), then are cut."""
        pulls, self._pulls = self._pulls, None
        if pulls is None:
            return
        if grace:
            with trio.move_on_after(pull_grace_s(len(pulls.outbox))):
                for _, sent in pulls.sends:
                    await sent.wait()
        for scope, _ in pulls.sends:
            scope.cancel()
        for _, sent in pulls.sends:
            await sent.wait()

    def _start_sending(self, current: _Round) -> None:
        assert self._nursery is not None and current.partner is not None
        sent = trio.Event()
        current.sends.append(sent)
        self._nursery.start_soon(self._send, current.partner, current, sent)

    async def _send(self, partner: str, current: _Round, sent: trio.Event) -> None:
        payload = Payload(current.index, (TensorSpec(PAYLOAD_NAME, "uint8", (len(current.outbox),)),), current.outbox)
        try:
            await send_tensors(self._host, partner, payload, timeout_s=self._send_timeout_s, limit=self._upload_limit)
            self.bytes_sent += len(current.outbox)
        except ProtocolError as exc:
            logger.info("sending round %d payload to %s failed: %s", current.index, partner, exc)
        finally:
            sent.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
