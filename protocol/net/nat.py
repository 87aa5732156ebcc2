"""Getting through NATs: reachability checks, a bounded relay service, relay reservations, DCUtR.

Most volunteers sit behind a NAT: nobody can dial them, but they can dial out. So:

- **Reachability**: a node asks up to three peers it reached directly to dial it back on
  a fresh TCP connection (protocol/net/dialback.py). Checked at start, whenever our addresses
  change, while still unknown, and every ``RECHECK_INTERVAL_S``. Any peer can lie, so no
  single answer decides (AutoNAT asks for several confirmations); ``Verdicts`` keeps the
  latest verdict of each server, with its time, across checks, so a small network adds up
  confirmations over successive checks. Over the verdicts younger than
  ``RECHECK_INTERVAL_S``, counting servers by the IP of our direct connection to them (two
  peers on one IP are one voice: a liar gets more votes only by getting more addresses):

  - ``public`` once at least ``CONFIRMATIONS`` distinct IPs confirmed a dial-back and
    successes outnumber failures. Once public, we stay public while successes outnumber
    failures (verdicts expire; the count need not be re-earned at every recheck);
  - ``private`` when failures reach successes (at least one failure), public or not before;
  - ``unknown`` otherwise (one confirmation so far, or no verdict). A check nobody answered
    changes nothing.

  Exception, for tiny networks: a preferred (bootstrap) peer's success counts as all the
  confirmations we need while it is the only peer that ever answered us. A node and its
  bootstrap alone (on loopback, in a fresh run) could never find a second voice, and the
  user chose that bootstrap: trusting it is trusting their own configuration. Once any
  other peer has answered, the exception is off for good: the network is no longer tiny,
  and that peer's verdict expiring must not bring the one-voice shortcut back. (On
  loopback every peer has one IP, so beyond that case a loopback node stays ``unknown``:
  true enough, only this machine can dial it.)
  When our addresses change, the verdicts about the old ones are forgotten and public has
  to be established again.

- **Relay service**: a public node offers circuit relay v2 (libp2p's ``CircuitV2Protocol``)
  with bounded reservations, circuits, bytes and seconds per circuit (``NatPolicy``).
  The HOP handler is registered at start (identify tells peers our protocols once, when
  we connect) and refuses while we are not public (``relay = "auto"``).

- **Reservations**: a private node reserves a slot on up to ``WANTED_RELAYS`` relays among
  the peers it reached, and its addresses then include
  ``<relay addr>/p2p/<relay>/p2p-circuit``. Peers that cannot dial us directly dial that.
  A node still ``unknown`` reserves too once a dial-back server said it sees us on an IP
  that is none of ours (``NatStatus.translated``: a NAT rewrites our address), without
  waiting for the verdict: behind a NAT that drops unsolicited SYNs, only the dial-back's
  timeout (``dialback.DIALBACK_TIMEOUT_S``, 3 s) tells, and the hint comes within a round
  trip. One slot then, not ``WANTED_RELAYS``: a wrong hint (a port forward, a cloud VM's
  one-to-one NAT, or a lying server) holds it on the relay until it expires there (15 min
  on ours, ``NatPolicy.reservation_ttl_s``; libp2p's default is an hour), though a node
  found public gives its slots up at once (and one that comes after the verdict).

- **DCUtR**: libp2p's ``DCUtRProtocol`` tries to hole-punch every relayed connection (both
  sides dial each other's observed address at once); a success leaves a direct connection
  and the relayed one is closed after a grace period. Needs endpoint-independent ("cone")
  NATs; behind a port-randomising NAT the pair stays relayed. The side whose peer id sorts
  first starts at once on a new relayed connection; our punches are bounded per peer and
  in all (``Punches``).

Nothing here carries tensors: the policy (tensors only over direct connections) is the
callers' (``Host.connection_type``, node/algorithms/noloco/pairing.py).
"""

import logging
import math
import random
from collections.abc import Collection
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from protocol.errors import DialError
from protocol.net import dialback
from protocol.net import upnp as igd
from protocol.net.addrs import ip_addr, local_ips, plain_ip
from protocol.net.conns import parse_peer_id, remote_ip, socket_stream_of
from protocol.net.hostlike import DirectHostLike

if TYPE_CHECKING:
    from trio_typing import TaskStatus


logger = logging.getLogger(__name__)

