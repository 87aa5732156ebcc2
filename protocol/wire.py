"""Wire conventions shared by every protocol: length-prefixed msgpack maps.

Frame: a 4-byte big-endian length, then that many bytes of msgpack encoding one map
``{"t": <message type>, "v": <version>, ...fields}``. Every size is checked before
anything is allocated, every field is type- and range-checked by the ``get_*`` helpers,
and any failure is a ``BadMessage`` (never a crash, never a half-applied message).
Nothing here unpickles: msgpack maps of plain values only.
"""

import contextlib
import re
from collections.abc import Mapping
from typing import Any, Protocol

import msgpack

from protocol.errors import BadMessage, ProtocolError, UnsupportedVersion

LENGTH_NBYTES = 4
# No message of ours comes near this; it bounds what a peer can make us buffer for one frame.
MAX_FRAME_NBYTES = 8 << 20


class ByteStream(Protocol):
    """What framing needs of a stream (protocol.net.host.Stream, or an in-memory fake in tests)."""

    async def read_exact(self, nbytes: int) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


def encode(msg_type: str, version: int, fields: Mapping[str, Any]) -> bytes:
    """Encode one message (without the length prefix)."""
    body = {"t": msg_type, "v": version, **fields}
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def decode(data: bytes, *, msg_types: frozenset[str], version: int) -> dict[str, Any]:
    """Decode one message, checking its type and version; ``BadMessage`` on anything else."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise BadMessage(f"undecodable message: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadMessage(f"message is a {type(obj).__name__}, not a map")
    msg_type = obj.get("t")
    if not isinstance(msg_type, str) or msg_type not in msg_types:
        raise BadMessage(f"unexpected message type {msg_type!r}")
    msg_version = obj.get("v")
    if not isinstance(msg_version, int) or isinstance(msg_version, bool):
        raise BadMessage(f"message version {msg_version!r} is not an integer")
    if msg_version != version:
        raise UnsupportedVersion(
            f"{msg_type} version {msg_version}, we speak {version}", theirs=msg_version, ours=version
        )
    return obj


def frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length."""
    if len(payload) > MAX_FRAME_NBYTES:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_NBYTES}")
    return len(payload).to_bytes(LENGTH_NBYTES, "big") + payload


async def read_frame(stream: ByteStream, *, max_nbytes: int) -> bytes:
    """Read one length-prefixed frame, refusing lengths over ``max_nbytes`` before reading."""
    nbytes = int.from_bytes(await stream.read_exact(LENGTH_NBYTES), "big")
    if nbytes > max_nbytes:
        raise BadMessage(f"frame of {nbytes} bytes exceeds the {max_nbytes}-byte limit")
    return await stream.read_exact(nbytes)


async def send(stream: ByteStream, msg_type: str, version: int, fields: Mapping[str, Any]) -> None:
    """Encode, frame and write one message."""
    await stream.write(frame(encode(msg_type, version, fields)))


async def receive(stream: ByteStream, *, msg_types: frozenset[str], version: int, max_nbytes: int) -> dict[str, Any]:
    """Read and decode one framed message."""
    return decode(await read_frame(stream, max_nbytes=max_nbytes), msg_types=msg_types, version=version)


async def refuse_version(stream: ByteStream, exc: UnsupportedVersion, what: str) -> None:
    """One clear answer to a peer of another version: an "error" in *its* version (so it can
    read it), naming both versions. Best effort: the peer may already be gone."""
    if exc.theirs is None or exc.ours is None:
        return
    reason = f"this node speaks {what} version {exc.ours}, you speak {exc.theirs}: run the same swarmtrain release"
    with contextlib.suppress(ProtocolError):
        await send(stream, "error", exc.theirs, {"reason": reason})


def get_str(msg: Mapping[str, Any], key: str, *, max_len: int, pattern: re.Pattern[str] | None = None) -> str:
    value = msg.get(key)
    if not isinstance(value, str):
        raise BadMessage(f"field {key!r} must be a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise BadMessage(f"field {key!r} is {len(value)} characters, limit {max_len}")
    if pattern is not None and not pattern.fullmatch(value):
        raise BadMessage(f"field {key!r} has an invalid value {value[:80]!r}")
    return value


def get_bytes(msg: Mapping[str, Any], key: str, *, max_nbytes: int) -> bytes:
    value = msg.get(key)
    if not isinstance(value, bytes):
        raise BadMessage(f"field {key!r} must be bytes, got {type(value).__name__}")
    if len(value) > max_nbytes:
        raise BadMessage(f"field {key!r} is {len(value)} bytes, limit {max_nbytes}")
    return value


def get_int(msg: Mapping[str, Any], key: str, *, lo: int, hi: int) -> int:
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadMessage(f"field {key!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadMessage(f"field {key!r} = {value} is outside [{lo}, {hi}]")
    return value


def get_str_list(msg: Mapping[str, Any], key: str, *, max_items: int, max_len: int) -> list[str]:
    value = msg.get(key)
    if not isinstance(value, list):
        raise BadMessage(f"field {key!r} must be a list, got {type(value).__name__}")
    if len(value) > max_items:
        raise BadMessage(f"field {key!r} has {len(value)} items, limit {max_items}")
    for item in value:
        if not isinstance(item, str) or len(item) > max_len:
            raise BadMessage(f"field {key!r} must hold strings of at most {max_len} characters")
    return list(value)


def get_count_map(msg: Mapping[str, Any], key: str, *, max_items: int, lo: int, hi: int) -> dict[str, int]:
    """A map of peer id (≤ 64 characters) → integer count in [lo, hi]."""
    value = msg.get(key)
    if not isinstance(value, dict):
        raise BadMessage(f"field {key!r} must be a map, got {type(value).__name__}")
    if len(value) > max_items:
        raise BadMessage(f"field {key!r} has {len(value)} entries, limit {max_items}")
    for peer_id, count in value.items():
        if not isinstance(peer_id, str) or len(peer_id) > 64:
            raise BadMessage(f"field {key!r} must be keyed by peer ids")
        if not isinstance(count, int) or isinstance(count, bool) or not lo <= count <= hi:
            raise BadMessage(f"field {key!r} must map peer ids to integers in [{lo}, {hi}]")
    return dict(value)
