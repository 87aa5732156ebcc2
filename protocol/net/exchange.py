"""Bulk tensors between two peers: header, go-ahead, the bytes, verdict.

Protocol flow (``/swarmtrain/exchange/1.0.0``), one transfer per stream:

    sender                                                       receiver
    {t: "tensors", v: 1, round, tensors: [{name, dtype, shape,
     nbytes}], nbytes, blake3, channel: "direct" | "stream"} ──▶ checks every field, the total
                                                                 against its limit; allocates once
                                           ◀── {t: "ack", v: 1, ok: false, reason}  (refused), or
                                           ◀── {t: "go", v: 1, port, token}
    port > 0: the bytes over the direct data channel (protocol/net/data_channel.py) to the
              receiver's IP on that port, after the token;
    port = 0: the bytes on this stream.
                                           ◀── {t: "ack", v: 1, ok, reason}  after the hash check

The header, the token and the verdict always travel on the Noise-secured stream; only the
bulk bytes may take the direct channel, which is ≈10× faster in py-libp2p (see
data_channel.py), and the BLAKE3 hash in the header catches any tampering there.

The daemon never imports torch: tensors travel as named byte buffers with a dtype string
and a shape, and the worker turns them into tensors (and checks their values: NaN, Inf).
Here we check structure: known dtype, shape × itemsize = nbytes, sizes under the limits
before any allocation, and the hash. A payload failing any check is refused with a
reason, its sender penalized, and it is never handed on.
"""

import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import blake3
import trio

from protocol import wire
from protocol.errors import BadMessage, ProtocolError, StreamError
from protocol.net import data_channel
from protocol.net.data_channel import DataChannel
from protocol.net.hostlike import StreamLike, TensorHostLike
from protocol.ratelimit import UNLIMITED, RateLimit

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/exchange/1.0.0"
VERSION = 1
ITEM_NBYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
# A 125M-parameter model is ~150 tensors; MoE models have more, but not 10^5.
MAX_TENSORS = 100_000
MAX_DIMS = 8
MAX_HEADER_NBYTES = 16 << 20
# Writes and reads of 1 MiB: per-call overhead vanishes, copies stay bounded.
CHUNK_NBYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_NBYTES = 4 << 30
HASH_NBYTES = 32
# Below this, starting hash threads costs more than it saves.
PARALLEL_HASH_NBYTES = 16 << 20
_REPLY = frozenset({"go", "ack"})
_ACK = frozenset({"ack"})


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM_NBYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Payload:
    """Named tensors as one contiguous buffer: ``specs`` in order, their bytes back to back."""

    round: int
    specs: tuple[TensorSpec, ...]
    data: bytes | bytearray | memoryview

    def views(self) -> dict[str, memoryview]:
        """Each tensor's bytes, without copying."""
        out: dict[str, memoryview] = {}
        offset = 0
        view = memoryview(self.data)
        for spec in self.specs:
            out[spec.name] = view[offset : offset + spec.nbytes]
            offset += spec.nbytes
        return out


class Unexpected(ProtocolError):
    """A well-formed transfer we did not ask for (another round, not our partner now):
    refused before any allocation, without a penalty (an honest peer may be a moment late)."""


class Tampered(ProtocolError):
    """Bytes over the direct data channel that do not hash as their header said. Plain TCP
    authenticates nobody: the sender, or anyone on the path, may have changed them. Refused
    without a penalty, and the sender's payloads take the stream for NO_DIRECT_S, where a
    bad hash is its own (a tamperer on the path could otherwise get honest partners banned)."""


# After a payload over the data channel failed (its hash, or its sender's connection did
# not come within DIRECT_CONNECT_S), that sender's take the stream this long.
NO_DIRECT_S = 600.0
# Generous: a receiver that gives up on an honest sender (a loaded machine, either end)
# loses that round's payload; before, a firewalled port cost the whole SEND_TIMEOUT_S.
DIRECT_CONNECT_S = 30.0
# Senders kept in that map before the ones whose time has passed are forgotten.
MAX_NO_DIRECT = 256


def digest(data: bytes | bytearray | memoryview) -> bytes:
    # BLAKE3 hashes ≈7 GB/s on one core here (SHA-256 ≈1.8), more with its own threads for
    # big payloads: on a 2-3 GB/s link the hash must not halve the throughput.
    threads = blake3.blake3.AUTO if len(data) >= PARALLEL_HASH_NBYTES else 1
    return blake3.blake3(data, max_threads=threads).digest()


def _parse_specs(raw: object) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise BadMessage(f"'tensors' must be a list of at most {MAX_TENSORS}")
    specs: list[TensorSpec] = []
    names: set[str] = set()
    for item in raw:
        if not isinstance(item, dict):
            raise BadMessage("a tensor entry is not a map")
        name = wire.get_str(item, "name", max_len=200, pattern=NAME_PATTERN)
        dtype = wire.get_str(item, "dtype", max_len=16)
        if dtype not in ITEM_NBYTES:
            raise BadMessage(f"tensor {name}: unknown dtype {dtype!r}")
        shape = item.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)
        ):
            raise BadMessage(f"tensor {name}: bad shape")
        spec = TensorSpec(name, dtype, tuple(shape))
        if wire.get_int(item, "nbytes", lo=0, hi=1 << 50) != spec.nbytes:
            raise BadMessage(f"tensor {name}: nbytes does not match {dtype} × {tuple(shape)}")
        if name in names:
            raise BadMessage(f"tensor {name} appears twice")
        names.add(name)
        specs.append(spec)
    return tuple(specs)


