"""The one façade over py-libp2p: a host with TCP + Noise + Yamux, a Kademlia DHT and GossipSub.

Nothing outside this module, protocol/net/conns.py and protocol/net/nat.py (relay, hole punching)
imports libp2p. Peers are named by their base58 peer-id strings and addresses are
multiaddr strings; libp2p's exceptions are mapped to ``protocol.errors`` here.

Choices, each measured or learned in ../shared/probes:
- Noise only, Yamux only: libp2p's defaults also offer plaintext and secio.
- ``max_connections_per_peer=1`` removes a fixed ≈250 ms wait on every successful dial.
- GossipSub queues are widened before pubsub objects exist (32-deep queues drop silently),
  its heartbeat is 1 s (default 120 s) and its spam protection is off (it drops >10 msg/s);
  gossip stays a hint in this project anyway, and the truth is pulled over streams.
- The DHT speaks ``/swarmtrain/kad/1.0.0`` so we never join the IPFS DHT by accident
  (py-libp2p ignores ``protocol_prefix``: protocol/net/libp2p_fixes.py sets the id).
- Where py-libp2p lets one peer's bytes end the host (an unguarded stream handler, pubsub's
  message task, multiselect's decoding), protocol/net/libp2p_fixes.py closes the hole; every
  inbound stream runs in our guard (protocol/net/guard.py), and bans close connections.
- ``close()`` runs before leaving ``host.run()``; otherwise sockets and tasks leak.
"""

import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import libp2p.kad_dht.kad_dht as _libp2p_kad_dht
import libp2p.kad_dht.peer_routing as _libp2p_peer_routing
import libp2p.kad_dht.provider_store as _libp2p_provider_store
import libp2p.pubsub.pubsub as _libp2p_pubsub
import libp2p.pubsub.rpc_queue as _libp2p_rpc_queue
import multiaddr
import multiaddr.exceptions
import trio
from libp2p import new_host
from libp2p.abc import IHost, IMuxedConn, INetConn, INetwork, INotifee
from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.stream.net_stream import INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from protocol.errors import BadMessage, DialError, NotSupported, ProtocolError, StreamError
from protocol.net import gossip
from protocol.net.addrs import announce_for, ensure_port_free, is_global_addr, on_local_ips, resolve_addr
from protocol.net.addrs import check_listen_addr as check_listen_addr  # re-exported
from protocol.net.conns import free_stream_slots, parse_peer_id, remote_ip, socket_stream_of, socket_under
from protocol.net.dialback import DialbackServer
from protocol.net.guard import Guard
from protocol.net.hostlike import HANDLER_DEADLINE_S, serve_guarded
from protocol.net.hostlike import GossipMessage as GossipMessage  # re-exported: defined without libp2p
from protocol.net.hostlike import PeerAddrs as PeerAddrs
from protocol.net.libp2p_fixes import guard_host
from protocol.net.nat import CIRCUIT_PEER_DIRECT_S, DIRECT_FIRST_TIMEOUT_S, Nat, NatPolicy, is_circuit
from protocol.net.peers import PeerTable
from protocol.net.traffic import count_libp2p
from protocol.ratelimit import ChainedLimit, RateLimit

logger = logging.getLogger(__name__)
count_libp2p()  # every byte of every libp2p connection (protocol/net/traffic.py)

# Before any Pubsub exists: 32-deep subscription queues and per-peer RPC queues overflow
# silently under bursts; a 1 MiB RPC cap is below what we may push.
_libp2p_pubsub.SUBSCRIPTION_CHANNEL_SIZE = 4096
_libp2p_rpc_queue.RpcQueue.__init__.__defaults__ = (4096, 8 << 20)

# What parsing a multiaddr or a /p2p address can raise.
_ADDR_ERRORS = (ValueError, TypeError, KeyError, multiaddr.exceptions.Error, BaseLibp2pError)

DHT_PROTOCOL_PREFIX = "/swarmtrain"
GOSSIP_MAX_RPC_NBYTES = 8 << 20
# Kademlia's parallelism (alpha) for our provider look-ups.
DHT_QUERY_PARALLELISM = 3
DHT_QUERY_TIMEOUT_S = 5.0
# libp2p's Kademlia gives each peer of a look-up, and each ADD_PROVIDER, QUERY_TIMEOUT
# (10 s): a peer known only by addresses behind its NAT (whose SYNs are dropped) cost a
# provide 20 s and a provider search 15 s (tests/test_netbed_nat.py). Ours, as for our own asks.
for _module in (_libp2p_kad_dht, _libp2p_peer_routing, _libp2p_provider_store):
    _module.QUERY_TIMEOUT = DHT_QUERY_TIMEOUT_S
