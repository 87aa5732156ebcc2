"""Yjs update v1 written by hand, for hostile updates pycrdt would never produce (clock
gaps, cycles of origins): the format is protocol/runstate/crdt_check.py's docstring."""

import struct
from typing import Any

Id = tuple[int, int]
"""(client, clock)."""


def varuint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def string(text: str) -> bytes:
    data = text.encode()
    return varuint(len(data)) + data


def any_value(value: Any) -> bytes:
    if value is None:
        return b"\x7e"
    if value is True:
        return b"\x78"
    if value is False:
        return b"\x79"
    if isinstance(value, int | float):
        return b"\x7b" + struct.pack(">d", float(value))
    if isinstance(value, str):
        return b"\x77" + string(value)
    if isinstance(value, bytes | bytearray):
        return b"\x74" + varuint(len(value)) + bytes(value)
    if isinstance(value, dict):
        return b"\x76" + varuint(len(value)) + b"".join(string(k) + any_value(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return b"\x75" + varuint(len(value)) + b"".join(any_value(v) for v in value)
    raise TypeError(value)


def item(
    content: list[Any] | None,
    *,
    origin: Id | None = None,
    right_origin: Id | None = None,
    root: str | None = None,
    key: str | None = None,
    deleted: int = 0,
) -> bytes:
    """One struct: ``content`` (Any values), or a Deleted one of length ``deleted``; the
    parent written out (``root``, ``key``) when it has no origin."""
    kind = 1 if deleted else 8
    info = kind | (0x80 if origin else 0) | (0x40 if right_origin else 0) | (0x20 if key is not None else 0)
    out = bytes([info])
    for at in (origin, right_origin):
        if at:
            out += varuint(at[0]) + varuint(at[1])
    if not origin and not right_origin:
        assert root is not None
        out += varuint(1) + string(root) + (string(key) if key is not None else b"")
    if deleted:
        return out + varuint(deleted)
    assert content is not None
    return out + varuint(len(content)) + b"".join(any_value(v) for v in content)


def update(
    blocks: dict[int, tuple[int, list[bytes]]], deletes: dict[int, list[tuple[int, int]]] | None = None
) -> bytes:
    """``blocks``: client → (first clock, its structs); ``deletes``: client → [(clock, length)]."""
    out = varuint(len(blocks))
    for client, (clock, structs) in blocks.items():
        out += varuint(len(structs)) + varuint(client) + varuint(clock) + b"".join(structs)
    deletes = deletes or {}
    out += varuint(len(deletes))
    for client, ranges in deletes.items():
        out += varuint(client) + varuint(len(ranges)) + b"".join(varuint(c) + varuint(n) for c, n in ranges)
    return out


def entry_id(encoded: bytes, root: str, key: str) -> Id:
    """The id of the struct that wrote ``key`` under ``root`` in a document's encoding."""
    data, offset = encoded, 0

    def read() -> int:
        nonlocal offset
        value = shift = 0
        while True:
            byte = data[offset]
            offset += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    def text() -> str:
        nonlocal offset
        n = read()
        offset += n
        return data[offset - n : offset].decode()

    def skip_any() -> None:
        nonlocal offset
        tag = data[offset]
        offset += 1
        if tag in (124, 123):
            offset += 4 if tag == 124 else 8
        elif tag == 125:
            read()
        elif tag == 119:
            text()
        elif tag == 116:
            nbytes = read()  # read first: ``offset += read()`` would add to the offset before the read
            offset += nbytes
        elif tag == 118:
            for _ in range(read()):
                text()
                skip_any()
        elif tag == 117:
            for _ in range(read()):
                skip_any()

    for _ in range(read()):
        count, client, clock = read(), read(), read()
        for _ in range(count):
            info = data[offset]
            offset += 1
            kind = info & 0x1F
            if kind in (0, 10):
                clock += read()
                continue
            parent = name = None
            for flag in (0x80, 0x40):
                if info & flag:
                    read(), read()
            if not info & 0xC0:
                read()
                parent = text()
                name = text() if info & 0x20 else None
            length = read()
            if kind == 8:
                for _ in range(length):
                    skip_any()
            if (parent, name) == (root, key):
                return (client, clock)
            clock += length
    raise KeyError(f"{root}/{key}")