def _refusal(reply: dict[str, object], peer_id: str) -> ProtocolError:
    reason = reply.get("reason")
    return ProtocolError(f"{peer_id} refused the tensors: {str(reason)[:200] if isinstance(reason, str) else '?'}")


async def send_tensors(
    host: TensorHostLike,
    peer_id: str,
    payload: Payload,
    *,
    timeout_s: float,
    direct: bool = True,
    limit: RateLimit = UNLIMITED,
) -> None:
    """Send ``payload`` to ``peer_id``; raises ``ProtocolError`` if it fails or is refused.

    ``direct``: offer the direct data channel (used only when the peer is reached directly,
    not through a relay, and it has one). ``limit``: the node's upload cap.
    """
    data = memoryview(payload.data).cast("B")
    if len(data) != sum(s.nbytes for s in payload.specs):
        raise ValueError("payload bytes do not match its specs")
    refusal = host.tensor_refusal(peer_id)
    if refusal is not None:
        raise ProtocolError(f"not sending tensors to {peer_id}: {refusal}")
    limit = host.tensor_limit(peer_id, limit)
    peer_ip = host.direct_ip(peer_id) if direct else None
    header = {
        "round": payload.round,
        "tensors": [
            {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "nbytes": s.nbytes} for s in payload.specs
        ],
        "nbytes": len(data),
        "blake3": digest(data),
        "channel": "direct" if peer_ip else "stream",
    }
    with trio.move_on_after(timeout_s) as scope:
        stream = await host.open_stream(peer_id, PROTOCOL_ID, timeout_s=timeout_s)
        try:
            await wire.send(stream, "tensors", VERSION, header)
            reply = await wire.receive(stream, msg_types=_REPLY, version=VERSION, max_nbytes=4096)
            if reply["t"] == "ack":
                raise _refusal(reply, peer_id)
            port = wire.get_int(reply, "port", lo=0, hi=65535)
            if port and peer_ip:
                token = wire.get_bytes(reply, "token", max_nbytes=64)
                # A receiver picks the port and the token: ours are an ephemeral port and 32
                # random bytes, never another service's port or a request of its making.
                if port < data_channel.MIN_PORT or len(token) != data_channel.TOKEN_NBYTES:
                    raise BadMessage(f"a go-ahead to port {port} with a {len(token)}-byte token")
                await data_channel.send(peer_ip, port, token, data, limit)
            else:
                for offset in range(0, len(data), CHUNK_NBYTES):
                    await limit.take(min(CHUNK_NBYTES, len(data) - offset))
                    await stream.write(bytes(data[offset : offset + CHUNK_NBYTES]))
            ack = await wire.receive(stream, msg_types=_ACK, version=VERSION, max_nbytes=4096)
        finally:
            await stream.close()
    if scope.cancelled_caught:
        raise ProtocolError(f"sending {len(data)} bytes to {peer_id} timed out after {timeout_s:g} s")
    if ack.get("ok") is not True:
        raise _refusal(ack, peer_id)


Accept = Callable[[str, Payload], Awaitable[None]]
"""Called with (peer id, payload) for every payload that passed the checks. The payload's
buffer is lent for the duration of the call (it is reused for a later transfer): copy what
you keep."""

Authorize = Callable[[str, int, int], str | None]
"""Called with (peer id, round, nbytes) once a header parsed, before anything is allocated:
None if we expect exactly this transfer from this peer now, else why not. A stranger's
header therefore costs us a few KiB, never the payload's size."""


def any_transfer(peer_id: str, round_index: int, nbytes: int) -> str | None:
    """An ``Authorize`` that expects everything within the size limit: for tests and benches
    between our own processes, never for a node on the network."""
    return None


# Free buffers kept per size: one payload per round from each of a few partners.
MAX_FREE_PER_SIZE = 4


