"""A strict reader of CRDT updates and state vectors, before pycrdt ever sees a peer's bytes.

Why: yrs (the Rust core of pycrdt 0.14, yrs 0.28) trusts its input. Probed with hostile
updates (issue 12): clocks near 2³² wrap and panic; two blocks of one client at one
clock *segfault* the first read of the map (no exception to catch); a root written as an
Array hides content from every check; ten thousand chained items cost gigabytes; a GC
block under our own client id moves our clock back, so our next write reuses ids peers
already hold. A panic can be caught (protocol/runstate/state.py does); a segfault, a hang or the
OOM killer cannot. So updates are read here first, in Python, against an allowlist of
exactly what protocol/runstate/state.py writes, and anything else is a ``BadMessage``.

Update format (Yjs/yrs update v1, lib0 encoding; varuint = LEB128):

    update     := varuint n_clients, n_clients × client_block, delete_set
    client_block := varuint n_structs, varuint client, varuint clock, n_structs × struct
    struct     := info byte; info & 0x1f is the kind:
                  0 GC, 10 Skip: varuint length
                  1 Deleted, 8 Any: [origin id if info & 0x80] [right origin id if info & 0x40]
                                    [if neither: varuint 1 + root name string (parent),
                                     and the key string if info & 0x20]
                                    then content: Deleted = varuint length;
                                    Any = varuint count, count × any value
    delete_set := varuint n_clients, n_clients × (varuint client, varuint n_ranges,
                                                   n_ranges × (varuint clock, varuint length))
    any value  := tag byte: 126 null, 121 false, 120 true, 125 varint, 124 float32,
                  123 float64, 119 string, 118 map (count, count × (string, value)),
                  117 list (count, count × value), 116 bytes (varuint length, bytes)

Allowed: map entries (Deleted or Any content) of the roots "manifest", "members" and "leases",
GC and Skip blocks, delete sets. Refused: every other content kind (strings, nested
types, XML, formats, embeds, sub-documents, JSON), a parent given by id, a root entry
without a key (a sequence item), other roots, the Any values undefined and bigint,
nesting deeper than ``MAX_DEPTH``, clocks or lengths reaching ``MAX_CLOCK`` (yrs
clocks are u32), client ids above 2⁵³, two blocks or two delete-set entries of one
client, counts the data cannot hold, more than ``max_structs`` structs, trailing bytes,
and new structs under the reader's own client id (only it writes there).
"""

import bisect
from dataclasses import dataclass

from protocol.errors import BadMessage

ROOTS = frozenset({"manifest", "members", "leases"})
# yrs clocks are u32 and wrap silently near 2^32; no honest document comes near 2^31.
MAX_CLOCK = 1 << 31
# Yjs client ids are JavaScript-safe integers; yrs draws 53-bit ones.
MAX_CLIENT = (1 << 53) - 1
# Our deepest value is a member record: a map holding a list of strings.
MAX_DEPTH = 4
_ANY_FIXED = {126: 0, 121: 0, 120: 0, 124: 4, 123: 8}