# Peers asked per check: more than CONFIRMATIONS, so one that does not answer (or lies)
# still leaves a majority, and few enough that a check costs the swarm little.
SERVERS_PER_CHECK = 3
# A NAT mapping or a port forward changes on the scale of minutes to hours: check again
# every 10 min, and drop verdicts older than that (they may describe another network).
RECHECK_INTERVAL_S = 600.0
# Distinct servers (distinct IPs) whose dial-back must succeed before we call ourselves
# public: one lying peer alone cannot make a node behind a NAT skip its relay slot.
CONFIRMATIONS = 2
# Servers whose latest verdict we keep (the oldest goes first): a check asks 3, and a
# handful of minutes of checks is all a verdict lives; bounded because strangers come and go.
MAX_VERDICTS = 64
# Servers whose last request time we keep, to skip those within their cooldown.
MAX_ASKED = 4096
# How often the loops look at addresses and back-offs (cheap: dict scans); they also wake
# at once when our status changes (``Nat.changed``: reachability, relay slots, connections).
POLL_S = 1.0
# How often the connection watcher looks at the connection table (a dict scan) while what
# it may see starts the next step on the way to a hole punch: while our reachability is not
# public (a new direct peer is asked for a dial-back at once) and while any connection of
# ours is relayed (to be punched). Otherwise, a public node with direct connections only,
# it looks every ``POLL_S`` (libp2p's connection notifee was tried instead: with it,
# trainers in one process stopped making rounds in tests/test_joining.py, not understood yet.)
WATCH_S = 0.25
WANTED_RELAYS = 2
RESERVE_TIMEOUT_S = 8.0
# A peer that refused a slot (most peers are not relays) is asked again after 30 s, then
# doubling up to 30 min: its reachability may change, but asking often only costs both.
RESERVE_RETRY_S = 30.0
# The same while we reserve on a hint, before our verdict: a relay that started with us
# has no verdict of its own yet either (it refuses until it knows it is public), so it is
# asked again after 1 s, then doubling (every peer speaks the relay protocol, so this is
# a few asks of each direct peer while our verdict takes, ~3 s).
HINTED_RESERVE_RETRY_S = 1.0
RESERVE_RETRY_MAX_S = 1800.0
# Before falling back to a relay, how long a direct dial of a peer that has relay
# addresses may take (a NAT drops our SYNs silently: only a timeout tells).
DIRECT_FIRST_TIMEOUT_S = 3.0
# The same, for a peer that publishes a circuit address of its own: dial-backs found it
# undialable, so its direct addresses answer only from its own network (a LAN: milliseconds).
CIRCUIT_PEER_DIRECT_S = 0.5
DCUTR_DIAL_TIMEOUT_S = 5
# How long a plain direct dial of a peer without a relay circuit of its own may take before
# a hole punch (libp2p's "unilateral upgrade" would take DCUTR_DIAL_TIMEOUT_S).
UNILATERAL_S = 1.0
# Extra hole-punch rounds for a pair still relayed: after 20 s, then 40, 80, 160, 320 s.
PUNCH_RETRY_S = 20.0
PUNCH_RETRIES = 5
# A retry that finds an exchange with the peer under way waits for its end, looking this
# often, this long at most (a punch to a port-randomising NAT dialed for ~22 s).
PUNCH_POLL_S = 0.5
PUNCH_ROUND_BOUND_S = 60.0
# A hole punch started the moment a relayed connection to a peer appears: per peer at
# once, then 10 and 20 s after the one before, no more (a peer whose relayed connection
# comes and goes, as a failed punch or the peer itself can make it, gets the backed-off
# rounds above and libp2p's driver, not a punch per appearance).
PUNCH_AT_ONCE_S = 5.0
PUNCHES_AT_ONCE = 3
# Our hole punches under way at once, all peers together: each dials every address it
# knows of its peer, a few rounds over seconds. A burst of relayed peers (a large run
# starting behind NATs) beyond it waits for the backed-off rounds and libp2p's driver.
MAX_PUNCHES_IN_FLIGHT = 8
# A relayed peer we lost is dialed through our relays again: at once, then after 10, 20, 40, 80 s.
REDIAL_S = 5.0
REDIALS = 5

REACHABILITY = ("unknown", "public", "private")
FORCED_REACHABILITY = ("auto", "public", "private")
RELAY_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class NatPolicy:
    """How a node deals with NATs: reachability, relay service limits (every limit bounds
    what strangers cost us), hole punching, UPnP."""

    mode: str = "auto"
    """auto: offer while AutoNAT says we are public; on: always; off: never."""
    max_reservations: int = 32
    max_circuits: int = 64
    circuit_duration_s: int = 3600
    circuit_data_mib: int = 64
    """Per relayed connection, both directions together: control traffic only fits."""
    reservation_ttl_s: int = 900
    """How long a slot on us lasts unless renewed (libp2p's default is an hour): a node that
    reserved on a wrong NAT hint, or found itself public, frees its slot within this."""
    reachability: str = "auto"
    """auto: found by dial-backs; public or private: as told (the node knows better)."""
    hole_punch: bool = True
    """Upgrade relayed connections with DCUtR (off: they stay relayed)."""
    upnp: bool = False
    """Ask the router to forward our listen port (UPnP IGD, protocol/net/upnp.py)."""
    ssdp_addr: tuple[str, int] = igd.SSDP_ADDR
    """Where UPnP discovery asks (the multicast group; tests point it at a fake gateway)."""

    def libp2p_limits(self) -> RelayLimits:
        return RelayLimits(
            duration=self.circuit_duration_s,
            data=self.circuit_data_mib << 20,
            max_circuit_conns=self.max_circuits,
            max_reservations=self.max_reservations,
            reservation_ttl=self.reservation_ttl_s,
        )


@dataclass(slots=True)
class Reservation:
    relay: str
    relay_addr: str
    """The relay's transport address as we reached it (``/ip4/…/tcp/…`` or ``/ip6/…``)."""
    since: float

    @property
    def circuit_addr(self) -> str:
        return f"{self.relay_addr}/p2p/{self.relay}/p2p-circuit"


@dataclass(slots=True)
class NatStatus:
    reachability: str = "unknown"
    observed_ip: str | None = None
    checks: int = 0
    offering_relay: bool = False
    reservations: dict[str, Reservation] = field(default_factory=dict)
    upnp: str = "off"
    """off, mapping, mapped, unmapped (stopping or renewal failed), or failed: <why>."""
    upnp_addr: str | None = None
    """The router's public address and port forwarded to us, while mapped."""
    upnp_data: dict[int, str] = field(default_factory=dict)
    """Our data channels' ports (``map_data_port``) and each one's mapping state, as ``upnp``."""
    translated: str | None = None
    """An IP a dial-back server saw us on that is none of ours (a NAT's), if one did."""
    first_direct_s: float | None = None
    """Seconds from start to the first direct connection to a peer we had reached only by relay."""
    punch_retries: dict[str, int] = field(default_factory=dict)
    """Per peer, our extra hole-punch rounds (``PUNCH_RETRY_S``) that ended with the peer
    still relayed (a simulation calls a pair's link final after one: node/simulate)."""
    timeline: dict[str, float] = field(default_factory=dict)
    """Seconds from start to the first of each step on the way to a hole punch: ``asked``
    (the first dial-back request), ``translated`` (a server saw us on an IP not ours),
    ``verdict`` (reachability decided), ``reserved`` (a relay slot), ``relayed`` (a
    connection through a relay), ``punch`` (we started a hole punch on one), ``direct`` (as
    ``first_direct_s``)."""


