"""A direct TCP data channel for bulk payloads, authorized and checked over libp2p.

Why: a py-libp2p Noise + Yamux stream moves ≈190 MB/s on loopback where a raw TCP socket
moves ≈2 GB/s (bench/exchange_throughput.py); the framing, encryption and flow control run
in Python per chunk. So the bytes of a big payload travel over a plain TCP connection
between the same two peers, while everything that makes it safe stays on the Noise
channel: the payload's hash (BLAKE3 for a round's payload, protocol/net/exchange.py; the
owner-signed sha256 for an expert version, node/algorithms/spes/experts.py), a one-time
32-byte token, and the verdict where the protocol has one. Tampering on the wire fails the
hash; a connection without a pending token is dropped; a token works once. The payload is
not encrypted: model weights exchanged in a public training run are not secret, their
integrity is what matters. The bytes are not authenticated either: a hash that fails on
this channel may be a tamperer on the path, not the sender.

Protocol flow (on the data port, after a libp2p protocol handed out the token):

    sender                                   receiver
    token (32 bytes), or its sha256 on a
    channel made with ``hashed``  ─────────▶ looks up the pending transfer; unknown: close
    payload (nbytes)          ─────────────▶ read into the buffer allocated for it
    (close)                                  the protocol's own verdict, if any, on the stream

A receiver picks the port and the token, so a hostile one could aim a sender's connection
at another service on its IP (a router's, a container host's) with a request of its own
making. Every sender dials ports of MIN_PORT and above only (the OS gives our listeners an
ephemeral one) and takes 32-byte tokens only. A channel made with ``hashed`` closes it: on
accepting a connection it first sends its greeting, sha256(domain ‖ nonce) of a random
32-byte ``nonce`` told to the sender over the Noise stream, and the sender writes nothing
until it has read exactly that; then it presents sha256(token), not the token. The sender
computes the greeting itself: a receiver names the nonce, never the bytes to match, so it
cannot pick a service whose banner passes (a greeting of its choosing could be the first
32 bytes of an SSH server's).

    receiver                                 sender
    greeting (32 bytes)       ─────────────▶ compared with greeting_of(nonce); else close
                              ◀───────────── sha256(token), then the payload

A transfer lives until its receiver is done with it (``wait`` returned, or ``cancel``): a
connection still filling the buffer then is cut, so a sender that stalls mid-payload holds
neither the buffer nor the socket past the receiver's own deadline.
"""

import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from protocol.errors import BadMessage, ProtocolError
from protocol.net.traffic import TRAFFIC
from protocol.ratelimit import UNLIMITED, RateLimit

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

TOKEN_NBYTES = 32
# A connection must present its token quickly; an honest sender writes it first thing.
TOKEN_TIMEOUT_S = 5.0
# A sender gives up connecting after this long (a firewall dropping SYNs would hold it for
# the OS's ~2 min of retries), and on a greeting after as long.
CONNECT_TIMEOUT_S = 10.0
# A data port below this is none of ours (our listeners take an ephemeral port).
MIN_PORT = 1024
# Transfers waiting for their sender at once; more means a misbehaving peer or a bug.
MAX_PENDING = 64
CHUNK_NBYTES = 1 << 20
# Ports tried for a channel on several addresses (IPv4 and IPv6) before it keeps the first.
SAME_PORT_TRIES = 4


@dataclass(slots=True)
class _Pending:
    buffer: memoryview
    peer_id: str
    started: trio.Event = field(default_factory=trio.Event)
    """Its sender connected and presented the token."""
    done: trio.Event = field(default_factory=trio.Event)
    error: str | None = None
    filling: trio.CancelScope | None = None
    """The connection filling the buffer, while it does (its receiver's end cuts it)."""


