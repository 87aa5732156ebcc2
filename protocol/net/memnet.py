"""An in-memory network of fake hosts for protocol tests, with seeded faults.

``FakeNetwork`` makes ``FakeHost``s that satisfy ``protocol.net.hostlike.TensorHostLike``: streams are
in-memory pipes, gossip goes straight to every other subscriber, and inbound streams are
served in the network's nursery under the boundary rule of ``protocol.net.host.Host.set_handler``
(a banned peer's stream is reset unread, a deadline, ``guard.run``). Time is trio's: under an
autojump clock, minutes of network time take milliseconds.

Fault model (``Faults``), every draw from one ``random.Random(seed)``:

    drop       a gossip delivery is lost; a stream write breaks its stream (both ends'
               reads raise ``StreamError``, as a reset by the network would)
    delay      each gossip delivery and each stream write waits a uniform draw from
               ``delay_s`` (a task per gossip delivery; the writer itself for a stream,
               which keeps a stream's bytes in order)
    duplicate  a gossip delivery arrives twice (each copy with its own delay)
    reorder    not a knob: independent delays deliver gossip out of order
    corrupt    one byte of a gossip delivery or of a stream write is flipped
    partition  ``partition(group, ...)``: peers in different groups cannot reach each
               other (dials fail, streams across the cut break, gossip is not delivered)
               until ``heal()``; a ban cuts a pair the same way (protocol/net/libp2p_fixes.py)

Every fate lands in ``log`` (unless ``keep_log`` is off: a scale run keeps counts only):
the same seed and the same sequence of calls give the same log (under concurrency trio's
scheduler may order the calls differently from run to run).

For scale runs (bench/scale.py), beside the faults:

    latency    ``latency(a, b)``: seconds one way between two peers, added to each
               gossip delivery and stream write
    traffic    ``traffic``: bytes in and out per (peer, label), a stream's label its
               protocol id, gossip's ``gossip_label(data)``; a stream write costs its bytes
               plus STREAM_FRAME_NBYTES, a stream's opening STREAM_OPEN_NBYTES plus its
               protocol id each way; a gossip message GOSSIP_FRAME_NBYTES plus its bytes,
               GOSSIP_COPIES times in and out at each receiver and out at its publisher (a
               GossipSub mesh of that degree forwards each message to its mesh peers; the
               delivery itself reaches every subscriber once)
    churn      ``remove_host``: a host gone without a word (its links break, dials fail)
"""

import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from protocol import keys
from protocol.errors import DialError, StreamError
from protocol.net import gossip
from protocol.net.guard import Guard
from protocol.net.hostlike import HANDLER_DEADLINE_S, GossipMessage, PeerAddrs, StreamLikeHandler, serve_guarded
from protocol.net.peers import PeerTable
from protocol.ratelimit import RateLimit

# libp2p's subscription queues hold this many (protocol/net/host.py widens them to 4096).
GOSSIP_QUEUE_SIZE = 4096
# The traffic model (see the module docstring): yamux's 12-byte header and Noise's 16-byte
# tag on each write; a stream's yamux SYN and multistream-select's negotiation; a GossipSub
# message's from, seqno, topic, signature and key (~180 bytes) in its RPC frame; GossipSub's
# mesh degree D (protocol/net/gossip.py).
STREAM_FRAME_NBYTES = 28
STREAM_OPEN_NBYTES = 64
GOSSIP_FRAME_NBYTES = 180
GOSSIP_COPIES = gossip.MESH_DEGREE


@dataclass(frozen=True, kw_only=True, slots=True)
class Faults:
    drop: float = 0.0
    """Probability that a gossip delivery is lost, or that a stream write breaks its stream."""
    duplicate: float = 0.0
    """Probability that a gossip delivery arrives twice."""
    corrupt: float = 0.0
    """Probability that one byte of a gossip delivery or a stream write is flipped."""
    delay_s: tuple[float, float] = (0.0, 0.0)
    """Each gossip delivery and stream write takes a uniform draw from this range."""

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "corrupt"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} is a probability, got {getattr(self, name)}")
        if not 0.0 <= self.delay_s[0] <= self.delay_s[1]:
            raise ValueError(f"delay_s must be a range (low, high) of seconds ≥ 0, got {self.delay_s}")