@dataclass(frozen=True, slots=True)
class UpdateShape:
    """What an update that passed holds: counts the caller bounds, and each client's range."""

    num_structs: int
    clients: dict[int, tuple[int, int]]
    """client → (first clock, clock after the last struct)."""
    deleted: dict[int, list[tuple[int, int]]]
    """The delete set: client → its ranges (first clock, clock after the range), as written."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = bytes(data)  # indexing bytes gives ints: the reads below are the hot path of every sync
        self.offset = 0

    @property
    def left(self) -> int:
        return len(self._data) - self.offset

    def byte(self) -> int:
        if self.offset >= len(self._data):
            raise BadMessage("CRDT data ends early")
        value = self._data[self.offset]
        self.offset += 1
        return value

    def varuint(self) -> int:
        data, offset = self._data, self.offset
        end = min(len(data), offset + 10)
        value = shift = 0
        while offset < end:
            byte = data[offset]
            offset += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                self.offset = offset
                return value
            shift += 7
        if offset - self.offset < 10:
            raise BadMessage("CRDT data ends early")
        raise BadMessage("CRDT varint longer than 10 bytes")

    def skip(self, nbytes: int) -> bytes:
        if nbytes > self.left:
            raise BadMessage("CRDT data ends early")
        chunk = bytes(self._data[self.offset : self.offset + nbytes])
        self.offset += nbytes
        return chunk

    def string(self) -> str:
        raw = self.skip(self.varuint())
        try:
            return raw.decode("utf-8")  # strict: lone surrogates and bad UTF-8 are refused
        except UnicodeDecodeError as exc:
            raise BadMessage("CRDT string is not UTF-8") from exc

    def count(self, min_item_nbytes: int, what: str) -> int:
        """A count the rest of the data can hold (yrs reserves memory for it up front)."""
        value = self.varuint()
        if value * min_item_nbytes > self.left:
            raise BadMessage(f"CRDT {what} count {value} exceeds the {self.left} bytes left")
        return value


def _any(reader: _Reader, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise BadMessage("CRDT value nested too deep")
    tag = reader.byte()
    if tag in _ANY_FIXED:
        reader.skip(_ANY_FIXED[tag])
    elif tag == 125:
        reader.varuint()  # a signed varint has the same byte shape
    elif tag == 119:
        reader.string()
    elif tag == 116:
        reader.skip(reader.varuint())
    elif tag == 118:
        for _ in range(reader.count(2, "map entry")):
            reader.string()
            _any(reader, depth + 1)
    elif tag == 117:
        for _ in range(reader.count(1, "list item")):
            _any(reader, depth + 1)
    else:
        raise BadMessage(f"CRDT value of kind {tag} is not allowed")


def _clock_range(clock: int, length: int) -> int:
    if length < 1:
        raise BadMessage("CRDT struct of length 0")
    end = clock + length
    if end >= MAX_CLOCK:
        raise BadMessage("CRDT clock out of range")
    return end


def _struct(reader: _Reader) -> int:
    """One struct; returns its length in clock units."""
    info = reader.byte()
    kind = info & 0x1F
    if kind in (0, 10):  # GC, Skip
        return reader.varuint()
    if kind not in (1, 8):  # Deleted, Any
        raise BadMessage(f"CRDT content of kind {kind} is not allowed")
    if info & 0x80:  # origin
        reader.varuint(), reader.varuint()
    if info & 0x40:  # right origin
        reader.varuint(), reader.varuint()
    if not info & 0xC0:  # no origin: the parent is written out
        if reader.varuint() != 1:
            raise BadMessage("CRDT parent given by id (a nested type)")
        root = reader.string()
        if root not in ROOTS:
            raise BadMessage(f"CRDT root {root[:40]!r} is unknown")
        if not info & 0x20:
            raise BadMessage("CRDT entry without a key under a map root")
        reader.string()
    if kind == 1:
        return reader.varuint()
    length = reader.count(1, "value")
    for _ in range(length):
        _any(reader, 0)
    return length


def check_update(data: bytes, *, max_structs: int, own_client: int | None = None, own_clock: int = 0) -> UpdateShape:
    """``BadMessage`` unless ``data`` is an update of the allowed shape (see the docstring).

    ``own_client``/``own_clock``: the reader's client id and its clock; structs of that
    client past that clock are refused (a peer writing under our id would make our next
    writes collide with ids it holds).
    """
    reader = _Reader(data)
    clients: dict[int, tuple[int, int]] = {}
    num_structs = 0
    for _ in range(reader.count(3, "client")):
        n_structs, client, first = reader.count(1, "struct"), reader.varuint(), reader.varuint()
        if client > MAX_CLIENT:
            raise BadMessage("CRDT client id out of range")
        if client in clients:
            raise BadMessage("CRDT update holds two blocks of one client")
        num_structs += n_structs
        if num_structs > max_structs:
            raise BadMessage(f"CRDT update of more than {max_structs} structs")
        clock = first
        for _ in range(n_structs):
            clock = _clock_range(clock, _struct(reader))
        if client == own_client and clock > own_clock:
            raise BadMessage("CRDT update writes under our own client id")
        clients[client] = (first, clock)
    deleted: dict[int, list[tuple[int, int]]] = {}
    for _ in range(reader.count(2, "delete-set client")):
        client = reader.varuint()
        if client > MAX_CLIENT or client in deleted:
            raise BadMessage("CRDT delete set names a client twice or out of range")
        ranges = deleted[client] = []
        for _ in range(reader.count(2, "delete range")):
            start = reader.varuint()
            ranges.append((start, _clock_range(start, reader.varuint())))
    if reader.left:
        raise BadMessage(f"CRDT update followed by {reader.left} stray bytes")
    return UpdateShape(num_structs, clients, deleted)


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (first, end) sorted, with overlapping and adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covers(ours: dict[int, list[tuple[int, int]]], theirs: dict[int, list[tuple[int, int]]]) -> bool:
    """Whether every range of ``theirs`` lies inside one of ``ours`` (each client's ranges
    ``merged``): a delete set that deletes nothing we have not deleted."""
    for client, ranges in theirs.items():
        mine = ours.get(client, [])
        starts = [start for start, _ in mine]
        for start, end in ranges:
            at = bisect.bisect_right(starts, start) - 1
            if at < 0 or mine[at][1] < end:
                return False
    return True


def check_state_vector(data: bytes) -> dict[int, int]:
    """``BadMessage`` unless ``data`` is a well-formed state vector; returns client → clock."""
    reader = _Reader(data)
    vector: dict[int, int] = {}
    for _ in range(reader.count(2, "state vector entry")):
        client, clock = reader.varuint(), reader.varuint()
        if client > MAX_CLIENT or clock >= MAX_CLOCK or client in vector:
            raise BadMessage("CRDT state vector entry out of range or repeated")
        vector[client] = clock
    if reader.left:
        raise BadMessage(f"CRDT state vector followed by {reader.left} stray bytes")
    return vector