# Closing waits for libp2p's services and connections; it takes milliseconds on loopback.
HOST_CLOSE_TIMEOUT_S = 5.0
# Closing or resetting a stream writes one yamux frame: bounded, so a dead connection never
# holds a shielded close for long.
STREAM_CLOSE_TIMEOUT_S = 5.0
# This many streams in a row to a connected peer that do not open (Host.open_stream) close
# the connection; libp2p's words for "no answer" and "the connection is dead" are the signs.
STUCK_OPEN_FAILURES = 2
_STUCK_SIGNS = ("response timed out", "Failed to send SYN")
# The peer answered "na" to every protocol we offered (multiselect's message; libp2p raises
# its generic client error for it, the cause of its "failed to open a stream").
_UNSUPPORTED_SIGN = "not supported: "
# Reads up to this size are allocated at once; larger ones grow chunk by chunk as bytes
# arrive, counted in the host's FrameBudget (a stalled sender holds only what it sent).
SMALL_READ_NBYTES = 64 << 10
READ_CHUNK_NBYTES = 256 << 10
# What unfinished incoming messages may hold: 16 MiB from one peer (a whole run document
# fits), 64 MiB from everyone. Bulk tensor payloads are not messages: they land in buffers
# allocated only for an authorized transfer (protocol/net/exchange.py).
FRAME_BUDGET_PER_PEER_NBYTES = 20 << 20
FRAME_BUDGET_TOTAL_NBYTES = 64 << 20
# Liveness bound of a host opened without the daemon's peer table (tests, tools).
DEFAULT_PEER_TTL_S = 30.0


StreamHandler = Callable[["Stream"], Awaitable[None]]


def parse_dial_addr(addr: str) -> PeerAddrs:
    """Split ``/ip4/.../tcp/N/p2p/<peer id>`` into peer id and transport address."""
    try:
        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except _ADDR_ERRORS as exc:
        raise ValueError(f"{addr!r} is not a multiaddr ending in /p2p/<peer id>: {exc}") from exc
    return PeerAddrs(info.peer_id.to_base58(), tuple(str(a) for a in info.addrs))


class FrameBudget:
    """Bytes of messages still arriving, per peer and in all: what stalled senders may hold.

    A frame's length is checked against its protocol's limit before anything is read, and
    memory is taken only as its bytes arrive; but a peer that starts many large frames and
    never finishes them would still pin it all. So the bytes of unfinished frames are
    counted, and a read that would pass a bound fails (``BadMessage``) instead of waiting.
    """

    def __init__(self, *, total_nbytes: int, per_peer_nbytes: int) -> None:
        self.total_nbytes = total_nbytes
        self.per_peer_nbytes = per_peer_nbytes
        self.used_nbytes = 0
        self._by_peer: dict[str, int] = {}

    def take(self, peer_id: str, nbytes: int) -> None:
        held = self._by_peer.get(peer_id, 0)
        if held + nbytes > self.per_peer_nbytes or self.used_nbytes + nbytes > self.total_nbytes:
            raise BadMessage(
                f"{peer_id} already has {held} bytes of unfinished messages here"
                f" ({self.used_nbytes} from everyone): refusing more"
            )
        self._by_peer[peer_id] = held + nbytes
        self.used_nbytes += nbytes

    def give(self, peer_id: str, nbytes: int) -> None:
        held = self._by_peer.get(peer_id, 0) - nbytes
        if held > 0:
            self._by_peer[peer_id] = held
        else:
            self._by_peer.pop(peer_id, None)
        self.used_nbytes -= nbytes


