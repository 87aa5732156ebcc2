"""What the run's protocols need of a host, as ``typing.Protocol``s: the seam for tests.

``protocol/net/host.py``'s ``Host`` (libp2p) and ``Stream`` satisfy these structurally; an
in-memory network (protocol/net/memnet.py) does too, so RunService, StateSync and ZoLogSync run
against either. Nothing here imports libp2p.

    HostLike                       StreamLike
    ├── peer_id, guard, peers      ├── peer_id
    ├── set_handler, open_stream   ├── read_exact, read_into, write
    ├── connect, disconnect,       └── close, reset
    │   connected_peers
    ├── publish, subscribe
    └── punish
    DirectHostLike (NAT traversal): HostLike + addrs, direct_ip
    TensorHostLike (payloads, saved states, experts): DirectHostLike + private,
        tensor_refusal, tensor_limit, forward_data_port, unforward_data_port

A host keeps the boundary rule (protocol/net/guard.py): an inbound stream of a banned peer is
reset unread, a handler runs under a deadline inside ``guard.run``, and every failure of a
stream is a ``StreamError``, of a dial a ``DialError`` (protocol/errors.py).
"""

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

import trio

from protocol.errors import Overdue, ProtocolError, StreamError
from protocol.net.guard import Guard
from protocol.net.peers import PeerTable
from protocol.ratelimit import RateLimit

# An inbound stream's handler ends within this unless its protocol sets its own bound:
# our control exchanges take milliseconds, and a peer that stalls must not hold a task.
HANDLER_DEADLINE_S = 30.0


@dataclass(frozen=True, slots=True)
class PeerAddrs:
    """A peer and the addresses it can be dialed on (multiaddr strings without /p2p)."""

    peer_id: str
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GossipMessage:
    """A message received on a gossip topic; ``from_peer`` is verified by libp2p's signing."""

    from_peer: str
    data: bytes


class StreamLike(Protocol):
    """One bidirectional stream to a peer, with exact reads."""

    @property
    def peer_id(self) -> str:
        """The peer at the other end."""
        ...

    @property
    def nbytes_read(self) -> int:
        """Bytes read from the peer so far."""
        ...

    async def read_exact(self, nbytes: int) -> bytes: ...

    async def read_into(self, buffer: memoryview, *, chunk_nbytes: int) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None:
        """Done writing (the peer reads the end); never raises."""
        ...

    async def reset(self) -> None:
        """Abort both directions (the peer's reads fail); never raises."""
        ...


StreamLikeHandler = Callable[[StreamLike], Awaitable[None]]
S = TypeVar("S", bound=StreamLike)


async def serve_guarded(
    guard: Guard, protocol_id: str, stream: S, handler: Callable[[S], Awaitable[None]], *, deadline_s: float
) -> None:
    """An inbound stream under the boundary rule (every host serves its streams this way):
    a banned peer's is reset unread; the handler runs under ``deadline_s`` in the guard;
    the stream is closed if it returned, reset if anything escaped (already judged).

    A deadline that passes before the peer sent a byte is the peer's (a point: it held a
    handler for nothing); once it sent its request, the deadline is ``Overdue``, nobody's
    fault: on a loaded machine the slow one is as often us, and honest nodes of a 16-node
    soak on 2 cores would otherwise collect points from each other until they were banned."""
    if guard.banned(stream.peer_id):
        await stream.reset()
        return

    async def bounded() -> None:
        try:
            with trio.fail_after(deadline_s):
                await handler(stream)
        except trio.TooSlowError:
            if stream.nbytes_read:
                raise Overdue(f"{protocol_id}: not done within {deadline_s:g} s") from None
            raise

    if await guard.run(stream.peer_id, protocol_id, bounded):
        await stream.close()
    else:
        with trio.CancelScope(shield=True):
            await stream.reset()