def is_circuit(addr: str) -> bool:
    return "/p2p-circuit" in addr


class _HolePunch(DCUtRProtocol):  # type: ignore[misc]  # libp2p's module is untyped to mypy here
    """libp2p's DCUtR without its "unilateral upgrade" (a plain direct dial of the peer's
    known addresses, for up to ``dial_timeout``, before every hole punch).

    A relayed connection exists because a direct dial failed (``Host.connect`` dials direct
    addresses first), and the hole punch itself dials every address we know of the peer
    plus those it observed for itself, so a reachable one is still found. Behind NATs
    the plain dial only delays the punch: its SYNs to the peer's private address are
    dropped and it waited out all 5 s (measured in the test bed: ``relayed`` to ``direct``
    took 6 s, 5 of them here).
    """

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        # A peer that publishes a relay circuit is behind a NAT itself: only the punch reaches
        # it. One that does not may be public (its plain dial works where our punch, which
        # dials as the responder, stalls against a plain listener): a short try, as libp2p's.
        try:
            known = [str(a) for a in self.host.get_peerstore().addrs(peer_id)]
        except (BaseLibp2pError, KeyError):  # nothing known of it
            return False
        if any(is_circuit(a) for a in known):
            return False
        with trio.move_on_after(UNILATERAL_S):
            return bool(await super()._try_unilateral_upgrade(peer_id))
        return False

    def in_progress(self, peer_id: ID) -> bool:
        """An exchange with the peer is under way (ours, libp2p's driver's, or the peer's)."""
        return peer_id in self._in_progress

    def exchanges_started(self, peer_id: ID) -> int:
        """How many DCUtR exchanges we began with the peer since its budget was last reset
        (libp2p counts one only when the exchange really starts: not when the peer's own
        punch is under way, nor after a direct dial made it needless)."""
        return int(self._hole_punch_attempts.get(peer_id, 0))


class Punches:
    """Which peers our hole punches are under way with, and whether one more may start:
    one per peer, ``MAX_PUNCHES_IN_FLIGHT`` in all, and the immediate ones (on a new relayed
    connection) ``PUNCHES_AT_ONCE`` per peer, backing off. No hosts, no clock."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self._at_once = Retries(PUNCH_AT_ONCE_S, PUNCHES_AT_ONCE, first_at_once=True)

    def may_start(self, peer_id: str) -> bool:
        return peer_id not in self.running and len(self.running) < MAX_PUNCHES_IN_FLIGHT

    def take_at_once(self, peer_id: str, now: float) -> bool:
        """Whether an immediate punch to ``peer_id`` may start now (and counts it if so)."""
        return self.may_start(peer_id) and self._at_once.take(peer_id, now) is not None


class DialbackAsks:
    """When we last asked each server for a dial-back. One asked within its cooldown
    (``dialback.COOLDOWN_S``) would refuse, so it is not asked. Bounded: strangers come and go."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def due(self, server: str, now: float) -> bool:
        return now - self._at.get(server, -math.inf) >= dialback.COOLDOWN_S

    def note(self, servers: list[str], now: float) -> None:
        if len(self._at) > MAX_ASKED:  # only those within their cooldown still matter
            self._at = {s: at for s, at in self._at.items() if now - at < dialback.COOLDOWN_S}
        for server in servers:
            self._at[server] = now


class Retries:
    """Per peer, at most ``limit`` tries, ``first_s`` apart, then doubling: 1×, 2×, 4×...

    ``first_at_once``: the first try is due when the peer is first seen; otherwise one
    interval later. Bounded in peers: strangers come and go.
    """

    MAX_PEERS = 4096

    def __init__(self, first_s: float, limit: int, *, first_at_once: bool) -> None:
        self._first_s = first_s
        self._limit = limit
        self._first_at_once = first_at_once
        self._tries: dict[str, tuple[int, float]] = {}
        """Peer → (tries so far, when the last began)."""

    def take(self, peer_id: str, now: float) -> int | None:
        """Start a try if one is due: its number (1, 2, ...), else None."""
        if len(self._tries) > self.MAX_PEERS:
            self._tries.clear()
        tries, last = self._tries.setdefault(peer_id, (0, now - self._first_s if self._first_at_once else now))
        if tries >= self._limit or now - last < self._first_s * 2**tries:
            return None
        self._tries[peer_id] = (tries + 1, now)
        return tries + 1

    def exhausted(self, peer_id: str) -> bool:
        return self._tries.get(peer_id, (0, 0.0))[0] >= self._limit

    def forget(self, peer_id: str) -> None:
        self._tries.pop(peer_id, None)


@dataclass(frozen=True, slots=True)
class Verdict:
    reached: bool
    server_ip: str
    """The server's IP on our direct connection to it (``Host.direct_ip``), not what it claims."""
    at: float