class Stream:
    """One libp2p stream with exact reads; every failure is a ``StreamError``."""

    def __init__(self, raw: INetStream, budget: FrameBudget | None = None) -> None:
        self._raw = raw
        self.peer_id: str = raw.muxed_conn.peer_id.to_base58()
        self._budget = budget or FrameBudget(total_nbytes=1 << 62, per_peer_nbytes=1 << 62)
        self.nbytes_read = 0

    async def read_exact(self, nbytes: int) -> bytes:
        """Exactly ``nbytes``; memory grows with what arrived, within the frame budget."""
        if nbytes <= SMALL_READ_NBYTES:
            buffer = bytearray(nbytes)
            await self.read_into(memoryview(buffer), chunk_nbytes=nbytes)
            return bytes(buffer)
        chunks: list[bytes] = []
        held = 0
        try:
            while held < nbytes:
                size = min(READ_CHUNK_NBYTES, nbytes - held)
                self._budget.take(self.peer_id, size)
                held += size
                chunk = bytearray(size)
                await self.read_into(memoryview(chunk), chunk_nbytes=size)
                chunks.append(bytes(chunk))
            return b"".join(chunks)
        finally:
            self._budget.give(self.peer_id, held)

    async def read_into(self, buffer: memoryview, *, chunk_nbytes: int) -> None:
        """Fill ``buffer`` exactly (bulk payloads land in memory allocated once)."""
        offset = 0
        try:
            while offset < len(buffer):
                chunk = await self._raw.read(min(chunk_nbytes, len(buffer) - offset))
                if not chunk:
                    raise StreamError(f"stream ended {len(buffer) - offset} bytes early")
                buffer[offset : offset + len(chunk)] = chunk
                offset += len(chunk)
                self.nbytes_read += len(chunk)
        except StreamEOF as exc:
            raise StreamError(f"stream ended {len(buffer) - offset} bytes early") from exc
        except BaseLibp2pError as exc:
            raise StreamError(f"read failed: {exc}") from exc

    async def write(self, data: bytes) -> None:
        try:
            await self._raw.write(data)
        except BaseLibp2pError as exc:
            raise StreamError(f"write failed: {exc}") from exc

    async def close(self) -> None:
        """Close our end, even from a cancelled scope (see ``reset``); a close that fails or
        does not finish in ``STREAM_CLOSE_TIMEOUT_S`` becomes a reset."""
        with trio.CancelScope(shield=True):
            failed = False
            with trio.move_on_after(STREAM_CLOSE_TIMEOUT_S) as scope:
                try:
                    await self._raw.close()
                except BaseLibp2pError as exc:
                    # 0.8.1's close tells the swarm the stream is gone only after its own
                    # close succeeded: a reset does that too, whatever the stream's state.
                    logger.debug("closing stream to %s: %s", self.peer_id, exc)
                    failed = True
            if scope.cancelled_caught or failed:
                await self.reset()

    async def reset(self) -> None:
        """Reset the stream, even from a cancelled scope: yamux gives an opened stream's slot
        back (256 per connection) only when its close or reset runs to the end, and a close
        cancelled at its first checkpoint leaked the slot for the connection's life. Seen in
        a 16-node soak: after enough timed-out exchanges every new stream between two
        daemons waited forever for a slot, so no pull between them ever worked again."""
        with trio.CancelScope(shield=True), trio.move_on_after(STREAM_CLOSE_TIMEOUT_S):
            try:
                await self._raw.reset()
            except BaseLibp2pError as exc:
                logger.debug("resetting stream to %s: %s", self.peer_id, exc)


def _or_last(read: Callable[[], Sequence[multiaddr.Multiaddr]], last: list[str]) -> list[str]:
    """libp2p's addresses for us, or ``last`` while a listener is closing: its TCP transport
    asks each listener's socket for its name, and a closed one raises (EBADF: ``swarmtrain
    join`` died on Ctrl-C showing its status, exit 1). Once libp2p has let its listeners
    go, none."""
    try:
        return [str(a) for a in read()]
    except OSError as exc:
        logger.debug("our listeners are closing (%s): their last addresses", exc)
        return last


class _ConnectionEvents(INotifee):  # type: ignore[misc]  # libp2p is untyped here
    """libp2p's connection events (direct and relayed, ours and the peer's dials) as one
    trio Event: ``Host.connections_changed``."""

    def __init__(self) -> None:
        self.changed = trio.Event()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._notify()

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._notify()

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass


