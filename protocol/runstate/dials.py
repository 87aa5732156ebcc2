"""Dialing the run's members we read about in the document but are not connected to.

Live members first, a bounded number in flight and at once (a stranger's made-up members
cost little). Each dial is a task of its own, so one that hangs (a NAT drops SYNs silently:
only its timeout tells) holds up no other. A member's newest record decides:

- a record with new addresses (behind NATs, the record that follows a member's first one
  names its relay circuit, a second later) is dialed at once, and the dial of the old
  addresses, still hanging, is cancelled (it held a dial slot, and, falling back to a
  relay, could make a second, relayed, connection to a member already reached);
- a member that got connected some other way (it dialed us) has its dial cancelled;
- a dial that failed backs off: the same addresses are not dialed again for the peer TTL.
  New addresses are dialed at once, but at most ``MAX_DIALS_PER_MEMBER`` dials per member
  per TTL: a member that publishes fresh addresses with every record gets no more.
"""

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from protocol.errors import ProtocolError
from protocol.net.hostlike import HostLike, PeerAddrs
from protocol.net.peers import PeerTable
from protocol.runstate.state import MemberRecord, RunState

logger = logging.getLogger(__name__)

MAX_PARALLEL_MEMBER_DIALS = 8
# Member dials in flight (queued for the limiter or dialing): enough for any honest run's
# newcomers between two sweeps.
MAX_DIALS_IN_FLIGHT = 32
# Dials of one member per peer TTL until one succeeds: its first record (a private address),
# the one with its first relay slot, the one with its second; a member that keeps
# publishing fresh addresses gets no more.
MAX_DIALS_PER_MEMBER = 3
# Members whose dials we remember (a window each): bounded, strangers come and go.
MAX_TRIES_KEPT = 4096


@dataclass(slots=True)
class MemberTries:
    """One member's dials since the first of a window (a peer TTL long) that none succeeded in."""

    since: float
    num_dials: int = 0
    tried: set[str] = field(default_factory=set)
    """Addresses dialed in the window."""

    def may_dial(self, addrs: tuple[str, ...], now: float, window_s: float) -> bool:
        """Whether ``addrs`` may be dialed now: some of them untried, and dials left in the
        window (a window older than ``window_s`` starts afresh here)."""
        if now - self.since > window_s:
            self.since, self.num_dials, self.tried = now, 0, set()
        return not self.tried.issuperset(addrs) and self.num_dials < MAX_DIALS_PER_MEMBER

    def dialing(self, addrs: tuple[str, ...]) -> None:
        self.num_dials += 1
        self.tried.update(addrs)


@dataclass(slots=True)
class _Dial:
    addrs: tuple[str, ...]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class MemberDials:
    """Runs the member dials of one run (``run``, a task of ``RunService``)."""

    def __init__(
        self,
        host: HostLike,
        state: RunState,
        peers: PeerTable,
        *,
        dial_timeout_s: float,
        sweep_interval_s: float,
        on_connected: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self._host = host
        self._state = state
        self._peers = peers
        self._dial_timeout_s = dial_timeout_s
        self._sweep_interval_s = sweep_interval_s
        self._on_connected = on_connected
        self._limiter = trio.CapacityLimiter(MAX_PARALLEL_MEMBER_DIALS)
        self._dialing: dict[str, _Dial] = {}
        """Member → its dial in flight (one at most: a newer one cancels it)."""
        self._tries: dict[str, MemberTries] = {}
        """Member → its dials since the last that succeeded (dropped when one does)."""

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                changed = self._state.changed  # taken first: a change while we dial still wakes us
                self._sweep(nursery)
                with trio.move_on_after(self._sweep_interval_s):
                    await changed.wait()

    def _sweep(self, nursery: trio.Nursery) -> None:
        connected = self._host.connected_peers()
        for peer_id in connected & self._dialing.keys():
            self._dialing[peer_id].scope.cancel()  # reached some other way
        for peer_id in connected & self._tries.keys():
            del self._tries[peer_id]  # the back-off was for a member we could not reach
        now = trio.current_time()
        if len(self._tries) > MAX_TRIES_KEPT:
            self._tries = {p: t for p, t in self._tries.items() if now - t.since <= self._peers.ttl_s}
        candidates = [
            m
            for m in self._state.members.values()
            if m.peer_id != self._host.peer_id
            and m.peer_id not in connected
            and m.addrs
            and not self._peers.is_banned(m.peer_id)
            and self._may_dial(m, now)
        ]
        candidates.sort(key=lambda m: (not self._peers.is_live(m.peer_id), -m.seq))
        room = MAX_DIALS_IN_FLIGHT - len(self._dialing)
        for member in candidates[: max(0, room)]:
            stale = self._dialing.get(member.peer_id)
            if stale is not None:
                stale.scope.cancel()  # its addresses are older than the record's
            dial = self._dialing[member.peer_id] = _Dial(member.addrs)
            self._tries.setdefault(member.peer_id, MemberTries(now)).dialing(member.addrs)
            nursery.start_soon(self._dial, PeerAddrs(member.peer_id, member.addrs), dial)

    def _may_dial(self, member: MemberRecord, now: float) -> bool:
        dial = self._dialing.get(member.peer_id)
        if dial is not None and dial.addrs == member.addrs:
            return False
        tries = self._tries.get(member.peer_id)
        return tries is None or tries.may_dial(member.addrs, now, self._peers.ttl_s)

    async def _dial(self, peer: PeerAddrs, dial: _Dial) -> None:
        error: ProtocolError | None = None
        try:
            with dial.scope:
                async with self._limiter:
                    await self._host.connect(peer, timeout_s=self._dial_timeout_s)
        except ProtocolError as exc:
            error = exc
        finally:
            if self._dialing.get(peer.peer_id) is dial:
                del self._dialing[peer.peer_id]
        if error is not None:
            logger.debug("member %s unreachable: %s", peer.peer_id, error)
            return
        if dial.scope.cancelled_caught and peer.peer_id not in self._host.connected_peers():
            return  # a newer record's dial took over
        self._tries.pop(peer.peer_id, None)
        await self._on_connected(peer.peer_id, "member")