class Verdicts:
    """The latest dial-back verdict per server and the reachability they add up to (the
    rule is in the module docstring). No hosts, no clock: times are passed in."""

    def __init__(self) -> None:
        self._latest: dict[str, Verdict] = {}
        """Server → its latest verdict; insertion order is age order (re-added on update)."""
        self._first_answerer: str | None = None
        self._others_answered = False
        """Whether a peer other than the first ever answered (bounded: all the exception needs)."""
        self._public = False
        """Public was established by these verdicts (and not overturned since)."""

    def add(self, server: str, server_ip: str, reached: bool, now: float) -> None:
        if self._first_answerer is None:
            self._first_answerer = server
        elif server != self._first_answerer:
            self._others_answered = True
        self._latest.pop(server, None)
        self._latest[server] = Verdict(reached, server_ip, now)
        for old, verdict in list(self._latest.items()):
            if len(self._latest) > MAX_VERDICTS or now - verdict.at > RECHECK_INTERVAL_S:
                del self._latest[old]

    def __len__(self) -> int:
        return len(self._latest)

    def fresh(self, server: str, now: float) -> bool:
        """Whether ``server``'s verdict still counts (younger than ``RECHECK_INTERVAL_S``):
        while reachability stays unknown, asking it again every cooldown cost every node a
        dial-back a second per ten peers (a second reader's count: ~24 a second in a 16-node
        simulation on one machine) and adds no confirmation."""
        verdict = self._latest.get(server)
        return verdict is not None and now - verdict.at <= RECHECK_INTERVAL_S

    def forget(self) -> None:
        """Our addresses changed: the verdicts were about the old ones. Who ever answered is
        kept (it is about the network, not about us)."""
        self._latest.clear()
        self._public = False

    def reachability(self, preferred: Collection[str], now: float) -> str:
        """``public``, ``private`` or ``unknown`` from the verdicts younger than
        ``RECHECK_INTERVAL_S``; remembers whether public was established."""
        live = [v for v in self._latest.values() if now - v.at <= RECHECK_INTERVAL_S]
        successes = len({v.server_ip for v in live if v.reached})
        failures = len({v.server_ip for v in live if not v.reached})
        confirmations = successes
        if successes and not self._others_answered and self._first_answerer in preferred:
            confirmations = CONFIRMATIONS  # our bootstrap is all the network there is: trust it
        self._public = successes > failures and (self._public or confirmations >= CONFIRMATIONS)
        if self._public:
            return "public"
        return "private" if failures >= successes and failures else "unknown"