class Host:
    """A running libp2p host with its DHT and GossipSub; create it with ``open_host``."""

    def __init__(self, raw: "_RawParts", guard: Guard) -> None:
        self._host = raw.host
        self._dht = raw.dht
        self._pubsub = raw.pubsub
        self.nat = raw.nat
        self.peer_id: str = raw.host.get_id().to_base58()
        self.relayed_tensor_limit: RateLimit | None = None
        """Tensors over relayed connections: None never (the default), else at this cap."""
        self.frame_budget = FrameBudget(
            total_nbytes=FRAME_BUDGET_TOTAL_NBYTES, per_peer_nbytes=FRAME_BUDGET_PER_PEER_NBYTES
        )
        self.guard = guard
        """The boundary rule (protocol/net/guard.py): handlers run in it, misbehaviour is judged there."""
        guard.on_ban = self._on_ban
        self._open_failures: dict[str, int] = {}
        """Per peer, streams in a row that did not open (open_stream)."""
        self._announced: list[str] = []
        self._listening: list[str] = []
        """The last addresses libp2p gave (``get_addrs``, ``get_transport_addrs``): see ``_or_last``."""
        self.stuck_connections_closed = 0
        self._connection_events = _ConnectionEvents()
        raw.host.get_network().register_notifee(self._connection_events)

    @property
    def connections_changed(self) -> trio.Event:
        """Set at the next connection to or from any peer, or the end of one: take it
        before checking ``connected_peers``, then wait on it."""
        return self._connection_events.changed

    def forward_data_port(self, port: int) -> None:
        """A data channel listens on ``port`` (protocol/net/data_channel.py): the router
        forwards it too when UPnP is on (``Nat.map_data_port``), until ``unforward_data_port``."""
        self.nat.map_data_port(port)

    def unforward_data_port(self, port: int) -> None:
        """The data channel on ``port`` closed: its forward goes (``Nat.unmap_data_port``)."""
        self.nat.unmap_data_port(port)

    @property
    def peers(self) -> PeerTable:
        return self.guard.peers

    async def punish(self, peer_id: str, reason: str, *, points: int = 1) -> bool:
        """Penalize ``peer_id``'s bad input; at the threshold it is banned and cut off."""
        return await self.guard.punish(peer_id, reason, points=points)

    async def _on_ban(self, peer_id: str) -> None:
        """A ban cuts the peer off: its sockets first, then libp2p's close, bounded. A close
        waits for its yamux's stream lock, which a write to a peer that stopped reading holds
        for good (a reader's probe); the ban runs shielded in a connection's reader (fix 11),
        which waited with it."""
        await self._close_connections(peer_id)

    def addrs(self) -> list[str]:
        """Addresses peers should dial, each ending in /p2p/<our peer id>.

        A listener on a wildcard (0.0.0.0, ::) is announced on each of this machine's addresses of its family; behind
        a NAT, the port the router forwards (UPnP) and our relay circuit addresses come last.
        """
        self._announced = _or_last(self._host.get_addrs, self._announced)
        result = on_local_ips(list(self._announced), with_loopback=True)
        result.extend(f"{a}/p2p/{self.peer_id}" for a in self.nat.extra_addrs())
        return result

    def connection_type(self, peer_id: str) -> str | None:
        """ "direct", "relayed" (only through a relay) or None (not connected)."""
        return self.nat.connection_type(peer_id)

    @property
    def private(self) -> bool:
        """AutoNAT found us behind a NAT: nobody can open a connection to our ports."""
        return bool(self.nat.status.reachability == "private")

    def tensor_refusal(self, peer_id: str) -> str | None:
        """Why tensors may not travel between us and ``peer_id`` now, or None if they may.

        The policy: tensors only over direct connections; a relay carries control traffic,
        unless the user opted in with a cap (``relayed_tensor_limit``). Relays are other
        volunteers' uplinks, and their limits would cut a payload off half way.
        """
        if self.relayed_tensor_limit is None and self.connection_type(peer_id) == "relayed":
            return "tensors go only over direct connections, and this peer is reached through a relay"
        return None

    def tensor_limit(self, peer_id: str, upload: RateLimit) -> RateLimit:
        """The rate a tensor upload to ``peer_id`` may use: ``upload``, and the relayed cap if relayed."""
        if self.relayed_tensor_limit is not None and self.connection_type(peer_id) == "relayed":
            return ChainedLimit(upload, self.relayed_tensor_limit)
        return upload

    def transport_addrs(self) -> list[str]:
        """Addresses we listen on (no /p2p suffix)."""
        self._listening = _or_last(self._host.get_transport_addrs, self._listening)
        return list(self._listening)

    def direct_ip(self, peer_id: str) -> str | None:
        """The peer's IP address (v4 or v6) on our direct TCP connection to it; None if relayed or none."""
        remote = remote_ip(self._host, peer_id)
        return remote[0] if remote else None

    def socket_streams(self, peer_id: str) -> list[trio.SocketStream]:
        """The TCP streams under our direct connections to a peer (for measuring bytes on the wire)."""
        try:
            conns = self._host.get_network().connections.get(parse_peer_id(peer_id), [])
        except DialError:
            return []
        return [s for s in (socket_stream_of(c) for c in conns) if s is not None]

    def connected_peers(self) -> set[str]:
        return {p.to_base58() for p in self._host.get_connected_peers()}

    async def connect(self, peer: PeerAddrs, *, timeout_s: float) -> None:
        """Connect to ``peer`` (no-op when already connected); ``DialError`` on failure.

        Direct addresses first; if they fail and the peer may sit behind a NAT, through a
        relay: its own circuit addresses, then the relays we hold reservations on. A peer
        that publishes a circuit address gets only a short head start on its direct
        addresses (``CIRCUIT_PEER_DIRECT_S``: it found itself undialable); DCUtR then
        upgrades the relayed connection.
        """
        if peer.peer_id == self.peer_id:
            raise DialError("refusing to dial ourselves")
        resolved: list[str] = []
        with trio.move_on_after(timeout_s):
            for addr in peer.addrs:
                if not is_circuit(addr):
                    resolved.extend(await resolve_addr(addr))
        try:
            addrs = [multiaddr.Multiaddr(a) for a in resolved]
        except _ADDR_ERRORS as exc:
            raise DialError(f"bad address for {peer.peer_id}: {exc}") from exc
        info = PeerInfo(parse_peer_id(peer.peer_id), addrs)
        circuits = self.nat.circuit_addrs_for(peer.peer_id, list(peer.addrs))
        deadline = trio.current_time() + timeout_s
        direct_s = min(timeout_s, DIRECT_FIRST_TIMEOUT_S) if circuits else timeout_s
        if any(is_circuit(a) for a in peer.addrs) and not any(is_global_addr(a) for a in peer.addrs):
            # Only its own network reaches it directly; an address on the internet (a port its
            # router maps for it) keeps the whole head start: a WAN handshake takes round trips.
            direct_s = min(direct_s, CIRCUIT_PEER_DIRECT_S)
        error = f"dial {peer.peer_id} timed out after {direct_s:g} s"
        if not addrs and any(not is_circuit(a) for a in peer.addrs):
            error = f"no address of {peer.peer_id} resolves: {', '.join(peer.addrs)}"
        network = self._host.get_network()
        connected = bool(network.connections.get(info.peer_id))
        # libp2p blocks a peer whose addresses all failed for a minute; our callers retry on
        # their own schedules (and behind a NAT a failed direct dial is expected, not a verdict).
        network.unblock_peer(info.peer_id)
        if addrs or connected:
            with trio.move_on_after(direct_s):
                try:
                    await self._host.connect(info)
                    connected = True
                except (BaseLibp2pError, OSError) as exc:
                    error = f"dial {peer.peer_id} failed: {exc}"
            if not connected:
                network.unblock_peer(info.peer_id)  # hole punches to it must not be blocked
        for circuit in circuits if not connected else []:
            if network.connections.get(info.peer_id):
                # Another dial (a newer record's, the peer's own) got there while ours hung:
                # a relayed connection on top would only cost a relay circuit.
                connected = True
                break
            with trio.move_on_at(deadline) as scope:
                try:
                    await self.nat.dial_circuit(circuit)
                    connected = True
                    break
                except DialError as exc:
                    error = f"{error}; {exc}"
            if scope.cancelled_caught:
                error = f"{error}; relayed dial timed out"
                break
        if not connected:
            raise DialError(error)
        try:
            await self._dht.add_peer(info.peer_id)
        except (BaseLibp2pError, OSError) as exc:
            logger.debug("peer %s not added to the DHT routing table: %s", peer.peer_id, exc)

    async def disconnect(self, peer_id: str) -> None:
        try:
            await self._host.disconnect(parse_peer_id(peer_id))
        except (BaseLibp2pError, OSError) as exc:
            logger.debug("disconnecting %s: %s", peer_id, exc)

    async def open_stream(self, peer_id: str, protocol_id: str, *, timeout_s: float) -> Stream:
        """A new stream to ``peer_id`` speaking ``protocol_id`` (dialing if need be);
        ``StreamError`` if it does not open within ``timeout_s``.

        A connection on which STUCK_OPEN_FAILURES streams in a row did not open (no answer to
        the protocol negotiation, or the stream's first frame could not be written) is
        closed, so the next stream dials afresh. Seen in a 16-node soak: pulls between
        daemons failed this way hundreds of times over a connection that stayed up, while a
        fresh connection to the same daemon pulled its whole log in seconds.
        """
        self._forget_closed_connections(peer_id)
        with trio.move_on_after(timeout_s) as scope:
            try:
                raw = await self._host.new_stream(parse_peer_id(peer_id), [TProtocol(protocol_id)])
            except (BaseLibp2pError, OSError) as exc:
                # libp2p's own message says only "failed to open a stream": the why is its cause.
                cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
                if any(sign in cause for sign in _STUCK_SIGNS):
                    await self._open_failed(peer_id)
                if _UNSUPPORTED_SIGN in cause:
                    raise NotSupported(f"{peer_id} does not speak {protocol_id}") from exc
                raise StreamError(f"open {protocol_id} to {peer_id} failed: {exc}{cause}") from exc
            self._open_failures.pop(peer_id, None)
            return Stream(raw, self.frame_budget)
        assert scope.cancelled_caught
        await self._open_failed(peer_id)
        raise StreamError(f"open {protocol_id} to {peer_id} timed out after {timeout_s:g} s")

    async def _open_failed(self, peer_id: str) -> None:
        failures = self._open_failures[peer_id] = self._open_failures.get(peer_id, 0) + 1
        if failures < STUCK_OPEN_FAILURES or peer_id not in self.connected_peers():
            return
        del self._open_failures[peer_id]
        self.stuck_connections_closed += 1
        logger.info("%d streams in a row to %s did not open: closing its connections to dial afresh", failures, peer_id)
        await self._close_connections(peer_id)

    async def _close_connections(self, peer_id: str) -> None:
        """Every connection to ``peer_id`` ends, shielded (half of it, sockets closed and
        connections still listed, helps nobody): the sockets first, since a close that writes
        its goodbye behind a stuck write would wait, then libp2p's close, bounded."""
        with trio.CancelScope(shield=True):
            for stream in self.socket_streams(peer_id):
                await trio.aclose_forcefully(stream)
            with trio.move_on_after(STREAM_CLOSE_TIMEOUT_S):
                await self.disconnect(peer_id)
            self._forget_closed_connections(peer_id)

    def _forget_closed_connections(self, peer_id: str) -> None:
        """Drop connections to ``peer_id`` that are closed but still listed. libp2p removes a
        connection from its table only at the end of its close; a close cut short (by our
        timeout) left it listed, and every new stream to that peer then failed at once with
        "No valid connections available" instead of dialling (a helper's repro). Its socket,
        which the cut-short close never reached, is closed here: off the table, nothing
        else would close it, and the garbage collector's unclosed-socket warning failed
        whichever test ran then (found by recording each socket's maker, last reader and
        who took it off the table: the reachability check's stream, through here)."""
        try:
            key = parse_peer_id(peer_id)
        except DialError:
            return
        network = self._host.get_network()
        for connection in list(network.connections.get(key, [])):
            if connection.is_closed:
                network.remove_conn(connection)  # the swarm's own bookkeeping (health, resource counts)
                sock = socket_stream_of(connection)
                if sock is not None and sock.socket.fileno() != -1:
                    sock.socket.close()

    def set_handler(self, protocol_id: str, handler: StreamHandler, *, deadline_s: float = HANDLER_DEADLINE_S) -> None:
        """Serve ``protocol_id``: ``handler`` gets each inbound stream, closed afterwards.

        The boundary rule (protocol/net/guard.py): a banned peer's stream is reset unread; the
        handler runs under a deadline; whatever escapes it (a refusal, a bug, a panic of a
        native library) resets the stream and is judged, and the daemon goes on.
        """

        async def serve(raw: INetStream) -> None:
            stream = Stream(raw, self.frame_budget)
            await serve_guarded(self.guard, protocol_id, stream, handler, deadline_s=deadline_s)

        self._host.set_stream_handler(TProtocol(protocol_id), serve)

    # --- DHT ---

    async def dht_provide(self, key: bytes) -> None:
        try:
            await self._dht.provider_store.provide(key)
        except (BaseLibp2pError, OSError) as exc:
            raise ProtocolError(f"DHT provide failed: {exc}") from exc

    async def dht_find_providers(self, key: bytes) -> list[PeerAddrs]:
        """Providers of ``key`` from the network, not only from our own store.

        libp2p's ``find_providers`` returns the local store as soon as it holds anything,
        and providing puts ourselves there: after ``provide`` it would never ask anyone.
        So we ask the k closest peers to the key (where providers store records) directly.
        """
        store = self._dht.provider_store
        key_bytes = key
        found: dict[str, PeerAddrs] = {}

        def add(infos: list[PeerInfo]) -> None:
            for info in infos:
                pid = info.peer_id.to_base58()
                if pid != self.peer_id:
                    found[pid] = PeerAddrs(pid, tuple(str(a) for a in info.addrs))

        add(store.get_providers(key_bytes))
        try:
            closest = await self._dht.peer_routing.find_closest_peers_network(key_bytes)
        except (BaseLibp2pError, OSError) as exc:
            raise ProtocolError(f"DHT lookup failed: {exc}") from exc
        limiter = trio.CapacityLimiter(DHT_QUERY_PARALLELISM)

        async def ask(peer: ID) -> None:
            async with limiter:
                with trio.move_on_after(DHT_QUERY_TIMEOUT_S):
                    try:
                        providers, _ = await store._get_providers_from_peer_with_closers(peer, key_bytes)
                    except (BaseLibp2pError, OSError) as exc:
                        logger.debug("provider query to %s failed: %s", peer, exc)
                        return
                    add(providers)

        async with trio.open_nursery() as nursery:
            for peer in closest:
                if peer != self._host.get_id():
                    nursery.start_soon(ask, peer)
        return sorted(found.values(), key=lambda p: p.peer_id)

    def dht_routing_table_size(self) -> int:
        return int(self._dht.get_routing_table_size())

    def free_stream_slots(self) -> dict[str, int]:
        """Per connected peer, the fewest free slots for streams we open (conns.free_stream_slots)."""
        return free_stream_slots(self._host)

    # --- gossip ---

    async def publish(self, topic: str, data: bytes) -> None:
        try:
            await self._pubsub.publish(topic, data)
        except (BaseLibp2pError, OSError, ValueError) as exc:
            raise ProtocolError(f"publish on {topic} failed: {exc}") from exc

    async def subscribe(self, topic: str) -> AsyncGenerator[GossipMessage, None]:
        """Messages on ``topic`` from others (our own are skipped)."""
        subscription = await self._pubsub.subscribe(topic)
        me = self._host.get_id()
        while True:
            message = await subscription.get()
            try:
                sender = ID(message.from_id)
            except (ValueError, BaseLibp2pError):
                continue
            if sender == me:
                continue
            yield GossipMessage(sender.to_base58(), bytes(message.data))