class HostLike(Protocol):
    """A node on the network: streams by protocol id, gossip by topic, and the guard."""

    @property
    def peer_id(self) -> str: ...

    @property
    def guard(self) -> Guard:
        """The boundary rule: handlers run in it, misbehaviour is judged there."""
        ...

    @property
    def peers(self) -> PeerTable:
        """Liveness and penalties (the guard's table)."""
        ...

    def set_handler(self, protocol_id: str, handler: StreamLikeHandler, *, deadline_s: float = ...) -> None:
        """Serve ``protocol_id``: each inbound stream goes to ``handler`` under the guard."""
        ...

    async def open_stream(self, peer_id: str, protocol_id: str, *, timeout_s: float) -> StreamLike:
        """A new stream to ``peer_id``; ``StreamError`` if it cannot be opened in time."""
        ...

    async def punish(self, peer_id: str, reason: str, *, points: int = 1) -> bool:
        """Penalize ``peer_id``'s bad input; True if it is now banned (and cut off)."""
        ...

    async def publish(self, topic: str, data: bytes) -> None:
        """Gossip ``data`` on ``topic`` (a hint: it may be lost); ``ProtocolError`` on failure."""
        ...

    def subscribe(self, topic: str) -> AsyncGenerator[GossipMessage, None]:
        """Messages on ``topic`` from others (our own are skipped)."""
        ...

    def connected_peers(self) -> set[str]: ...

    @property
    def connections_changed(self) -> trio.Event:
        """Set at the next connection to or from any peer, or the end of one: take it
        before checking ``connected_peers``, then wait on it."""
        ...

    async def connect(self, peer: PeerAddrs, *, timeout_s: float) -> None:
        """Connect to ``peer`` (no-op when already connected); ``DialError`` on failure."""
        ...

    async def disconnect(self, peer_id: str) -> None: ...


class DirectHostLike(HostLike, Protocol):
    """A host that knows its own addresses and how each peer is connected: what NAT
    traversal (protocol/net/nat.py, dialback.py) needs beyond ``HostLike``."""

    def addrs(self) -> list[str]:
        """Addresses peers should dial, each ending in /p2p/<our peer id>."""
        ...

    def direct_ip(self, peer_id: str) -> str | None:
        """The peer's IPv4 address on our direct TCP connection to it; None if relayed or none."""
        ...


class TensorHostLike(DirectHostLike, Protocol):
    """A host that carries tensors (payload exchanges, saved-state offers, expert fetches):
    the policy of which connections may carry them, and the data channel's port."""

    @property
    def private(self) -> bool:
        """Nobody can open a connection to us (AutoNAT found us behind a NAT): bulk bytes
        take the stream, not our data channel's port."""
        ...

    def tensor_refusal(self, peer_id: str) -> str | None:
        """Why tensors may not travel between us and ``peer_id`` now, or None if they may."""
        ...

    def tensor_limit(self, peer_id: str, upload: RateLimit) -> RateLimit:
        """The rate a tensor upload to ``peer_id`` may use (``upload``, and a relay's cap)."""
        ...

    def forward_data_port(self, port: int) -> None:
        """A data channel listens on ``port``: have the router forward it where we can."""
        ...

    def unforward_data_port(self, port: int) -> None:
        """The data channel on ``port`` closed."""
        ...


async def until_connected(host: HostLike, peer_id: str) -> None:
    """Until we hold a connection to ``peer_id``, however it comes (our dial, the peer's, a
    relay, a hole punch); bound it at the call site."""
    while True:
        changed = host.connections_changed
        if peer_id in host.connected_peers():
            return
        await changed.wait()