class Nat:
    """Reachability, relay service, reservations and hole punching for one host.

    Built by ``open_host`` before the host connects anywhere (its stream handlers must be
    in the first identify our peers see); ``Host.nat`` is this.
    """

    def __init__(self, raw_host: IHost, policy: NatPolicy) -> None:
        self._raw = raw_host
        self.policy = policy
        self.status = NatStatus()
        if policy.reachability != "auto":
            self.status.reachability = policy.reachability
            self.status.offering_relay = self._offering()
        self.changed = trio.Event()
        """Set (and replaced) whenever reachability, our relay slots or a connection's type change."""
        self._news = trio.Event()
        """Set (and replaced) with ``changed``: wakes our other loops at once."""
        self._preferred: list[str] = []
        self._verdicts = Verdicts()
        self._checking = trio.Lock()
        self._asked = DialbackAsks()
        self._last_check_answered = False
        self._reserve_failed: dict[str, tuple[float, float]] = {}
        """Peer → (when it last refused us a slot, how long to wait before asking again)."""
        self._relayed_once: set[str] = set()
        self._punch_retries = Retries(PUNCH_RETRY_S, PUNCH_RETRIES, first_at_once=False)
        """Our extra hole-punch rounds per relayed peer."""
        self._punches = Punches()
        self._redials = Retries(REDIAL_S, REDIALS, first_at_once=True)
        """Redials per lost relayed peer (forgotten once it is back)."""
        self._started_at = 0.0
        self._nursery: trio.Nursery | None = None
        self._data_mappings: dict[int, trio.CancelScope] = {}
        """Data channels' ports kept forwarded by UPnP (``map_data_port``), each its task's scope."""
        self._stopped = False
        limits = policy.libp2p_limits()
        self._circuit = CircuitV2Protocol(raw_host, limits=limits, allow_hop=False)
        roles = RelayRole.STOP | RelayRole.CLIENT
        self._transport = CircuitV2Transport(raw_host, self._circuit, RelayConfig(roles=roles, limits=limits))
        self._dcutr = _HolePunch(raw_host, dial_timeout=DCUTR_DIAL_TIMEOUT_S)
        if policy.mode != "off":
            raw_host.set_stream_handler(HOP_PROTOCOL_ID, self._serve_hop)

    def prefer(self, peer_ids: list[str]) -> None:
        """Ask these first for dial-backs and reservations (the bootstrap peers)."""
        self._preferred = list(peer_ids)

    async def run(self, host: DirectHostLike, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        self._started_at = trio.current_time()
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(background_trio_service(self._circuit))
            if self.policy.hole_punch:
                await stack.enter_async_context(background_trio_service(self._dcutr))
            nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery = nursery
            if self.policy.reachability == "auto":
                nursery.start_soon(self._reachability_loop, host)
            nursery.start_soon(self._reservation_loop, host)
            nursery.start_soon(self._watch_connections, host)
            ports = self._listen_ports()
            if self.policy.upnp and ports:
                nursery.start_soon(igd.keep_mapped, ports[0], self.policy.ssdp_addr, self._upnp_changed)
            task_status.started()
            await trio.sleep_forever()

    def stop(self) -> None:
        """The host is closing: our loops end (none dials, asks or reserves any more)."""
        self._stopped = True
        self._wake()

    # --- connection types ---

    def connection_type(self, peer_id: str) -> str | None:
        """ "direct" if any connection to the peer is a TCP socket of ours, "relayed" if all
        go through a relay, None if not connected."""
        try:
            conns = self._raw.get_network().connections.get(parse_peer_id(peer_id), [])
        except DialError:
            return None
        if not conns:
            return None
        return "direct" if any(socket_stream_of(c) is not None for c in conns) else "relayed"

    def connection_types(self) -> dict[str, str]:
        """``connection_type`` of every connected peer, in one pass (the watcher's scan)."""
        return {
            peer.to_base58(): "direct" if any(socket_stream_of(c) is not None for c in conns) else "relayed"
            for peer, conns in list(self._raw.get_network().connections.items())
            if conns
        }

    async def _watch_connections(self, host: DirectHostLike) -> None:
        """Notes peers reached by relay, when the first of them became direct, and tells
        ``changed`` when any connection comes, goes or changes type (libp2p has no event)."""
        last: dict[str, str] = {}
        while not self._stopped:
            news = self._news  # taken first: a connection that comes while we look still wakes us
            self._drop_lost_relays()  # a peer is redialed only through relays we still reach
            types = self.connection_types()
            before, last = last, types
            if types != before:
                self._notify()
            for peer_id in self._relayed_once - types.keys():
                self._maybe_redial(peer_id)
            for peer_id, kind in types.items():
                self._redials.forget(peer_id)
                if kind == "relayed":
                    self._mark("relayed")
                    self._relayed_once.add(peer_id)
                    if before.get(peer_id) != "relayed":
                        self._punch_now_if_first(peer_id)
                    self._maybe_punch_again(peer_id)
                else:
                    self.status.punch_retries.pop(peer_id, None)  # direct now: a later relay counts afresh
                    if peer_id in self._relayed_once and self.status.first_direct_s is None:
                        self.status.first_direct_s = self._mark("direct")
                        logger.info("hole punch: direct connection to %s", peer_id)
            await _nap(news, watch_interval_s(self.status.reachability, types))

    def _punch_now_if_first(self, peer_id: str) -> None:
        """A new relayed connection: the side whose peer id sorts first starts the hole punch
        at once. libp2p's own driver looks only every 2 s (from both sides; it stays the
        fallback, and it skips a peer whose punch is under way). One side only, because two
        members often dial each other through relays at the same time, so "the inbound side
        starts" (DCUtR's spec) could name both or neither. Bounded per peer and in all
        (``Punches``)."""
        if not starts_punch(self._raw.get_id().to_base58(), peer_id) or not self.policy.hole_punch:
            return
        if self._nursery is None or not self._punches.take_at_once(peer_id, trio.current_time()):
            return
        self._mark("punch")
        self._start_punch(peer_id)

    def _maybe_punch_again(self, peer_id: str) -> None:
        """DCUtR tries three times per connection, seconds apart; on a busy machine or a
        flaky path all three can fail. We try again, backing off, a bounded number of times."""
        if not self.policy.hole_punch or self._nursery is None or not self._punches.may_start(peer_id):
            return
        tries = self._punch_retries.take(peer_id, trio.current_time())
        if tries is None:
            return
        logger.debug("hole punch to %s: trying again (%d of %d)", peer_id, tries, PUNCH_RETRIES)
        self._dcutr.on_peer_disconnected(parse_peer_id(peer_id))  # resets its attempt budget for this peer
        self._start_punch(peer_id, retry=True)

    def _start_punch(self, peer_id: str, *, retry: bool = False) -> None:
        assert self._nursery is not None
        self._punches.running.add(peer_id)  # now, not when the task starts: the caps count it
        self._nursery.start_soon(self._punch, peer_id, retry)

    def _maybe_redial(self, peer_id: str) -> None:
        """A peer we reached only by relay and lost (a failed hole punch can take the relayed
        connection with it): dial it through our relays again, backing off, a few times."""
        if self._nursery is None or not self.status.reservations or self._stopped:
            return
        if self._redials.take(peer_id, trio.current_time()) is not None:
            self._nursery.start_soon(self._redial, peer_id)
        elif self._redials.exhausted(peer_id):
            self._relayed_once.discard(peer_id)  # gone for good, as far as we can tell

    async def _redial(self, peer_id: str) -> None:
        for addr in self.circuit_addrs_for(peer_id, []):
            with trio.move_on_after(DIRECT_FIRST_TIMEOUT_S * 3):
                try:
                    await self.dial_circuit(addr)
                    logger.info("reconnected to %s through a relay", peer_id)
                    return
                except DialError as exc:
                    logger.debug("redialing %s: %s", peer_id, exc)

    async def _punch(self, peer_id: str, retry: bool = False) -> None:
        peer: ID | None = None
        before = 0
        try:
            peer = parse_peer_id(peer_id)
            before = self._dcutr.exchanges_started(peer)
            await self._dcutr.initiate_hole_punch(peer)
        except (BaseLibp2pError, OSError, DialError) as exc:
            logger.debug("hole punch to %s: %s", peer_id, exc)
        finally:
            self._punches.running.discard(peer_id)
        if not retry or peer is None:
            return
        if self._dcutr.exchanges_started(peer) == before:
            # Ours returned at once: an exchange with the peer was under way (libp2p's own
            # driver takes the budget our retry reset, or the peer punches us). The round is
            # that one: it counts once it ended (a second reader saw a retry counted while
            # the peer's punch still dialed; one to a port-randomising NAT dials ~22 s).
            for _ in range(int(PUNCH_ROUND_BOUND_S / PUNCH_POLL_S)):
                if not self._dcutr.in_progress(peer):
                    break
                await trio.sleep(PUNCH_POLL_S)  # libp2p's DCUtR tells no end of an exchange
            else:
                return
        if self.connection_type(peer_id) == "relayed":
            retries = self.status.punch_retries
            if len(retries) >= Retries.MAX_PEERS and peer_id not in retries:
                retries.clear()  # bounded as the rounds' own bookkeeping is: strangers come and go
            retries[peer_id] = retries.get(peer_id, 0) + 1
            self._notify()

    # --- dialing through relays ---

    def circuit_addrs_for(self, peer_id: str, known: list[str]) -> list[str]:
        """Circuit addresses to try for ``peer_id``: its own, then through our relays."""
        ours = [f"{r.circuit_addr}/p2p/{peer_id}" for r in self.status.reservations.values() if r.relay != peer_id]
        theirs = [a if a.endswith(f"/p2p/{peer_id}") else f"{a}/p2p/{peer_id}" for a in known if is_circuit(a)]
        return list(dict.fromkeys(theirs + ours))

    async def dial_circuit(self, addr: str) -> None:
        try:
            await self._transport.dial(multiaddr.Multiaddr(addr))
        except (BaseLibp2pError, OSError, ConnectionError, ValueError) as exc:
            raise DialError(f"relayed dial {addr} failed: {exc}") from exc

    def our_circuit_addrs(self) -> list[str]:
        return [r.circuit_addr for r in self.status.reservations.values()]

    def extra_addrs(self) -> list[str]:
        """Addresses we learned we have: the UPnP-forwarded one, then our relay circuits."""
        return ([self.status.upnp_addr] if self.status.upnp_addr else []) + self.our_circuit_addrs()

    # --- UPnP ---

    def _upnp_changed(self, state: str, addr: str | None) -> None:
        self.status.upnp, self.status.upnp_addr = state, addr
        self._notify()

    def map_data_port(self, port: int) -> None:
        """Have the router forward a data channel's TCP port too (protocol/net/data_channel.py),
        under the same number, when UPnP is on: a node public through UPnP announces that
        port to the peers that send to it (NoLoCo payloads, SPES expert versions), and
        without the mapping they could not reach it (each send fell back to libp2p streams
        after a failed connection). Kept until ``unmap_data_port`` (the channel closed) or
        this service stops; nothing without UPnP."""
        if not self.policy.upnp or self._nursery is None or self._stopped:
            return
        if not 0 < port <= 65535 or port in self._data_mappings:
            return
        scope = trio.CancelScope()
        self._data_mappings[port] = scope
        self.status.upnp_data[port] = "mapping"
        self._nursery.start_soon(self._keep_data_port, port, scope)

    def unmap_data_port(self, port: int) -> None:
        """The channel on ``port`` closed: the router's forward of it goes (an ephemeral port
        another process may take next must not stay reachable from outside)."""
        scope = self._data_mappings.pop(port, None)
        if scope is not None:
            scope.cancel()

    async def _keep_data_port(self, port: int, scope: trio.CancelScope) -> None:
        def changed(state: str, _addr: str | None) -> None:
            if port in self.status.upnp_data:
                self.status.upnp_data[port] = state
                self._notify()

        with scope:
            await igd.keep_mapped(port, self.policy.ssdp_addr, changed)
        self.status.upnp_data.pop(port, None)  # removed from the router (keep_mapped's finally)
        self._notify()

    # --- relay service ---

    def _offering(self) -> bool:
        return self.policy.mode == "on" or (self.policy.mode == "auto" and self.status.reachability == "public")

    async def _serve_hop(self, stream: INetStream) -> None:
        if not self._offering():
            logger.debug("refused a relay request from %s: not offering relay", stream.muxed_conn.peer_id)
            await stream.reset()
            return
        await self._circuit._handle_hop_stream(stream)

    # --- reachability ---

    def _listen_ports(self) -> list[int]:
        ports = []
        try:
            listening = self._raw.get_transport_addrs()
        except OSError:  # a listener closed (the host stops): nothing to dial back
            return []
        for addr in listening:
            try:
                ports.append(int(addr.value_for_protocol("tcp")))
            except (BaseLibp2pError, ValueError, multiaddr.exceptions.Error):
                continue
        return sorted(set(ports))[: dialback.MAX_PORTS]

    def _servers(self, host: DirectHostLike) -> list[str]:
        """Direct peers to ask, preferred first; not those asked within the dial-back
        cooldown (they would refuse)."""
        now = trio.current_time()
        direct = [
            p
            for p, kind in self.connection_types().items()
            if kind == "direct"
            and self._asked.due(p, now)
            and not self._verdicts.fresh(p, now)  # asked again, it adds no confirmation
        ]
        preferred = [p for p in self._preferred if p in direct]
        others = [p for p in direct if p not in preferred]
        random.shuffle(others)
        return (preferred + others)[:SERVERS_PER_CHECK]

    async def check_reachability(self, host: DirectHostLike) -> str:
        """Ask up to ``SERVERS_PER_CHECK`` peers for dial-backs; the reachability their
        verdicts add up to. One check at a time (a second caller waits, then asks only
        peers the first did not)."""
        async with self._checking:
            return await self._check_reachability(host)

    async def _check_reachability(self, host: DirectHostLike) -> str:
        ports = self._listen_ports()
        servers = self._servers(host)
        self._last_check_answered = False
        if not ports or not servers:
            return self.status.reachability
        self._mark("asked")
        self._asked.note(servers, trio.current_time())
        answers: list[tuple[str, str, bool, str | None]] = []
        """(server, its IP on our connection, reached, the IP it saw us on) per answer."""

        async def ask(server: str) -> None:
            server_ip = host.direct_ip(server)
            if server_ip is None:  # the connection went relayed or away since we picked it
                return
            verdict = await dialback.ask(host, server, ports, on_seen=lambda ip: self._seen(host, ip))
            if verdict is not None:
                answers.append((server, server_ip, *verdict))

        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(ask, server)
        self.status.checks += 1
        self._last_check_answered = bool(answers)
        if not answers:
            return self.status.reachability
        now = trio.current_time()
        for server, server_ip, reached, _ in answers:
            self._verdicts.add(server, server_ip, reached, now)
        reachability = self._verdicts.reachability(self._preferred, now)
        observed = next((ip for *_, ip in answers if ip), None)
        if reachability != self.status.reachability or observed != self.status.observed_ip:
            logger.info(
                "reachability: %s (seen as %s; %d of %d peer(s) dialed us back this check)",
                reachability,
                observed,
                sum(reached for _, _, reached, _ in answers),
                len(answers),
            )
            self.status.reachability = reachability
            self.status.observed_ip = observed
            if reachability != "unknown":
                self._mark("verdict")
            if reachability == "public":
                self._give_up_reservations()
            self.status.offering_relay = self._offering()
            self._notify()
        return reachability

    def _seen(self, host: DirectHostLike, ip: str) -> None:
        """A dial-back server sees us on ``ip`` (before its verdict; canonical, as dialback
        gives it): if that is none of our addresses, a NAT translates them, and we reserve
        relay slots without waiting."""
        if self.status.translated is not None or ip in _our_ips(host):
            return
        logger.info("a peer sees us on %s, none of our addresses: behind a NAT, reserving relay slots now", ip)
        self.status.translated = ip
        self._mark("translated")
        self._notify()

    def _relays_wanted(self) -> int:
        """How many relay slots we want: ``WANTED_RELAYS`` while private; one while not known
        yet and a server saw our address translated (a wrong hint holds it on the relay until
        the slot expires there: not two); none otherwise."""
        reachability = self.status.reachability
        if reachability == "private":
            return WANTED_RELAYS
        return 1 if reachability == "unknown" and self.status.translated is not None else 0

    def _give_up_reservations(self) -> None:
        """Found public: our relay slots go (their circuits leave our addresses, and libp2p
        stops renewing them; the relay keeps the slot until it expires there)."""
        if not self.status.reservations:
            return
        for relay in list(self.status.reservations):
            self._forget_slot(relay)
            del self.status.reservations[relay]
        logger.info("public: gave up our relay slots")

    def _forget_slot(self, relay: str) -> None:
        """libp2p's refresher renews each slot its transport holds (no public way to drop one)."""
        for name in ("_reservations", "_reservation_proofs"):
            table = getattr(self._transport, name, None)
            if isinstance(table, dict):
                table.pop(parse_peer_id(relay), None)

    async def _reachability_loop(self, host: DirectHostLike) -> None:
        """Checks at start, while unknown, when our addresses change, and every 10 min."""
        addrs: list[str] = []
        last_check = -RECHECK_INTERVAL_S
        while not self._stopped:
            news = self._news
            now = trio.current_time()
            current = [a for a in host.addrs() if not is_circuit(a)]  # listen ports and interface IPs
            due = current != addrs or self.status.reachability == "unknown" or now - last_check >= RECHECK_INTERVAL_S
            if due and self._servers(host):
                if addrs and current != addrs:
                    logger.info("our addresses changed: checking reachability again")
                    self._verdicts.forget()
                    self.status.translated = None
                addrs = current
                last_check = now
                await self.check_reachability(host)
                if not self._last_check_answered:
                    await trio.sleep(5 * POLL_S)  # nobody answered: do not hammer them
                    continue
            await _nap(news)  # still unknown: a peer that connects is asked at once

    # --- reservations ---

    async def _reservation_loop(self, host: DirectHostLike) -> None:
        while not self._stopped:
            news = self._news
            self._drop_lost_relays()
            if len(self.status.reservations) < self._relays_wanted():
                for relay in self._relay_candidates():
                    await self.reserve(relay)
                    if len(self.status.reservations) >= self._relays_wanted():  # a verdict may have come meanwhile
                        break
            await _nap(news)

    def _drop_lost_relays(self) -> None:
        """Our slots as libp2p holds them: one whose relay we lost the connection to goes
        (and libp2p's refresher, which would dial the relay again to renew it for good, is
        told); one libp2p dropped (a renewal failed until the slot expired) goes too, so it
        is asked for again instead of announced dead; one libp2p renews that we do not hold
        (forgotten while a renewal was under way, which wrote it back) is forgotten again."""
        connected = {p.to_base58() for p in self._raw.get_connected_peers()}
        table = getattr(self._transport, "_reservations", None)
        held = {str(peer) for peer in table} if isinstance(table, dict) else None
        gone = []
        for relay in list(self.status.reservations):
            if relay not in connected:
                logger.info("lost the connection to relay %s; its reservation is gone", relay)
            elif held is not None and relay not in held:
                logger.info("our relay slot on %s expired (not renewed in time); asking again", relay)
            else:
                continue
            self._forget_slot(relay)
            del self.status.reservations[relay]
            gone.append(relay)
        for relay in (held or set()) - set(self.status.reservations):
            self._forget_slot(relay)
        if gone:
            self._notify()

    def _relay_candidates(self) -> list[str]:
        now = trio.current_time()
        if len(self._reserve_failed) > 4096:  # bounded: strangers come and go
            self._reserve_failed.clear()
        candidates = []
        for peer_id, kind in self.connection_types().items():
            if kind != "direct" or peer_id in self.status.reservations:
                continue
            refused_at, wait_s = self._reserve_failed.get(peer_id, (0.0, 0.0))
            if wait_s and now - refused_at < wait_s:
                continue
            try:
                protocols = self._raw.get_peerstore().get_protocols(parse_peer_id(peer_id))
            except (BaseLibp2pError, DialError, KeyError):
                continue
            if HOP_PROTOCOL_ID in protocols:
                candidates.append(peer_id)
        preferred = [p for p in self._preferred if p in candidates]
        return preferred + [p for p in candidates if p not in preferred]

    async def reserve(self, relay: str) -> bool:
        """Ask ``relay`` (a peer we reached directly) for a slot; True if we hold one now."""
        if relay in self.status.reservations:
            return True
        relay_addr = self._transport_addr_of(relay)
        if relay_addr is None:
            return False
        ok = False
        try:
            with trio.fail_after(RESERVE_TIMEOUT_S):
                stream = await self._raw.new_stream(parse_peer_id(relay), [TProtocol(HOP_PROTOCOL_ID)])
                try:
                    assert self._nursery is not None
                    ok = await self._transport.reserve(stream, parse_peer_id(relay), self._nursery)
                finally:
                    await _close_quietly(stream)
        except (BaseLibp2pError, OSError, DialError, trio.TooSlowError) as exc:
            logger.debug("reservation on %s: %s", relay, exc)
        if not ok:
            refused = self._reserve_failed.get(relay)
            wait_s = reserve_retry_s(refused and refused[1], hinted=self.status.reachability == "unknown")
            self._reserve_failed[relay] = (trio.current_time(), wait_s)
            return False
        self._reserve_failed.pop(relay, None)
        if len(self.status.reservations) >= self._relays_wanted():
            # Found public (or enough slots) while this one was under way: not kept.
            self._forget_slot(relay)
            logger.debug("a relay slot on %s came when we no longer wanted it", relay)
            return False
        self.status.reservations[relay] = Reservation(relay, relay_addr, self._mark("reserved"))
        logger.info("reserved a relay slot on %s (%s)", relay, relay_addr)
        self._notify()
        return True

    def _transport_addr_of(self, peer_id: str) -> str | None:
        """The address we reached a peer on (its listen address when we dialed it)."""
        remote = remote_ip(self._raw, peer_id)
        return ip_addr(*remote) if remote else None

    def _mark(self, step: str) -> float:
        """Seconds since start; the first time of ``step`` goes into the timeline."""
        now_s = round(trio.current_time() - self._started_at, 3)
        self.status.timeline.setdefault(step, now_s)
        return now_s

    def _notify(self) -> None:
        self.status.offering_relay = self._offering()
        self.changed.set()
        self.changed = trio.Event()
        self._wake()

    def _wake(self) -> None:
        self._news.set()
        self._news = trio.Event()

    def summary(self) -> dict[str, Any]:
        s = self.status
        return {
            "reachability": s.reachability,
            "observed_ip": s.observed_ip,
            "offering_relay": s.offering_relay,
            "relay_mode": self.policy.mode,
            "reservations": {r.relay: r.circuit_addr for r in s.reservations.values()},
            "upnp": s.upnp,
            "upnp_addr": s.upnp_addr,
            "upnp_data": {str(port): state for port, state in s.upnp_data.items()},
            "translated": s.translated,
            "first_direct_s": s.first_direct_s,
            "punch_retries": dict(s.punch_retries),
            "timeline": dict(s.timeline),
        }


def reserve_retry_s(previous: float | None, *, hinted: bool) -> float:
    """How long before asking a peer that refused us a slot again, the wait before that
    being ``previous`` (None: its first refusal): doubling, from ``HINTED_RESERVE_RETRY_S``
    while we reserve on a hint (no verdict yet), never under ``RESERVE_RETRY_S`` after it."""
    first = HINTED_RESERVE_RETRY_S if hinted else RESERVE_RETRY_S
    return min(first if previous is None else max(2 * previous, first), RESERVE_RETRY_MAX_S)


def _our_ips(host: DirectHostLike) -> set[str]:
    """The IPs we listen or announce on, and every address of this machine."""
    ips = set(local_ips("ip4") + local_ips("ip6"))
    for addr in host.addrs():
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and not is_circuit(addr):
            ips.add(parts[2])
    out = set()
    for ip in ips:
        try:
            out.add(str(plain_ip(ip)))
        except ValueError:
            continue
    return out


def starts_punch(our_id: str, peer_id: str) -> bool:
    """Whether we start the hole punch on a new relayed connection to ``peer_id`` at once:
    the side whose peer id sorts first does (the other waits for it, or libp2p's driver)."""
    return our_id < peer_id


def watch_interval_s(reachability: str, types: dict[str, str]) -> float:
    """How long the connection watcher waits between looks (``WATCH_S``'s comment says why)."""
    return WATCH_S if reachability != "public" or "relayed" in types.values() else POLL_S


async def _nap(news: trio.Event, timeout_s: float = POLL_S) -> None:
    """Until ``news`` is set or ``timeout_s`` passed."""
    with trio.move_on_after(timeout_s):
        await news.wait()


async def _close_quietly(stream: INetStream) -> None:
    try:
        await stream.close()
    except BaseLibp2pError as exc:
        logger.debug("closing a relay stream: %s", exc)
