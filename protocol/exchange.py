"""Bulk tensors between two peers: a msgpack header, then the raw bytes, then an ack.

Protocol flow (``/swarmtrain/exchange/1.0.0``), one transfer per stream:

    sender                                                        receiver
    {t: "tensors", v: 1, round, tensors: [{name, dtype, shape, nbytes}],
     nbytes, sha256}                                 ───────────▶ checks every field and the
                                                                  total against its limit,
                                                                  then allocates once
    the tensors' bytes back to back, in header order ───────────▶ read into that buffer
                                                     ◀─────────── {t: "ack", v: 1, ok, reason}

The daemon never imports torch: tensors travel as named byte buffers with a dtype string
and a shape, and the worker turns them into tensors (and checks their values: NaN, Inf).
Here we check structure: known dtype, shape × itemsize = nbytes, sizes under the limits
before any allocation, and the SHA-256 of the payload against the header's. A payload
that fails any check is refused with a reason and never handed on.
"""

import hashlib
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from protocol import wire
from protocol.errors import BadMessage, ProtocolError, StreamError
from protocol.host import Host, Stream
from protocol.peers import PeerTable

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/exchange/1.0.0"
VERSION = 1
ITEM_NBYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
# A 125M-parameter model is ~150 tensors; MoE models have more, but not 10^5.
MAX_TENSORS = 100_000
MAX_DIMS = 8
MAX_HEADER_NBYTES = 16 << 20
# Reads of 1 MiB: large enough that per-read overhead vanishes, small enough to bound copies.
CHUNK_NBYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_NBYTES = 4 << 30
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


async def send_tensors(host: Host, peer_id: str, payload: Payload, *, timeout_s: float) -> None:
    """Send ``payload`` to ``peer_id``; raises ``ProtocolError`` if it fails or is refused."""
    data = memoryview(payload.data).cast("B")
    if len(data) != sum(s.nbytes for s in payload.specs):
        raise ValueError("payload bytes do not match its specs")
    header = {
        "round": payload.round,
        "tensors": [
            {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "nbytes": s.nbytes} for s in payload.specs
        ],
        "nbytes": len(data),
        "sha256": hashlib.sha256(data).digest(),
    }
    acks: list[dict[str, object]] = []
    with trio.move_on_after(timeout_s) as scope:
        stream = await host.open_stream(peer_id, PROTOCOL_ID, timeout_s=timeout_s)
        try:
            await wire.send(stream, "tensors", VERSION, header)
            async with trio.open_nursery() as nursery:

                async def read_ack() -> None:
                    acks.append(await wire.receive(stream, msg_types=_ACK, version=VERSION, max_nbytes=4096))
                    nursery.cancel_scope.cancel()  # an early refusal: stop writing what nobody reads

                nursery.start_soon(read_ack)
                for offset in range(0, len(data), CHUNK_NBYTES):
                    await stream.write(bytes(data[offset : offset + CHUNK_NBYTES]))
        finally:
            await stream.close()
    if scope.cancelled_caught:
        raise ProtocolError(f"sending {len(data)} bytes to {peer_id} timed out after {timeout_s:g} s")
    (ack,) = acks
    if ack.get("ok") is not True:
        reason = ack.get("reason") if isinstance(ack.get("reason"), str) else "no reason"
        raise ProtocolError(f"{peer_id} refused the tensors: {str(reason)[:200]}")


Accept = Callable[[str, Payload], Awaitable[None]]
"""Called with (peer id, payload) for every payload that passed the checks."""


class TensorReceiver:
    def __init__(
        self, host: Host, peers: PeerTable, accept: Accept, *, max_payload_nbytes: int, timeout_s: float
    ) -> None:
        self._host = host
        self._peers = peers
        self._accept = accept
        self._max_payload_nbytes = max_payload_nbytes
        self._timeout_s = timeout_s
        self.num_refused = 0

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve)

    async def _serve(self, stream: Stream) -> None:
        if self._peers.is_banned(stream.peer_id):
            await stream.reset()
            return
        with trio.move_on_after(self._timeout_s) as scope:
            try:
                payload = await self._receive(stream)
            except BadMessage as exc:
                # Refused: tell the sender why (it reads acks while writing, so it stops early)
                # and close; the payload is never handed on.
                self.num_refused += 1
                self._peers.penalize(stream.peer_id, f"tensors: {exc}")
                await wire.send(stream, "ack", VERSION, {"ok": False, "reason": str(exc)[:200]})
                return
            await wire.send(stream, "ack", VERSION, {"ok": True, "reason": ""})
        if scope.cancelled_caught:
            raise StreamError(f"tensors from {stream.peer_id} took longer than {self._timeout_s:g} s")
        await self._accept(stream.peer_id, payload)

    async def _receive(self, stream: Stream) -> Payload:
        header = await wire.receive(
            stream, msg_types=frozenset({"tensors"}), version=VERSION, max_nbytes=MAX_HEADER_NBYTES
        )
        round_index = wire.get_int(header, "round", lo=0, hi=1 << 62)
        specs = _parse_specs(header.get("tensors"))
        nbytes = wire.get_int(header, "nbytes", lo=0, hi=self._max_payload_nbytes)
        if nbytes != sum(s.nbytes for s in specs):
            raise BadMessage(f"header says {nbytes} bytes but its tensors make {sum(s.nbytes for s in specs)}")
        digest = wire.get_bytes(header, "sha256", max_nbytes=32)
        buffer = bytearray(nbytes)
        await stream.read_into(memoryview(buffer), chunk_nbytes=CHUNK_NBYTES)
        if hashlib.sha256(buffer).digest() != digest:
            raise BadMessage("payload hash does not match its header")
        return Payload(round_index, specs, buffer)
