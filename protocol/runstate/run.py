"""Keeping one run's state and membership in step with its peers.

Tasks, all in one nursery:
- gossip: read the run topic; heartbeats mark peers live (a differing digest asks for a
  pull), pushed updates are validated and merged, "bye" ends a peer's liveness at once;
- heartbeat: publish ours every ``heartbeat_interval_s``, or less often in a large run:
  every node hears every heartbeat, so each node's interval is its live peers that are
  members in the document over ``HEARTBEATS_PER_S`` (a node then hears about that many a
  second, however large the run); each heartbeat says its interval, and its sender stays
  live for ``TTL_HEARTBEATS`` of them (at least the TTL). An announced interval is
  believed up to twice what ours would be (``heartbeat_every_s``): a peer cannot claim an
  hour of liveness in a run of ten. A peer we met is live from the state sync that
  follows, for as long as a heartbeat announcing our own interval would make it
  (``sync_live_for_s``), so nobody heartbeats early for a newcomer (that burst was N
  heartbeats heard by N nodes per join);
- anti-entropy: every ``anti_entropy_interval_s`` pull from one random live peer (half the
  time one whose last heartbeat's digest differs from ours) while some differ, and, when
  all agree, from any live peer once in ``ANTI_ENTROPY_IDLE_S``, which repairs whatever
  gossip dropped;
- pulls: a small pool of workers draining a de-duplicated queue of peers to sync with,
  at most one pull per peer per MIN_PULL_SPACING_S;
- members: dial members we read about in the document but are not connected to
  (protocol/runstate/dials.py);
- upkeep: after changes, write back the newest record of live members (and ours), and the
  best lease of live owners, that a delete or a replay took out of the document, and past
  ``MAX_MEMBERS`` records evict the silent oldest (protocol/runstate/state.py: the admission
  rule);
- expiry: drop peers silent for longer than the TTL.
"""

import contextlib
import logging
import math
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from protocol.errors import ProtocolError
from protocol.net import gossip
from protocol.net.hostlike import GossipMessage, HostLike
from protocol.net.peers import PeerTable
from protocol.runstate.dials import MemberDials
from protocol.runstate.state import MAX_MEMBERS, RunState
from protocol.runstate.sync import StateSync

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

NUM_PULL_WORKERS = 4
PULL_QUEUE_SIZE = 256
# Upkeep (restores, evictions) at most this often: every write leaves a tombstone, and an
# attacker replaying old records should cost us a write per second at most, not per message.
UPKEEP_SPACING_S = 1.0
# Pulls from one peer at most this often: every heartbeat with a stale digest asks for one.
MIN_PULL_SPACING_S = 1.0
# Heartbeats a node hears per second, at most, in a run larger than its interval covers
# (every member hears every heartbeat: each costs GossipSub's mesh degree in copies, ~1.4
# KB in and as much out) and CPU at every one of them: docs/scale.md. The price of so few:
# a crash is noticed after TTL_HEARTBEATS intervals, 3·N s.
HEARTBEATS_PER_S = 1.0
# A peer whose heartbeats come rarer than the TTL covers stays live for this many of them.
TTL_HEARTBEATS = 3
# With every live peer's digest equal to ours, anti-entropy pulls this often (a pull sends
# our state vector, ~10 bytes per author the document ever had).
ANTI_ENTROPY_IDLE_S = 60.0