@dataclass(slots=True)
class _RawParts:
    host: IHost
    dht: KadDHT
    pubsub: Pubsub
    nat: Nat


def key_pair_from_seed(seed: bytes) -> KeyPair:
    """The libp2p ed25519 key pair for a 32-byte seed (our identity file stores the seed)."""
    private = Ed25519PrivateKey.from_bytes(seed)
    return KeyPair(private, private.get_public_key())


def peer_id_from_seed(seed: bytes) -> str:
    return str(ID.from_pubkey(key_pair_from_seed(seed).public_key).to_base58())


def _track_connections(raw_host: IHost) -> "weakref.WeakSet[IMuxedConn]":
    """Every connection the host's swarm is handed, held weakly (``_close`` closes their
    sockets), from the moment ``add_conn`` gets it: it can take one off its table and
    fail, or be cancelled, before returning.

    A backstop: connections leave the swarm's table with their sockets open in more ways
    than we close them ourselves (``_forget_closed_connections``): libp2p 0.8.1's
    ``SwarmConn.close`` marks itself closed before its muxer's close, which can fail or be
    cut short and is never retried, and its per-peer trim (a connection over
    ``max_connections_per_peer`` once the older one is past the 20 s grace period) leaves
    the close to a task that shutdown cancels."""
    network = raw_host.get_network()
    made: weakref.WeakSet[IMuxedConn] = weakref.WeakSet()
    add_conn = network.add_conn

    async def add_and_track(muxed_conn: IMuxedConn, direction: str = "unknown") -> INetConn:
        made.add(muxed_conn)
        return await add_conn(muxed_conn, direction)

    network.add_conn = add_and_track
    return made