class DataChannel:
    """The receiving side: a TCP listener and the transfers it expects."""

    def __init__(self, *ips: str, per_peer: int = 1, hashed: bool = False) -> None:
        """Listens on each of ``ips`` (the node's listen addresses: an IPv4 and an IPv6 one
        when it listens on both), on one port: a sender connects to the address our libp2p
        connection to it comes from, and the port we announce. ``per_peer``: transfers one
        peer may have pending at once (a round's payload: 1; expert versions fetched from
        one holder: node/algorithms/spes/experts.py's fan-out cap). ``hashed``: senders
        present sha256(token) (the module docstring says why)."""
        if not ips:
            raise ValueError("a data channel listens on at least one address")
        if per_peer < 1:
            raise ValueError(f"per_peer must be >= 1, got {per_peer}")
        self._ips = ips
        self._per_peer = per_peer
        self._hashed = hashed
        self.nonce = secrets.token_bytes(TOKEN_NBYTES) if hashed else b""
        """A ``hashed`` channel's: told to senders, who expect ``greeting_of(nonce)`` first."""
        self._greeting = greeting_of(self.nonce) if hashed else b""
        self._pending: dict[bytes, _Pending] = {}
        """Transfers whose sender has not connected yet, by what it will present."""
        self._transfers: dict[bytes, _Pending] = {}
        """Every transfer until its receiver is done with it, by token."""
        self.port = 0

    async def run(self, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await self._listen()
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _listen(self) -> list[trio.SocketListener]:
        """Listeners on every address at one port the first picked; another family's address
        that has that port taken tries again with a new port, then goes without it."""
        for attempt in range(SAME_PORT_TRIES):
            listeners = list(await trio.open_tcp_listeners(0, host=self._ips[0]))
            port = listeners[0].socket.getsockname()[1]
            try:
                for ip in self._ips[1:]:
                    listeners += await trio.open_tcp_listeners(port, host=ip)
            except OSError as exc:
                for listener in listeners:
                    await listener.aclose()
                if attempt + 1 < SAME_PORT_TRIES:
                    continue
                logger.warning("data channel: listening on %s only (%s)", self._ips[0], exc)
                return list(await trio.open_tcp_listeners(0, host=self._ips[0]))
            return listeners
        raise AssertionError("unreachable")

    def has_room(self, peer_id: str) -> bool:
        """Whether ``expect`` would take another transfer of ``peer_id`` now."""
        return (
            sum(p.peer_id == peer_id for p in self._transfers.values()) < self._per_peer
            and len(self._transfers) < MAX_PENDING
        )

    def expect(self, buffer: memoryview, peer_id: str) -> bytes:
        """Register ``peer_id``'s transfer into ``buffer``; returns the token it must present
        (its sha256 on a ``hashed`` channel). The receiver ends it with ``wait`` or ``cancel``.

        Only authorized transfers get here (protocol/net/exchange.py, the SPES expert
        fetches), at most ``per_peer`` per peer at a time, so a stranger cannot take the
        slots an expected partner needs.
        """
        if sum(p.peer_id == peer_id for p in self._transfers.values()) >= self._per_peer:
            raise BadMessage(f"{peer_id} already has {self._per_peer} transfer(s) pending")
        if len(self._transfers) >= MAX_PENDING:
            raise ProtocolError(f"{MAX_PENDING} transfers already pending")
        token = secrets.token_bytes(TOKEN_NBYTES)
        pending = _Pending(buffer, peer_id)
        self._transfers[token] = pending
        self._pending[presented(token) if self._hashed else token] = pending
        return token

    async def wait(self, token: bytes, *, connect_timeout_s: float | None = None) -> None:
        """Until the transfer under ``token`` filled its buffer; ``ProtocolError`` if it
        failed, or if its sender did not connect within ``connect_timeout_s`` (not judged:
        the sender may not be able to reach our port). The transfer ends here either way."""
        pending = self._transfers.get(token)
        if pending is None:
            raise ProtocolError("data channel: no transfer under this token (ended)")
        try:
            if connect_timeout_s is not None:
                with trio.move_on_after(connect_timeout_s):
                    await pending.started.wait()
                if not pending.started.is_set():
                    raise ProtocolError(f"data channel: no connection within {connect_timeout_s:g} s")
            await pending.done.wait()
        finally:
            self.cancel(token)
        if pending.error is not None:
            raise ProtocolError(pending.error)

    def cancel(self, token: bytes) -> None:
        """End the transfer under ``token``: its token no longer works, a connection still
        filling its buffer is cut, and a ``wait`` on it returns (``ProtocolError``)."""
        self._pending.pop(presented(token) if self._hashed else token, None)
        pending = self._transfers.pop(token, None)
        if pending is not None and not pending.done.is_set():
            pending.error = "data channel: the transfer was ended by its receiver"
            if pending.filling is not None:
                pending.filling.cancel()
            pending.done.set()

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            if self._greeting:
                try:
                    await stream.send_all(self._greeting)
                except (trio.BrokenResourceError, OSError):
                    return
                TRAFFIC.sent += len(self._greeting)
            token = b""
            with trio.move_on_after(TOKEN_TIMEOUT_S):
                while len(token) < TOKEN_NBYTES:
                    chunk = await stream.receive_some(TOKEN_NBYTES - len(token))
                    if not chunk:
                        return
                    TRAFFIC.received += len(chunk)
                    token += chunk
            pending = self._pending.pop(token, None)  # one use only
            if pending is None:
                logger.info("data channel: connection without a pending token dropped")
                return
            pending.started.set()
            with trio.CancelScope() as pending.filling:
                try:
                    await _fill(stream, pending.buffer)
                except ProtocolError as exc:
                    pending.error = f"data channel: {exc}"
                pending.done.set()
            pending.filling = None


class Cooldowns:
    """Peers the data channel failed with lately, each for ``duration_s`` of trio's clock
    (their bytes take the Noise stream meanwhile); past ``max_peers`` entries, the ones
    whose time has passed are forgotten."""

    def __init__(self, duration_s: float, *, max_peers: int = 256) -> None:
        self._duration_s = duration_s
        self._max_peers = max_peers
        self._until: dict[str, float] = {}

    def mark(self, peer_id: str) -> None:
        now = trio.current_time()
        if len(self._until) > self._max_peers:
            self._until = {p: t for p, t in self._until.items() if t > now}
        self._until[peer_id] = now + self._duration_s

    def __contains__(self, peer_id: object) -> bool:
        until = self._until.get(peer_id) if isinstance(peer_id, str) else None
        if until is not None and until <= trio.current_time():
            del self._until[peer_id]  # type: ignore[arg-type]
            return False
        return until is not None

    def clear(self) -> None:
        self._until.clear()


def presented(token: bytes) -> bytes:
    """What a sender presents on a ``hashed`` channel for ``token``."""
    return hashlib.sha256(token).digest()


def greeting_of(nonce: bytes) -> bytes:
    """What a ``hashed`` channel told of ``nonce`` sends first on every connection."""
    return hashlib.sha256(b"swarmtrain-data-channel-greeting\0" + nonce).digest()


async def _fill(stream: trio.SocketStream, buffer: memoryview) -> None:
    """Receive straight into ``buffer`` (recv_into: no per-chunk allocation, no second copy)."""
    sock = stream.socket
    offset = 0
    try:
        while offset < len(buffer):
            nbytes = await sock.recv_into(buffer[offset : offset + CHUNK_NBYTES])
            if nbytes == 0:
                raise ProtocolError(f"connection closed {len(buffer) - offset} bytes early")
            offset += nbytes
            TRAFFIC.received += nbytes
        if await sock.recv(1):
            raise ProtocolError("more bytes than announced")
    except OSError as exc:
        raise ProtocolError(f"receive failed: {exc}") from exc


async def send(
    ip: str,
    port: int,
    token: bytes,
    data: memoryview,
    limit: RateLimit = UNLIMITED,
    *,
    nonce: bytes | None = None,
) -> None:
    """The sending side: connect, present the token, write the payload (within ``limit``),
    close. ``token``: what the receiver's channel expects presented (``presented(token)``
    on a ``hashed`` one); ``nonce``: a ``hashed`` channel's, whose ``greeting_of`` is read
    and compared before anything is written. ``ProtocolError`` for a port under MIN_PORT
    (never dialed)."""
    greeting = None if nonce is None else greeting_of(nonce)
    if not MIN_PORT <= port <= 65535:
        raise ProtocolError(f"data channel to {ip}:{port}: not a port a data channel has")
    stream: trio.SocketStream | None = None
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        try:
            stream = await trio.open_tcp_stream(ip, port)
        except OSError as exc:
            raise ProtocolError(f"data channel to {ip}:{port}: {exc}") from exc
    if stream is None:
        raise ProtocolError(f"data channel to {ip}:{port}: no connection within {CONNECT_TIMEOUT_S:g} s")
    async with stream:
        try:
            if greeting is not None:
                heard = b""
                with trio.move_on_after(CONNECT_TIMEOUT_S):
                    while len(heard) < len(greeting):
                        chunk = await stream.receive_some(len(greeting) - len(heard))
                        if not chunk:
                            break
                        heard += chunk
                TRAFFIC.received += len(heard)
                if heard != greeting:  # not the channel we were told of: nothing written
                    raise ProtocolError(f"data channel at {ip}:{port} did not greet as told")
            await stream.send_all(token)
            TRAFFIC.sent += len(token)
            for offset in range(0, len(data), CHUNK_NBYTES):
                await limit.take(min(CHUNK_NBYTES, len(data) - offset))
                await stream.send_all(data[offset : offset + CHUNK_NBYTES])
                TRAFFIC.sent += min(CHUNK_NBYTES, len(data) - offset)
            await stream.send_eof()
        except (trio.BrokenResourceError, OSError) as exc:
            raise ProtocolError(f"data channel to {ip}:{port} broke: {exc}") from exc