class RunService:
    def __init__(
        self,
        host: HostLike,
        state: RunState,
        peers: PeerTable,
        *,
        role: str,
        heartbeat_interval_s: float,
        anti_entropy_interval_s: float,
        dial_timeout_s: float,
    ) -> None:
        self._host = host
        self.state = state
        self.peers = peers
        self._role = role
        self._heartbeat_interval_s = heartbeat_interval_s
        self._anti_entropy_interval_s = anti_entropy_interval_s
        self._topic = gossip.topic(state.run_id)
        self._sync = StateSync(host, state, live_for_s=self.sync_live_for_s)
        self._pull_send, self._pull_receive = trio.open_memory_channel[str](PULL_QUEUE_SIZE)
        self._queued: set[str] = set()
        self._last_pull: dict[str, float] = {}
        self._member_dials = MemberDials(
            host,
            state,
            peers,
            dial_timeout_s=dial_timeout_s,
            sweep_interval_s=anti_entropy_interval_s,
            on_connected=self.on_peer_connected,
        )
        self._idle_pull_at = -math.inf
        self._every_s, self._every_at = math.ceil(heartbeat_interval_s), -math.inf
        self.num_pulls = 0
        self.num_gossip_received = 0
        self.num_pull_failures = 0
        self.zo_hint: Callable[[str, bytes], Awaitable[None]] | None = None
        """Where gossiped ZO batches go (node/algorithms/zo/rounds.py verifies them); dropped while None."""
        self.zo_evidence: Callable[[bytes, bytes], Awaitable[None]] | None = None
        """Where gossiped ZO equivocation evidence goes (node/algorithms/zo/zosync.py checks it)."""

    async def run(self, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        self._sync.register()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._gossip_loop)
            for _ in range(NUM_PULL_WORKERS):
                nursery.start_soon(self._pull_worker)
            nursery.start_soon(self._heartbeat_loop)
            nursery.start_soon(self._anti_entropy_loop)
            nursery.start_soon(self._member_dials.run)
            nursery.start_soon(self._expiry_loop)
            nursery.start_soon(self._upkeep_loop)
            task_status.started()

    # --- entry points for other services ---

    def request_pull(self, peer_id: str) -> None:
        """Sync with ``peer_id`` soon (de-duplicated; dropped if the queue is full)."""
        if peer_id == self._host.peer_id or peer_id in self._queued or self.peers.is_banned(peer_id):
            return
        try:
            self._pull_send.send_nowait(peer_id)
        except trio.WouldBlock:
            return
        self._queued.add(peer_id)

    async def on_peer_connected(self, peer_id: str, source: str) -> None:
        logger.debug("connected to %s (%s)", peer_id, source)
        self.request_pull(peer_id)

    async def push(self, update: bytes) -> None:
        """Tell peers about a local change right away (a hint; pulls are the truth)."""
        if len(update) > gossip.MAX_PUSH_NBYTES:
            return
        await self._publish(gossip.Update(update))

    async def push_zo(self, batch: bytes) -> None:
        """Gossip a new ZO batch (a hint: peers pull what gossip loses)."""
        if len(batch) <= gossip.MAX_PUSH_NBYTES:
            await self._publish(gossip.ZoBatch(batch))

    async def push_zo_evidence(self, first: bytes, second: bytes) -> None:
        """Gossip the two batches that convict an author of equivocation."""
        if len(first) + len(second) <= gossip.MAX_PUSH_NBYTES:
            await self._publish(gossip.ZoEvidence(first, second))

    async def say_bye(self) -> None:
        await self._publish(gossip.Bye())

    # --- tasks ---

    async def _publish(self, payload: gossip.GossipPayload) -> None:
        try:
            await self._host.publish(self._topic, gossip.encode(payload))
        except ProtocolError as exc:
            logger.debug("gossip publish failed: %s", exc)

    async def _gossip_loop(self) -> None:
        # aclosing: a cancelled loop closes the subscription now, not whenever GC gets to it.
        async with contextlib.aclosing(self._host.subscribe(self._topic)) as messages:
            async for message in messages:
                self.num_gossip_received += 1
                if not self._host.guard.banned(message.from_peer):
                    # The boundary rule: whatever a message does to us is judged, never fatal.
                    await self._host.guard.run(message.from_peer, "gossip", self._on_gossip, message)

    async def _on_gossip(self, message: GossipMessage) -> None:
        sender = message.from_peer
        match gossip.decode(message.data):
            case gossip.Heartbeat(digest=digest, role=role, every_s=every_s):
                # Believed up to twice what we would announce: our view of the run's size.
                every = min(every_s or self._heartbeat_interval_s, 2 * self.heartbeat_every_s())
                ttl_s = max(self.peers.ttl_s, TTL_HEARTBEATS * every)
                if self.peers.seen(sender, digest=digest, role=role, ttl_s=ttl_s):
                    logger.info("peer %s is live (%s)", sender, role)
                if digest != self.state.digest:
                    self.request_pull(self._reachable_or_connected(sender))
            case gossip.Update(update=update):
                self.state.apply_remote(update)
            case gossip.Bye():
                logger.info("peer %s left", sender)
                self.peers.gone(sender)
            case gossip.ZoBatch(batch=batch):
                if self.zo_hint is not None:
                    await self.zo_hint(sender, batch)
            case gossip.ZoEvidence(first=first, second=second):
                if self.zo_evidence is not None:
                    await self.zo_evidence(first, second)

    def heartbeat_every_s(self) -> int:
        """Our heartbeat interval in whole seconds: the configured one, or our live peers
        over HEARTBEATS_PER_S in a run larger than that covers (counted at most once a
        second: every heartbeat heard asks)."""
        now = trio.current_time()
        if now - self._every_at >= 1.0:
            self._every_s, self._every_at = self._count_every_s(), now
        return self._every_s

    def sync_live_for_s(self) -> float:
        """How long a peer we just synced with counts as live: the TTL a heartbeat
        announcing our own interval would give it (our live member peers over
        HEARTBEATS_PER_S), at least the table's TTL. Not the document's size: records stay
        there long after their members left, and keys are free (a stranger's sync with a
        thousand made-up records would buy it thousands of seconds)."""
        return max(self.peers.ttl_s, float(TTL_HEARTBEATS * self.heartbeat_every_s()))

    def _count_every_s(self) -> int:
        # Live members in the document only: strangers heartbeating make no node slower to
        # hear, nor buy each other longer liveness (each is believed up to twice this).
        members = sum(1 for p in self.peers.live() if self.state.has_member(p))
        scaled = math.ceil(members / HEARTBEATS_PER_S)
        return min(gossip.MAX_HEARTBEAT_EVERY_S, max(math.ceil(self._heartbeat_interval_s), scaled))

    async def _heartbeat_loop(self) -> None:
        """Every interval (a newcomer, knowing few live peers, beats at the configured one
        until it has heard the run)."""
        while True:
            every_s = self.heartbeat_every_s()
            # A run within the configured interval announces nothing: what peers expect.
            announced = every_s if every_s > self._heartbeat_interval_s else 0
            await self._publish(gossip.Heartbeat(digest=self.state.digest, role=self._role, every_s=announced))
            await trio.sleep(max(self._heartbeat_interval_s, float(announced)))

    async def _anti_entropy_loop(self) -> None:
        while True:
            await trio.sleep(self._anti_entropy_interval_s * random.uniform(0.75, 1.25))
            live = self.peers.live()
            differ = sorted(p for p, info in live.items() if info.digest != self.state.digest)
            if differ:
                # Half the time from any live peer: peers that always say another digest
                # (strangers) must not take every repair pull.
                chosen = random.choice(differ if random.random() < 0.5 else sorted(live))
                self.request_pull(self._reachable_or_connected(chosen))
            elif live and trio.current_time() - self._idle_pull_at >= ANTI_ENTROPY_IDLE_S:
                self._idle_pull_at = trio.current_time()
                self.request_pull(self._reachable_or_connected(random.choice(sorted(live))))

    def _reachable_or_connected(self, peer_id: str) -> str:
        """``peer_id``, or, while our document holds no member but us and we hold no
        connection to it, one of our connections at random: a node that heard a run's
        gossip through its bootstrap peer and knows no one's address learns the run from the
        peers it is connected to, not by failing every pull to peers it has only heard of.
        Only then: a heartbeat from any key with any digest would otherwise make every node
        sync with an honest connection."""
        ours = int(self.state.has_member(self._host.peer_id))
        if self.state.num_members > ours:
            return peer_id
        connected = self._host.connected_peers()
        if peer_id in connected or not connected:
            return peer_id
        return random.choice(sorted(connected))

    async def _pull_worker(self) -> None:
        async for peer_id in self._pull_receive:
            self._queued.discard(peer_id)
            now = trio.current_time()
            if now - self._last_pull.get(peer_id, -1e9) < MIN_PULL_SPACING_S:
                continue
            self._last_pull[peer_id] = now
            try:
                await self._sync.pull(peer_id)
                self.num_pulls += 1
            except ProtocolError as exc:
                self.num_pull_failures += 1
                logger.debug("sync with %s failed: %s", peer_id, exc)

    async def _upkeep_loop(self) -> None:
        while True:
            changed = self.state.changed
            for update in self.upkeep():
                await self.push(update)
            await trio.sleep(UPKEEP_SPACING_S)
            await changed.wait()

    def upkeep(self) -> list[bytes]:
        """Restore the records of live members (and ours) a delete or replay took back; evict
        the silent oldest past MAX_MEMBERS. Returns the updates to push."""
        me = self._host.peer_id
        restore = [p for p in self.state.stale() if p == me or self.peers.is_live(p)]
        updates = [self.state.restore(restore)]
        leases = self.state.leases
        # A claim a replay or delete took back: written again while its owner is live.
        lost = [e for e in self.state.stale_leases() if leases[e].owner == me or self.peers.is_live(leases[e].owner)]
        updates.append(self.state.restore_leases(lost))
        members = self.state.members
        excess = len(members) - MAX_MEMBERS
        if excess > 0:
            silent = sorted(
                (r for p, r in members.items() if p != me and not self.peers.is_live(p)), key=lambda r: r.seq
            )
            evicted = [r.peer_id for r in silent[:excess]]
            logger.info("%d member records past %d: evicting %d silent ones", len(members), MAX_MEMBERS, len(evicted))
            updates.append(self.state.evict(evicted))
        if restore or lost:
            logger.info(
                "restored %d member records and %d leases a delete or a replay had taken back", len(restore), len(lost)
            )
        return [u for u in updates if u]

    async def _expiry_loop(self) -> None:
        while True:
            await trio.sleep(self._heartbeat_interval_s / 2)
            for peer_id in self.peers.expire():
                logger.info("peer %s expired (silent for over %.0f s)", peer_id, self.peers.ttl_s)
                self._last_pull.pop(peer_id, None)