async def open_stream_racing(host: HostLike, peer_id: str, protocol_id: str, *, timeout_s: float) -> StreamLike:
    """A new stream to ``peer_id`` as ``open_stream`` opens it, and besides, while that open
    still dials, over a connection that comes some other way meanwhile (the member dials, the
    peer's own dial, a hole punch): a NATed peer's addresses drop a dial's SYNs and the open
    hangs for its whole timeout, with the connection beside it unused (three of four nodes
    starting behind NATs waited out a start's ask on the first one and started a round
    behind it). The first stream opened is the one; the other is reset before it carries a
    request (a connection our own open's dial made wakes the second open too: two streams
    negotiated, one exchange, one judgment). An open that fails at once still waits for a
    connection until ``timeout_s`` (a private address that refuses: the relay's connection
    comes a second later): only for asks that expect a connection to come (a starting or
    joining node's), not for a peer asked again and again."""
    if peer_id in host.connected_peers():
        return await host.open_stream(peer_id, protocol_id, timeout_s=timeout_s)
    opened: list[StreamLike] = []
    errors: list[ProtocolError] = []
    try:
        await _race_opens(host, peer_id, protocol_id, timeout_s, opened, errors)
    except BaseException:
        # Cancelled while the losing open was still being reset (a caller's bound, the
        # first answer of several asks): the stream won must not be left open (its peer
        # would wait for our request, then judge us).
        if opened:
            with trio.CancelScope(shield=True):
                await opened[0].reset()
        raise
    if opened:
        return opened[0]
    raise errors[0] if errors else StreamError(f"open {protocol_id} to {peer_id} timed out after {timeout_s:g} s")


async def _race_opens(
    host: HostLike,
    peer_id: str,
    protocol_id: str,
    timeout_s: float,
    opened: list[StreamLike],
    errors: list[ProtocolError],
) -> None:
    """``open_stream_racing``'s two opens: the first stream opened into ``opened``."""
    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:

            async def attempt(once_connected: bool) -> None:
                if once_connected:
                    await until_connected(host, peer_id)
                try:
                    stream = await host.open_stream(peer_id, protocol_id, timeout_s=timeout_s)
                except ProtocolError as exc:
                    errors.append(exc)
                    return
                if opened:
                    with trio.CancelScope(shield=True):
                        await stream.reset()
                    return
                opened.append(stream)
                nursery.cancel_scope.cancel()

            nursery.start_soon(attempt, False)
            nursery.start_soon(attempt, True)


@asynccontextmanager
async def exchange(
    host: HostLike,
    peer_id: str,
    protocol_id: str,
    *,
    what: str,
    timeout_s: float,
    open_timeout_s: float | None = None,
    race_connection: bool = False,
) -> AsyncIterator[StreamLike]:
    """One exchange of ours with ``peer_id`` on a new stream, ``timeout_s`` in all (the open
    within ``open_timeout_s``, by default the same; ``race_connection``: opened by
    ``open_stream_racing``, for a peer we may hold no connection to yet).

    The stream goes on the way out, whatever happened: closed after the body returned,
    reset otherwise, our own timeout included (a stream left behind holds one of yamux's
    256 slots per connection: a 16-node soak ran out of them and no pull between two
    daemons opened again). A ``ProtocolError`` from the body is judged (a malformed answer
    costs the peer) and raised on; the timeout becomes a ``ProtocolError`` naming ``what``
    (an open's own: the host's ``StreamError``), not judged (the slow one may be us).
    """
    open_stream = partial(open_stream_racing, host) if race_connection else host.open_stream
    ends_at = trio.current_time() + timeout_s
    # The open under its own bound only: cut by ours first, a stream that never opened would
    # go uncounted by the host, which closes a connection on which opens keep failing
    # (Host.open_stream). Its timeout raises StreamError.
    stream = await open_stream(peer_id, protocol_id, timeout_s=min(open_timeout_s or timeout_s, timeout_s))
    with trio.move_on_at(ends_at) as scope:
        try:
            yield stream
        except ProtocolError as exc:
            await stream.reset()
            await host.guard.judge(peer_id, what, exc)
            raise
        except BaseException:  # our timeout, a cancellation: the stream must still go
            await stream.reset()
            raise
        await stream.close()
    if scope.cancelled_caught:
        raise ProtocolError(f"{what} with {peer_id} timed out")
