"""The replicated state of one run: a pycrdt document holding its manifest and members.

    doc
    ├── "manifest"  Map: run_id, name, creator, created_at, version, and what the run
    │               trains: algorithm, model, steps_per_round, rounds, lr, batch_size,
    │               compression (node/training.py adopts them)
    └── "members"   Map: peer id → {peer_id, addrs, role, device, memory_nbytes, joined_at}

The manifest is written once, by the node that starts the run, and is immutable after that.
Each member writes its own record. Liveness (heartbeats) is not in the document: every
write leaves a tombstone, and heartbeats would grow it forever.

Remote updates are checked before they touch the document: the update is applied to a
scratch copy, the copy's content is validated, and only then is the update applied for
real. A garbage or hostile update therefore raises ``BadMessage`` and changes nothing.
"""

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import trio
from pycrdt import Doc, Map

from protocol.errors import BadMessage

PEER_ID_PATTERN = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")  # base58btc
RUN_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}-[0-9a-f]{6}")
ROOTS = ("manifest", "members")
# Training settings are names like "noloco" or "gpt-125m"; the node checks the values it supports.
SETTING_PATTERN = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
ROLES = frozenset({"trainer", "bootstrap", "observer"})
# Bounds that keep one run's document small enough to copy on every remote update.
MAX_MEMBERS = 4096
MAX_ADDRS = 16
MAX_ADDR_LEN = 256
MAX_DOC_NBYTES = 16 << 20
# 2**53: integers above this do not survive pycrdt's float conversion exactly.
MAX_SAFE_INT = 1 << 53


@dataclass(frozen=True, slots=True)
class Manifest:
    run_id: str
    name: str
    creator: str
    created_at: float
    algorithm: str = "none"
    """What every trainer of the run does: none (network only), noloco, diloco, local."""
    model: str = "tiny"
    steps_per_round: int = 50
    rounds: int = 20
    lr: float = 1e-3
    batch_size: int = 8
    compression: str = "none"
    version: int = 2


@dataclass(frozen=True, slots=True)
class MemberRecord:
    peer_id: str
    addrs: tuple[str, ...]
    role: str
    device: str
    memory_nbytes: int
    joined_at: float