@dataclass(frozen=True, slots=True)
class Delivery:
    """One fate in the log: ``kind`` "gossip" or "stream", ``fate`` "delivered", "corrupted",
    "dropped" (gossip), "broken" (stream), "cut" (partition or ban) or "overflow"."""

    at: float
    kind: str
    fate: str
    sender: str
    receiver: str
    data: bytes


class _Pipe:
    """One direction of a stream: bytes in order, then an end (finished or broken)."""

    def __init__(self) -> None:
        self._data = bytearray()
        self.finished = False
        self.broken: str | None = None
        self._wake = trio.Event()

    def put(self, data: bytes) -> None:
        if not self.finished and self.broken is None:
            self._data += data
            self._notify()

    def finish(self) -> None:
        self.finished = True
        self._notify()

    def break_(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            self._data.clear()
            self._notify()

    async def take(self, max_nbytes: int) -> bytes:
        """Up to ``max_nbytes`` bytes; b"" at the end; ``StreamError`` once broken."""
        await trio.lowlevel.checkpoint()
        while True:
            if self.broken is not None:
                raise StreamError(f"stream broken: {self.broken}")
            if self._data:
                chunk = bytes(self._data[:max_nbytes])
                del self._data[:max_nbytes]
                return chunk
            if self.finished:
                return b""
            await self._wake.wait()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()


@dataclass(slots=True)
class _Link:
    """A stream's two directions, between two peers."""

    a: str
    b: str
    label: str = ""
    """The stream's protocol id (the traffic it carries is counted under it)."""
    a_to_b: _Pipe = field(default_factory=_Pipe)
    b_to_a: _Pipe = field(default_factory=_Pipe)

    def break_(self, reason: str) -> None:
        self.a_to_b.break_(reason)
        self.b_to_a.break_(reason)

    def done(self) -> bool:
        return all(p.broken is not None or p.finished for p in (self.a_to_b, self.b_to_a))


class FakeStream:
    """One end of an in-memory stream (``StreamLike``)."""

    def __init__(self, net: "FakeNetwork", link: _Link, me: str, peer_id: str, *, inbox: _Pipe, outbox: _Pipe) -> None:
        self._net = net
        self._link = link
        self._me = me
        self.peer_id = peer_id
        self._inbox = inbox
        self._outbox = outbox
        self.nbytes_read = 0

    async def read_exact(self, nbytes: int) -> bytes:
        buffer = bytearray(nbytes)
        await self.read_into(memoryview(buffer), chunk_nbytes=nbytes)
        return bytes(buffer)

    async def read_into(self, buffer: memoryview, *, chunk_nbytes: int) -> None:
        offset = 0
        while offset < len(buffer):
            chunk = await self._inbox.take(min(chunk_nbytes, len(buffer) - offset))
            if not chunk:
                raise StreamError(f"stream ended {len(buffer) - offset} bytes early")
            buffer[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
            self.nbytes_read += len(chunk)

    async def write(self, data: bytes) -> None:
        if self._outbox.broken is not None or self._outbox.finished:
            raise StreamError(f"write failed: stream {self._outbox.broken or 'closed'}")
        await self._net._carry(self._link, self._me, self.peer_id, self._outbox, bytes(data))

    async def close(self) -> None:
        self._outbox.finish()
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        self._link.break_("reset by the peer")
        await trio.lowlevel.checkpoint()


class FakeHost:
    """A ``HostLike`` on a ``FakeNetwork``; its guard and peer table are its own."""

    def __init__(self, net: "FakeNetwork", seed: bytes, *, peer_ttl_s: float) -> None:
        self._net = net
        self.seed = seed
        """The node key (to sign this peer's records)."""
        self.peer_id = keys.peer_id_of(seed)
        self.guard = Guard(PeerTable(ttl_s=peer_ttl_s))
        self.guard.on_ban = self.disconnect
        self._handlers: dict[str, tuple[StreamLikeHandler, float]] = {}
        self._subscriptions: dict[str, list[trio.MemorySendChannel[GossipMessage]]] = {}
        self._connected: set[str] = set()
        self._connections_changed = trio.Event()
        self.behind_nat = False
        """Reached only over a connection it is already in: a stream opened to it from a
        host with none hangs for the open's timeout, as libp2p's dial of a NATed peer's
        addresses does (its SYNs dropped), however the connection comes meanwhile."""

    @property
    def peers(self) -> PeerTable:
        return self.guard.peers

    # --- TensorHostLike: every connection is direct, and tensors may take any of them ---

    def addrs(self) -> list[str]:
        return [f"/memory/{self.peer_id}/p2p/{self.peer_id}"]

    def direct_ip(self, peer_id: str) -> str | None:
        return None  # no data channel: bulk bytes take the stream

    @property
    def private(self) -> bool:
        return self.behind_nat

    def tensor_refusal(self, peer_id: str) -> str | None:
        return None

    def tensor_limit(self, peer_id: str, upload: RateLimit) -> RateLimit:
        return upload

    def forward_data_port(self, port: int) -> None:
        pass

    def unforward_data_port(self, port: int) -> None:
        pass

    def set_handler(
        self, protocol_id: str, handler: StreamLikeHandler, *, deadline_s: float = HANDLER_DEADLINE_S
    ) -> None:
        self._handlers[protocol_id] = (handler, deadline_s)

    async def open_stream(self, peer_id: str, protocol_id: str, *, timeout_s: float) -> FakeStream:
        await trio.lowlevel.checkpoint()
        target = self._net.hosts.get(peer_id)
        if target is not None and target.behind_nat and peer_id not in self._connected:
            await trio.sleep(timeout_s)  # virtual: the dial's SYNs go unanswered
            raise StreamError(f"open {protocol_id} to {peer_id} timed out after {timeout_s:g} s")
        if target is None or not self._net.reachable(self.peer_id, peer_id):
            raise StreamError(f"open {protocol_id} to {peer_id} failed: unreachable")
        if protocol_id not in target._handlers:
            raise StreamError(f"open {protocol_id} to {peer_id} failed: protocol not supported")
        self._link_up(target)
        ours, theirs = self._net._open_link(self.peer_id, peer_id, protocol_id)
        self._net.nursery.start_soon(target._serve, protocol_id, theirs)
        return ours

    async def _serve(self, protocol_id: str, stream: FakeStream) -> None:
        """``Host.set_handler``'s boundary rule: the same function serves both."""
        handler, deadline_s = self._handlers[protocol_id]
        await serve_guarded(self.guard, protocol_id, stream, handler, deadline_s=deadline_s)

    async def punish(self, peer_id: str, reason: str, *, points: int = 1) -> bool:
        return await self.guard.punish(peer_id, reason, points=points)

    async def publish(self, topic: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self._net._gossip(self.peer_id, topic, bytes(data))

    async def subscribe(self, topic: str) -> AsyncGenerator[GossipMessage, None]:
        send, receive = trio.open_memory_channel[GossipMessage](GOSSIP_QUEUE_SIZE)
        self._subscriptions.setdefault(topic, []).append(send)
        try:
            while True:
                yield await receive.receive()
        finally:
            self._subscriptions[topic].remove(send)

    def connected_peers(self) -> set[str]:
        return set(self._connected)

    async def connect(self, peer: PeerAddrs, *, timeout_s: float) -> None:
        await trio.lowlevel.checkpoint()
        if peer.peer_id == self.peer_id:
            raise DialError("refusing to dial ourselves")
        target = self._net.hosts.get(peer.peer_id)
        if target is None or not self._net.reachable(self.peer_id, peer.peer_id):
            raise DialError(f"dial {peer.peer_id} failed: unreachable")
        self._link_up(target)

    def _link_up(self, target: "FakeHost") -> None:
        for host, peer_id in ((self, target.peer_id), (target, self.peer_id)):
            if peer_id not in host._connected:
                host._connected.add(peer_id)
                host._connection_event()

    def _connection_event(self) -> None:
        self._connections_changed.set()
        self._connections_changed = trio.Event()

    @property
    def connections_changed(self) -> trio.Event:
        return self._connections_changed

    async def disconnect(self, peer_id: str) -> None:
        await trio.lowlevel.checkpoint()
        self._net._cut(lambda a, b: {a, b} == {self.peer_id, peer_id}, "disconnected")


class FakeNetwork:
    """Fake hosts, their links, and the faults between them (see the module docstring)."""

    def __init__(
        self,
        seed: int,
        faults: Faults,
        *,
        latency: Callable[[str, str], float] | None = None,
        gossip_label: Callable[[bytes], str] | None = None,
        keep_log: bool = True,
    ) -> None:
        self.random = random.Random(seed)
        self.faults = faults
        self.latency = latency
        """Seconds one way between two peers (added to the faults' delay); None: none."""
        self.gossip_label = gossip_label
        """The traffic label of a gossip message's bytes; None: "gossip"."""
        self.keep_log = keep_log
        self.hosts: dict[str, FakeHost] = {}
        self.log: list[Delivery] = []
        self.traffic: dict[tuple[str, str], list[int]] = {}
        """(peer, label) → [bytes in, bytes out]."""
        self.fates: dict[str, int] = {}
        """How many deliveries met each fate (kept with or without the log)."""
        self._side: dict[str, int] = {}
        self._links: list[_Link] = []
        self._links_kept = 0
        """Links left after the last pruning of ended ones."""
        self._nursery: trio.Nursery | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator["FakeNetwork"]:
        """The nursery where handlers and deliveries run; cancelled on leaving."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()
                self._nursery = None

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None, "use the network inside `async with net.running()`"
        return self._nursery

    def add_host(self, seed: bytes, *, peer_ttl_s: float = 30.0) -> FakeHost:
        host = FakeHost(self, seed, peer_ttl_s=peer_ttl_s)
        self.hosts[host.peer_id] = host
        return host

    def remove_host(self, peer_id: str) -> None:
        """``peer_id`` is gone without a word (a crash, a pulled cable): its streams break,
        its connections end, and nobody reaches it from now on."""
        self._cut(lambda a, b: peer_id in (a, b), "the peer is gone")
        host = self.hosts.pop(peer_id, None)
        if host is not None:
            host._connected.clear()

    # --- traffic ---

    def _count(self, peer_id: str, label: str, nbytes_in: int, nbytes_out: int) -> None:
        counts = self.traffic.get((peer_id, label))
        if counts is None:
            counts = self.traffic[(peer_id, label)] = [0, 0]
        counts[0] += nbytes_in
        counts[1] += nbytes_out

    def _one_way_s(self, a: str, b: str) -> float:
        return self._delay_s() + (self.latency(a, b) if self.latency is not None else 0.0)

    # --- partitions ---

    def partition(self, *groups: Iterable[str]) -> None:
        """Peers in different groups cannot reach each other (peers in no group form one more)."""
        self._side = {peer_id: index for index, group in enumerate(groups) for peer_id in group}
        self._cut(lambda a, b: not self._same_side(a, b), "partitioned")

    def heal(self) -> None:
        self._side = {}

    def reachable(self, a: str, b: str) -> bool:
        """Both on the network, not across a partition, and neither has banned the other
        (bans close connections)."""
        return (
            a in self.hosts
            and b in self.hosts
            and self._same_side(a, b)
            and not any(self.hosts[x].guard.banned(y) for x, y in ((a, b), (b, a)))
        )

    def _same_side(self, a: str, b: str) -> bool:
        return self._side.get(a, -1) == self._side.get(b, -1)

    def _cut(self, between: Callable[[str, str], bool], reason: str) -> None:
        for link in self._links:
            if between(link.a, link.b):
                link.break_(reason)
        self._links = [link for link in self._links if not link.done()]
        for host in self.hosts.values():
            kept = {p for p in host._connected if not between(host.peer_id, p)}
            if kept != host._connected:
                host._connected = kept
                host._connection_event()

    # --- faults ---

    def corrupted(self, a: str, b: str) -> int:
        """Corrupted deliveries between ``a`` and ``b``, either way."""
        return sum(1 for d in self.log if d.fate == "corrupted" and {d.sender, d.receiver} == {a, b})

    def _delay_s(self) -> float:
        low, high = self.faults.delay_s
        return self.random.uniform(low, high) if high > 0 else 0.0

    def _maybe_corrupt(self, data: bytes) -> tuple[str, bytes]:
        if not data or self.random.random() >= self.faults.corrupt:
            return "delivered", data
        flipped = bytearray(data)
        flipped[self.random.randrange(len(flipped))] ^= self.random.randrange(1, 256)
        return "corrupted", bytes(flipped)

    def _record(self, kind: str, fate: str, sender: str, receiver: str, data: bytes) -> None:
        self.fates[fate] = self.fates.get(fate, 0) + 1
        if self.keep_log:
            self.log.append(Delivery(trio.current_time(), kind, fate, sender, receiver, data))

    # --- streams ---

    def _open_link(self, a: str, b: str, label: str = "") -> tuple[FakeStream, FakeStream]:
        link = _Link(a, b, label)
        opening = STREAM_OPEN_NBYTES + len(label)
        self._count(a, label, opening, opening)
        self._count(b, label, opening, opening)
        if len(self._links) >= 2 * self._links_kept + 64:  # now and then: each look is O(links)
            self._links = [old for old in self._links if not old.done()]
            self._links_kept = len(self._links)
        self._links.append(link)
        ours = FakeStream(self, link, a, b, inbox=link.b_to_a, outbox=link.a_to_b)
        return ours, FakeStream(self, link, b, a, inbox=link.a_to_b, outbox=link.b_to_a)

    async def _carry(self, link: _Link, sender: str, receiver: str, pipe: _Pipe, data: bytes) -> None:
        """One stream write: its delay in the writer (bytes stay in order), then its fate."""
        await trio.sleep(self._one_way_s(sender, receiver))
        if pipe.broken is not None:  # reset while the bytes travelled
            raise StreamError(f"write failed: stream {pipe.broken}")
        if not self.reachable(sender, receiver):
            self._record("stream", "cut", sender, receiver, data)
            link.break_("cut by a partition or a ban")
        elif self.random.random() < self.faults.drop:
            self._record("stream", "broken", sender, receiver, data)
            link.break_("broken by the network")
        else:
            fate, data = self._maybe_corrupt(data)
            self._record("stream", fate, sender, receiver, data)
            nbytes = len(data) + STREAM_FRAME_NBYTES
            self._count(sender, link.label, 0, nbytes)
            self._count(receiver, link.label, nbytes, 0)
            pipe.put(data)

    # --- gossip ---

    def _gossip(self, sender: str, topic: str, data: bytes) -> None:
        # What it costs the publisher, and each receiver each way (a corrupted copy is as long).
        label = self.gossip_label(data) if self.gossip_label is not None else "gossip"
        cost = (label, GOSSIP_COPIES * (GOSSIP_FRAME_NBYTES + len(data)))
        self._count(sender, label, 0, cost[1])
        for receiver in sorted(self.hosts):
            if receiver == sender or not self.hosts[receiver]._subscriptions.get(topic):
                continue
            if not self.reachable(sender, receiver):
                self._record("gossip", "cut", sender, receiver, data)
                continue
            if self.random.random() < self.faults.drop:
                self._record("gossip", "dropped", sender, receiver, data)
                continue
            copies = 2 if self.random.random() < self.faults.duplicate else 1
            for _ in range(copies):
                fate, payload = self._maybe_corrupt(data)
                delay_s = self._one_way_s(sender, receiver)
                if delay_s:
                    self.nursery.start_soon(self._deliver_later, delay_s, fate, sender, receiver, topic, payload, cost)
                else:  # at once, in order: tasks woken together run in an order trio shuffles
                    self._deliver(fate, sender, receiver, topic, payload, cost)

    async def _deliver_later(
        self, delay_s: float, fate: str, sender: str, receiver: str, topic: str, data: bytes, cost: tuple[str, int]
    ) -> None:
        await trio.sleep(delay_s)
        self._deliver(fate, sender, receiver, topic, data, cost)

    def _deliver(self, fate: str, sender: str, receiver: str, topic: str, data: bytes, cost: tuple[str, int]) -> None:
        """One delivery; ``cost``: the traffic (label, bytes) it costs the receiver each way."""
        if not self.reachable(sender, receiver):  # cut (or the receiver gone) while it travelled
            self._record("gossip", "cut", sender, receiver, data)
            return
        label, nbytes = cost
        self._count(receiver, label, nbytes, nbytes)
        for channel in list(self.hosts[receiver]._subscriptions.get(topic, [])):
            try:
                channel.send_nowait(GossipMessage(sender, data))
            except trio.WouldBlock:
                self._record("gossip", "overflow", sender, receiver, data)
                continue
            self._record("gossip", fate, sender, receiver, data)