class BufferPool:
    """Receive buffers reused across rounds.

    Every round brings payloads of the same size; allocating 256 MiB costs ≈120 ms here
    (zero-fill and page faults), as long as sending it over the direct channel.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self.allocated_nbytes = 0
        """Bytes of every buffer this pool ever allocated (not reused)."""

    def take(self, nbytes: int) -> bytearray:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.allocated_nbytes += nbytes
        return bytearray(nbytes)

    def give(self, buffer: bytearray) -> None:
        free = self._free.setdefault(len(buffer), [])
        if len(free) < MAX_FREE_PER_SIZE:
            free.append(buffer)


class _Lease:
    """At most one buffer taken from the pool for one transfer, and given back after it."""

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        self._buffer: bytearray | None = None

    def take(self, nbytes: int) -> bytearray:
        assert self._buffer is None
        self._buffer = self._pool.take(nbytes)
        return self._buffer

    def release(self) -> None:
        if self._buffer is not None:
            self._pool.give(self._buffer)
            self._buffer = None


class TensorReceiver:
    def __init__(
        self,
        host: TensorHostLike,
        accept: Accept,
        *,
        authorize: Authorize,
        max_payload_nbytes: int,
        timeout_s: float,
        channel: DataChannel | None = None,
    ) -> None:
        self._host = host
        self._accept = accept
        self._authorize = authorize
        self._receiving: set[str] = set()
        """Peers with a transfer under way: one at a time each."""
        self._max_payload_nbytes = max_payload_nbytes
        self._timeout_s = timeout_s
        self._channel = channel
        self.pool = BufferPool()
        self.num_refused = 0
        self.num_direct = 0
        self._no_direct = data_channel.Cooldowns(NO_DIRECT_S, max_peers=MAX_NO_DIRECT)
        """Senders whose payload over the data channel failed lately (its hash: ``Tampered``;
        or its connection did not come): theirs take the stream."""

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve, deadline_s=2 * self._timeout_s)

    async def _serve(self, stream: StreamLike) -> None:
        refusal = self._host.tensor_refusal(stream.peer_id)
        if refusal is not None:
            self.num_refused += 1
            await wire.send(stream, "ack", VERSION, {"ok": False, "reason": refusal})
            return
        if stream.peer_id in self._receiving:
            self.num_refused += 1
            await wire.send(stream, "ack", VERSION, {"ok": False, "reason": "a transfer from you is under way"})
            return
        self._receiving.add(stream.peer_id)
        lease = _Lease(self.pool)
        try:
            with trio.move_on_after(self._timeout_s) as scope:
                try:
                    payload = await self._receive(stream, lease)
                except (Unexpected, Tampered) as exc:
                    self.num_refused += 1
                    await wire.send(stream, "ack", VERSION, {"ok": False, "reason": str(exc)[:200]})
                    return
                except BadMessage as exc:
                    self.num_refused += 1
                    await self._host.punish(stream.peer_id, f"tensors: {exc}")
                    await wire.send(stream, "ack", VERSION, {"ok": False, "reason": str(exc)[:200]})
                    return
                await wire.send(stream, "ack", VERSION, {"ok": True, "reason": ""})
            if scope.cancelled_caught:
                raise StreamError(f"tensors from {stream.peer_id} took longer than {self._timeout_s:g} s")
            await self._accept(stream.peer_id, payload)
        finally:
            self._receiving.discard(stream.peer_id)
            lease.release()

    async def _receive(self, stream: StreamLike, lease: "_Lease") -> Payload:
        header = await wire.receive(
            stream, msg_types=frozenset({"tensors"}), version=VERSION, max_nbytes=MAX_HEADER_NBYTES
        )
        round_index = wire.get_int(header, "round", lo=0, hi=1 << 62)
        specs = _parse_specs(header.get("tensors"))
        nbytes = wire.get_int(header, "nbytes", lo=0, hi=self._max_payload_nbytes)
        if nbytes != sum(s.nbytes for s in specs):
            raise BadMessage(f"header says {nbytes} bytes but its tensors make {sum(s.nbytes for s in specs)}")
        expected = wire.get_bytes(header, "blake3", max_nbytes=HASH_NBYTES)
        channel = wire.get_str(header, "channel", max_len=8)
        if channel not in ("direct", "stream"):
            raise BadMessage(f"unknown channel {channel!r}")
        refusal = self._authorize(stream.peer_id, round_index, nbytes)
        if refusal is not None:
            raise Unexpected(f"not expecting {nbytes} bytes for round {round_index} from you: {refusal}")
        buffer = lease.take(nbytes)
        view = memoryview(buffer)
        # Behind a NAT nobody can open a connection to our data port: the bytes take the
        # stream; so they do where the channel failed with this sender lately, or is full.
        direct = (
            channel == "direct"
            and self._channel is not None
            and not self._host.private
            and stream.peer_id not in self._no_direct
            and self._channel.has_room(stream.peer_id)
        )
        if direct and self._channel is not None:
            token = self._channel.expect(view, stream.peer_id)
            try:
                await wire.send(stream, "go", VERSION, {"port": self._channel.port, "token": token})
                try:
                    await self._channel.wait(token, connect_timeout_s=DIRECT_CONNECT_S)
                except ProtocolError:  # unjudged (a firewall in front of our port, say)
                    self._no_direct.mark(stream.peer_id)
                    raise
            finally:
                self._channel.cancel(token)
            self.num_direct += 1
        else:
            await wire.send(stream, "go", VERSION, {"port": 0, "token": b""})
            await stream.read_into(view, chunk_nbytes=CHUNK_NBYTES)
        if digest(buffer) != expected:
            if direct:
                self._no_direct.mark(stream.peer_id)
                raise Tampered(
                    "payload over the data channel does not hash as its header said (the stream serves you now)"
                )
            raise BadMessage("payload hash does not match its header")
        return Payload(round_index, specs, buffer)