def _socket_streams(raw_host: IHost, made: "weakref.WeakSet[IMuxedConn]") -> list[trio.SocketStream]:
    tabled = [socket_stream_of(c) for conns in list(raw_host.get_network().connections.values()) for c in conns]
    streams = {id(s): s for s in [*tabled, *map(socket_under, list(made))] if s is not None}
    return list(streams.values())


async def _close(raw_host: IHost, nat: Nat, made: "weakref.WeakSet[IMuxedConn]") -> None:
    """Close the host even while we are being cancelled, and every socket it had.

    Shielded, because teardown usually runs in a cancelled scope where close() would
    return at its first checkpoint. And libp2p 0.8.1 leaves a connection's socket open
    when the task reading it is cancelled mid-read, or when it had taken the connection
    out of its table before closing it (``_track_connections``), so we close what remains
    ourselves: without a checkpoint, so that a close past the deadline still closes them.
    The NAT part stops first: seeing the connections go, it would dial them again (a
    relayed peer through our relay), and that dial, cancelled midway, left a socket open.
    """
    nat.stop()
    sockets = _socket_streams(raw_host, made)  # strong references: none is collected open meanwhile
    try:
        with trio.CancelScope(deadline=trio.current_time() + HOST_CLOSE_TIMEOUT_S, shield=True):
            await raw_host.close()
    finally:
        for stream in [*sockets, *_socket_streams(raw_host, made)]:
            if stream.socket.fileno() != -1:
                stream.socket.close()