def _read_varuint(data: bytes) -> int:
    value = 0
    for i, byte in enumerate(data[:10]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value
    raise BadMessage("malformed length prefix")


def _guard_count(data: bytes, min_item_nbytes: int, what: str) -> None:
    """Refuse a leading item count the data cannot possibly hold.

    pycrdt (yrs) reserves memory for the count an update or state vector declares before
    reading the items: 9 hostile bytes cost ≈500 MB and most of a second. Every item takes
    at least ``min_item_nbytes``, so a larger count is a lie we can refuse up front.
    """
    count = _read_varuint(data)
    _need(count * min_item_nbytes <= len(data), f"{what} declares {count} entries in {len(data)} bytes")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise BadMessage(what)


def _as_int(value: Any, what: str, *, lo: int = 0, hi: int = MAX_SAFE_INT) -> int:
    # pycrdt returns every number as a float; integers round-trip exactly below 2**53.
    _need(isinstance(value, int | float) and not isinstance(value, bool), f"{what} is not a number")
    _need(float(value).is_integer() and lo <= value <= hi, f"{what} is not an integer in [{lo}, {hi}]")
    return int(value)


def _as_float(value: Any, what: str, *, lo: float, hi: float) -> float:
    _need(isinstance(value, int | float) and not isinstance(value, bool), f"{what} is not a number")
    _need(lo < value <= hi, f"{what} is not in ({lo:g}, {hi:g}]")  # also refuses NaN
    return float(value)


def _as_time(value: Any, what: str) -> float:
    _need(isinstance(value, int | float) and not isinstance(value, bool), f"{what} is not a number")
    _need(0 <= value < 1e11, f"{what} is not a plausible unix time")
    return float(value)


def _as_str(value: Any, what: str, max_len: int, pattern: re.Pattern[str] | None = None) -> str:
    _need(isinstance(value, str) and len(value) <= max_len, f"{what} is not a string of at most {max_len}")
    _need(pattern is None or bool(pattern.fullmatch(value)), f"{what} has an invalid value")
    return str(value)


def parse_manifest(raw: dict[str, Any]) -> Manifest:
    _need(set(raw) == {f for f in Manifest.__slots__}, f"manifest has fields {sorted(raw)}")
    return Manifest(
        run_id=_as_str(raw["run_id"], "manifest.run_id", 64, RUN_ID_PATTERN),
        name=_as_str(raw["name"], "manifest.name", 64),
        creator=_as_str(raw["creator"], "manifest.creator", 64, PEER_ID_PATTERN),
        created_at=_as_time(raw["created_at"], "manifest.created_at"),
        algorithm=_as_str(raw["algorithm"], "manifest.algorithm", 32, SETTING_PATTERN),
        model=_as_str(raw["model"], "manifest.model", 32, SETTING_PATTERN),
        steps_per_round=_as_int(raw["steps_per_round"], "manifest.steps_per_round", lo=1, hi=1 << 20),
        rounds=_as_int(raw["rounds"], "manifest.rounds", lo=1, hi=1 << 30),
        lr=_as_float(raw["lr"], "manifest.lr", lo=0.0, hi=1.0),
        batch_size=_as_int(raw["batch_size"], "manifest.batch_size", lo=1, hi=1 << 16),
        compression=_as_str(raw["compression"], "manifest.compression", 32, SETTING_PATTERN),
        version=_as_int(raw["version"], "manifest.version"),
    )


def parse_member(key: str, raw: Any) -> MemberRecord:
    _need(isinstance(raw, dict), f"member {key[:64]!r} is not a map")
    _need(set(raw) == {f for f in MemberRecord.__slots__}, f"member {key[:64]!r} has fields {sorted(raw)[:10]}")
    peer_id = _as_str(raw["peer_id"], "member.peer_id", 64, PEER_ID_PATTERN)
    _need(peer_id == key, f"member record under {key[:64]!r} names {peer_id}")
    addrs = raw["addrs"]
    _need(isinstance(addrs, list) and len(addrs) <= MAX_ADDRS, "member.addrs is not a short list")
    role = _as_str(raw["role"], "member.role", 16)
    _need(role in ROLES, f"member.role {role!r} is unknown")
    return MemberRecord(
        peer_id=peer_id,
        addrs=tuple(_as_str(a, "member.addrs[]", MAX_ADDR_LEN) for a in addrs),
        role=role,
        device=_as_str(raw["device"], "member.device", 64),
        memory_nbytes=_as_int(raw["memory_nbytes"], "member.memory_nbytes"),
        joined_at=_as_time(raw["joined_at"], "member.joined_at"),
    )


def _read(doc: Doc[Any], run_id: str) -> tuple[Manifest | None, dict[str, MemberRecord]]:
    """Validate a whole document; ``BadMessage`` names the first thing wrong with it."""
    extra = sorted(set(doc.keys()) - set(ROOTS))
    _need(not extra, f"unknown top-level entries {extra[:5]}")
    raw_manifest = doc.get("manifest", type=Map).to_py() or {}
    raw_members = doc.get("members", type=Map).to_py() or {}
    _need(isinstance(raw_manifest, dict) and isinstance(raw_members, dict), "document roots have the wrong types")
    manifest = parse_manifest(raw_manifest) if raw_manifest else None
    _need(manifest is None or manifest.run_id == run_id, "manifest belongs to another run")
    _need(len(raw_members) <= MAX_MEMBERS, f"{len(raw_members)} members exceed {MAX_MEMBERS}")
    members = {key: parse_member(key, value) for key, value in raw_members.items()}
    return manifest, members


class RunState:
    """One run's document, its validated view, and a way to wait for changes."""

    def __init__(self, run_id: str) -> None:
        if not RUN_ID_PATTERN.fullmatch(run_id):
            raise ValueError(f"invalid run id {run_id!r}")
        self.run_id = run_id
        self._doc: Doc[Any] = Doc()
        self._manifest: Manifest | None = None
        self._members: dict[str, MemberRecord] = {}
        self._digest = self._compute_digest()
        self._changed = trio.Event()
        self.num_changes = 0

    # --- reading ---

    @property
    def manifest(self) -> Manifest | None:
        return self._manifest

    @property
    def members(self) -> dict[str, MemberRecord]:
        return dict(self._members)

    @property
    def digest(self) -> str:
        """A hash of the content; equal digests mean equal manifest and members."""
        return self._digest

    def state_vector(self) -> bytes:
        return bytes(self._doc.get_state())

    def encode(self) -> bytes:
        """The whole document as one update (what a newcomer or the save file needs)."""
        return bytes(self._doc.get_update())

    def diff(self, remote_state_vector: bytes) -> bytes:
        """What a peer with ``remote_state_vector`` lacks."""
        # Each entry is two varints (client id, clock): at least 2 bytes.
        _guard_count(remote_state_vector, 2, "state vector")
        try:
            return bytes(self._doc.get_update(remote_state_vector))
        except ValueError as exc:
            raise BadMessage(f"undecodable state vector: {exc}") from exc

    async def wait_changed(self) -> None:
        await self._changed.wait()

    @property
    def changed(self) -> trio.Event:
        """Set at the next change: take it before checking a condition, then wait on it."""
        return self._changed

    # --- writing ---

    def create_manifest(self, manifest: Manifest) -> bytes:
        """Write the manifest (only once); returns the update to push to peers."""
        if manifest.run_id != self.run_id:
            raise ValueError("manifest is for another run")
        if self._manifest is not None:
            raise ValueError(f"run {self.run_id} already has a manifest")
        return self._write("manifest", None, asdict(manifest))

    def put_member(self, record: MemberRecord) -> bytes:
        """Write our own membership record; returns the update to push to peers."""
        value = asdict(record)
        value["addrs"] = list(record.addrs)
        return self._write("members", record.peer_id, value)

    def apply_remote(self, update: bytes) -> bool:
        """Merge an update from a peer after validating the result; True if anything changed.

        Raises ``BadMessage`` (and leaves the document untouched) if the update is garbage,
        would make the document invalid, or would change the manifest.
        """
        _need(len(update) <= MAX_DOC_NBYTES, f"update of {len(update)} bytes is too large")
        # Each client block starts with three varints (struct count, client id, clock).
        _guard_count(update, 3, "update")
        scratch: Doc[Any] = Doc()
        try:
            scratch.apply_update(self._doc.get_update())
            scratch.apply_update(update)
        except ValueError as exc:
            raise BadMessage(f"undecodable CRDT update: {exc}") from exc
        manifest, members = _read(scratch, self.run_id)
        _need(self._manifest is None or manifest == self._manifest, "update would change the run manifest")
        _need(len(scratch.get_update()) <= MAX_DOC_NBYTES, "update would make the document too large")
        before = self._doc.get_state()
        self._doc.apply_update(update)
        if self._doc.get_state() == before and self._manifest == manifest and self._members == members:
            return False
        self._manifest, self._members = manifest, members
        self._note_change()
        return True

    def load(self, update: bytes) -> None:
        """Restore a saved document (same checks as a remote update)."""
        self.apply_remote(update)

    def _write(self, root: str, key: str | None, value: dict[str, Any]) -> bytes:
        before = self._doc.get_state()
        target = self._doc.get(root, type=Map)
        with self._doc.transaction():
            if key is None:
                for k, v in value.items():
                    target[k] = v
            else:
                target[key] = value
        self._manifest, self._members = _read(self._doc, self.run_id)
        self._note_change()
        return bytes(self._doc.get_update(before))

    def _note_change(self) -> None:
        self._digest = self._compute_digest()
        self.num_changes += 1
        self._changed.set()
        self._changed = trio.Event()

    def _compute_digest(self) -> str:
        content = {
            "manifest": asdict(self._manifest) if self._manifest else None,
            "members": {k: asdict(v) for k, v in sorted(self._members.items())},
        }
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()[:16]