@asynccontextmanager
async def open_host(
    *,
    identity_seed: bytes,
    listen_addrs: list[str],
    announce_addrs: list[str],
    mdns: bool = False,
    gossip_degree: int = gossip.MESH_DEGREE,
    relay: NatPolicy | None = None,
    preferred_peers: list[str] | None = None,
    relayed_tensors_mbps: float = 0.0,
    peers: PeerTable | None = None,
) -> AsyncIterator[Host]:
    """Start a host listening on ``listen_addrs`` with its DHT (server mode), GossipSub and
    NAT traversal (protocol/net/nat.py: reachability checks, relay, hole punching).

    ``preferred_peers``: asked first for dial-backs and relay slots (the bootstrap peers).
    ``relayed_tensors_mbps``: > 0 lets tensors cross relays at that cap (``Host.tensor_refusal``).
    ``peers``: where penalties and bans are kept (the daemon's table; a fresh one if None).
    """
    for addr in listen_addrs:
        ensure_port_free(addr)
    key_pair = key_pair_from_seed(identity_seed)
    try:
        listen = [multiaddr.Multiaddr(a) for a in listen_addrs]
        announce = [multiaddr.Multiaddr(a) for a in announce_addrs or announce_for(listen_addrs)] or None
    except _ADDR_ERRORS as exc:
        raise ValueError(f"bad listen or announce address: {exc}") from exc
    raw_host = new_host(
        key_pair=key_pair,
        sec_opt={
            TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
        },
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        listen_addrs=listen,
        announce_addrs=announce,
        enable_mDNS=mdns,
    )
    router = GossipSub(
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11],
        degree=gossip_degree,
        degree_low=max(1, gossip_degree * 3 // 4),
        degree_high=gossip_degree * 3 // 2,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=1,
        spam_protection_enabled=False,
    )
    pubsub = Pubsub(raw_host, router, max_inbound_rpc_size=GOSSIP_MAX_RPC_NBYTES)
    dht = KadDHT(raw_host, DHTMode.SERVER, protocol_prefix=TProtocol(DHT_PROTOCOL_PREFIX))
    # Its relay and hole-punch handlers exist before any connection (identify tells peers
    # our protocols once, when we connect).
    nat = Nat(raw_host, relay or NatPolicy())
    nat.prefer(preferred_peers or [])
    guard = Guard(peers or PeerTable(ttl_s=DEFAULT_PEER_TTL_S))
    guard_host(raw_host, pubsub, guard)
    host = Host(_RawParts(raw_host, dht, pubsub, nat), guard)
    if relayed_tensors_mbps > 0:
        host.relayed_tensor_limit = RateLimit.from_mbps(relayed_tensors_mbps)
    DialbackServer(host).register()
    made = _track_connections(raw_host)
    async with AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(raw_host.run(listen))
        except (BaseLibp2pError, OSError) as exc:
            raise DialError(f"cannot listen on {listen_addrs}: {exc}") from exc
        await stack.enter_async_context(background_trio_service(pubsub))
        await stack.enter_async_context(background_trio_service(router))
        await stack.enter_async_context(background_trio_service(dht))
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        await nursery.start(nat.run, host)
        # Registered last, so run first: the host closes before its services exit
        # (else "Nursery is closed" at shutdown) and before host.run() exits (else leaks).
        stack.push_async_callback(_close, raw_host, nat, made)
        yield host
