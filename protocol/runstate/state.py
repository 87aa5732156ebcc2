"""The replicated state of one run: a pycrdt document of signed records.

    doc
    ├── "manifest"  Map: run_id, name, creator, created_at, version, settings: what the
    │               run trains (training/settings.py's bytes, opaque here: node/training.py
    │               decodes and adopts them), and sig: the creator's
    ├── "members"   Map: peer id → {peer_id, addrs, role, device, memory_nbytes, joined_at,
    │               seq, sig}: each record signed by the peer it describes
    └── "leases"    Map: expert index → {expert, owner, epoch, round, sig}: who trains an
                    expert of a mixture-of-experts run (SPES, node/algorithms/spes/leases.py),
                    signed by that owner: a claim, written when the lease rule gives it the expert

Trust rules (peers are strangers; protocol/keys.py checks a signature from the peer id):
- **Signed records.** The manifest is signed by its creator and never changes; a member
  record is signed by its member. A record whose signature fails makes the update that
  carries it invalid (``BadMessage``: the sender is penalized). Anyone may *relay* a
  record, since only its author could have made it.
- **Newer replaces older, per author.** Our view of the members (``members``) keeps, for
  each author, the record with the highest ``seq`` we ever saw. A replayed older record, or
  a delete, may reach the document (a CRDT merge cannot refuse part of an update, and
  refusing the whole one would make honest relayers look guilty: nodes banned each other
  that way) but it changes nothing in the view, and ``stale`` names the authors whose
  document entry fell behind our view, so the node writes their newest record back
  (``restore``; the run service does it for live members and for itself).
- **Admission**: keys are free, so a stranger can fill the document with valid records of
  made-up members. Nothing is refused for their number (a cap on the count would make the
  same update valid at one node and invalid at another). Instead each node evicts the
  silent oldest once the document holds more than ``MAX_MEMBERS`` records (``evict``,
  run by protocol/runstate/run.py: members we have not heard from, oldest ``seq`` first; never
  ourselves, never a live one); what counts for training is a member that is also live
  (node/training.py), and a record evicted comes back only with a newer signature. A hard
  byte cap (``MAX_DOC_NBYTES``) bounds memory; an update past it is refused without a
  penalty (``Overfull``), since an honest relayer may be the one that hits it.
- **Validated on a scratch copy.** A remote update is applied to a copy first; the copy is
  checked whole (known roots only, each a Map, every record's fields, types, sizes and
  signature); only then does the copy become our document. pycrdt (yrs) can panic on
  hostile bytes, and its ``PanicException`` is a ``BaseException``: every call that sees a
  peer's bytes is wrapped (``_crdt``) and a panic is a ``BadMessage`` like any other.

- **Leases, best per expert.** A lease is its owner's signed claim on an expert at an
  epoch. Our view keeps, per expert, the best claim we ever saw: the higher epoch, and at
  one epoch the lower ``lease_rank`` (a hash, so no peer always wins a tie); a replayed or
  deleted claim changes nothing in the view and is written back like a member record
  (``stale_leases``, ``restore_leases``). Whether a claim's owner may train the expert is
  the algorithm's rule, not the document's (node/algorithms/spes/leases.py). The view also
  keeps each expert's best claim per owner (``LEASE_OWNERS_KEPT`` of them), so a node that
  banned an owner can fall back to the best claim of someone else (``leases_apart_from``)
  instead of fighting a banned peer's claims.

Liveness (heartbeats) is not in the document: every write leaves a tombstone.
"""

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypeVar

import trio
from pycrdt import Doc, Map

from protocol import keys
from protocol.errors import BadMessage, ProtocolError, UnsupportedVersion
from protocol.net.guard import FATAL
from protocol.runstate import crdt_check

PEER_ID_PATTERN = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")  # base58btc
RUN_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}-[0-9a-f]{6}")
ROOTS = ("manifest", "members", "leases")
# The run's settings are a few hundred bytes (training/settings.py checks what they say).
MAX_SETTINGS_NBYTES = 4096
ROLES = frozenset({"trainer", "bootstrap", "observer"})
# Over this many member records, each node evicts the silent oldest (see the docstring).
MAX_MEMBERS = 1024
MAX_ADDRS = 16
MAX_ADDR_LEN = 256
# A record is ≈ 400 bytes: 2 MiB holds five times MAX_MEMBERS, and the whole document still
# fits one sync frame (protocol/wire.py: 8 MiB) when a newcomer asks for all of it.
MAX_DOC_NBYTES = 2 << 20
# Structs in one update: a newcomer's whole document (each member's record and the history
# of its rewrites) fits; ten thousand chained items cost yrs seconds and gigabytes.
MAX_UPDATE_STRUCTS = 4 * MAX_MEMBERS + 256
# 2**53: integers above this do not survive pycrdt's float conversion exactly.
MAX_SAFE_INT = 1 << 53
FORMAT_VERSION = 5
"""Of this document's layout: 3 = signed manifest and member records (seq, sig);
4 = the manifest's settings as one blob (every setting of training/settings.py);
5 = expert leases (SPES)."""
MANIFEST_DOMAIN = "swarmtrain/manifest/4"
MEMBER_DOMAIN = "swarmtrain/member/3"
LEASE_DOMAIN = "swarmtrain/lease/1"
# Leases are keyed by expert index: a document holds at most this many (a stranger's
# claims on made-up experts cost ≈ 150 bytes each, well inside MAX_DOC_NBYTES).
MAX_EXPERTS = 1024
# Epochs only grow by one per hand-over; this leaves room for any honest run and keeps
# every value exact through pycrdt's floats.
MAX_EPOCH = 1 << 40
DIGEST_MODULUS = 1 << 256
# Per expert, the view keeps the best claim of this many owners (the best ones): enough
# for the hand-overs of any honest run; a stranger's many keys push out only old claims.
LEASE_OWNERS_KEPT = 16
T = TypeVar("T")
# A panic in yrs prints a backtrace when this is 1: 4 KiB of stderr and ≈1 ms per hostile
# update, a log flood a stranger controls. Read by Rust at the first panic: set it now.
os.environ["RUST_BACKTRACE"] = "0"


class Overfull(ProtocolError):
    """A valid update we cannot take: the document would pass its byte cap. Not the
    sender's fault (it may only relay), so not penalized (protocol/net/guard.py)."""


@dataclass(frozen=True, slots=True)
class Manifest:
    run_id: str
    name: str
    creator: str
    created_at: float
    settings: bytes = b""
    """What every trainer of the run does: training/settings.py's ``encode()``; empty: the
    run trains nothing."""
    version: int = FORMAT_VERSION

    def signed_fields(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True, slots=True)
class MemberRecord:
    peer_id: str
    addrs: tuple[str, ...]
    role: str
    device: str
    memory_nbytes: int
    joined_at: float
    seq: int = 0
    """The author's version of its record: a higher one replaces a lower one."""
    sig: bytes = b""
    """The author's signature over every other field and the run id."""

    def signed_fields(self, run_id: str) -> list[Any]:
        return [
            run_id,
            self.peer_id,
            list(self.addrs),
            self.role,
            self.device,
            self.memory_nbytes,
            self.joined_at,
            self.seq,
        ]

    def newer_than(self, other: "MemberRecord | None") -> bool:
        return other is None or self.seq > other.seq


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    expert: int
    owner: str
    epoch: int
    """One more than the epoch of the claim it replaces (1 for an expert's first)."""
    round: int
    """The owner's round when it claimed the expert."""
    sig: bytes = b""

    def signed_fields(self, run_id: str) -> list[Any]:
        return [run_id, self.expert, self.owner, self.epoch, self.round]


def lease_rank(run_id: str, record: LeaseRecord) -> bytes:
    """Ties at one epoch go to the lowest rank: a hash, so which peer wins varies."""
    material = json.dumps([run_id, record.expert, record.epoch, record.owner]).encode()
    return hashlib.sha256(material).digest()


def better_lease(run_id: str, record: LeaseRecord, other: LeaseRecord | None) -> bool:
    """Whether ``record`` replaces ``other`` for its expert: a higher epoch, or the lower rank at one."""
    if other is None:
        return True
    if record.epoch != other.epoch:
        return record.epoch > other.epoch
    return lease_rank(run_id, record) < lease_rank(run_id, other)


def sign_lease(record: LeaseRecord, seed: bytes, run_id: str) -> LeaseRecord:
    """``record`` signed with the node key ``seed`` (which must be the record's owner)."""
    if keys.peer_id_of(seed) != record.owner:
        raise ValueError("a lease is signed by its owner")
    unsigned = replace(record, sig=b"")
    return replace(unsigned, sig=keys.sign(seed, LEASE_DOMAIN, unsigned.signed_fields(run_id)))


def sign_member(record: MemberRecord, seed: bytes, run_id: str) -> MemberRecord:
    """``record`` signed with the node key ``seed`` (which must be the record's peer)."""
    if keys.peer_id_of(seed) != record.peer_id:
        raise ValueError("a member record is signed by the member it describes")
    unsigned = replace(record, sig=b"")
    return replace(unsigned, sig=keys.sign(seed, MEMBER_DOMAIN, unsigned.signed_fields(run_id)))


def _crdt(what: str, call: Callable[[], T]) -> T:
    """Call into pycrdt with a peer's bytes: whatever it raises, a native panic included
    (pycrdt's ``PanicException`` is a ``BaseException``), becomes ``BadMessage``; our own
    ``BadMessage`` verdicts pass unchanged."""
    try:
        return call()
    except (BadMessage, *FATAL):
        raise
    except BaseException as exc:  # the boundary with a native library
        raise BadMessage(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from exc


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


def _as_bytes(value: Any, what: str, max_len: int) -> bytes:
    _need(isinstance(value, bytes | bytearray) and len(value) <= max_len, f"{what} is not bytes of <= {max_len}")
    return bytes(value)


def _as_sig(value: Any, what: str) -> bytes:
    _need(isinstance(value, bytes | bytearray) and len(value) == keys.SIGNATURE_NBYTES, f"{what} is not a signature")
    return bytes(value)


def parse_manifest(raw: dict[str, Any]) -> Manifest:
    """A manifest from the document, its creator's signature checked."""
    version = raw.get("version")
    if version != FORMAT_VERSION:
        shown = int(version) if isinstance(version, float) and version.is_integer() else repr(version)[:20]
        raise UnsupportedVersion(f"the run's document is of format {shown}; this node reads format {FORMAT_VERSION}")
    expected = {f.name for f in fields(Manifest)} | {"sig"}
    _need(set(raw) == expected, f"manifest has fields {sorted(raw)[:20]}")
    manifest = Manifest(
        run_id=_as_str(raw["run_id"], "manifest.run_id", 64, RUN_ID_PATTERN),
        name=_as_str(raw["name"], "manifest.name", 64),
        creator=_as_str(raw["creator"], "manifest.creator", 64, PEER_ID_PATTERN),
        created_at=_as_time(raw["created_at"], "manifest.created_at"),
        settings=_as_bytes(raw["settings"], "manifest.settings", MAX_SETTINGS_NBYTES),
        version=_as_int(raw["version"], "manifest.version"),
    )
    keys.verify(manifest.creator, _as_sig(raw["sig"], "manifest.sig"), MANIFEST_DOMAIN, manifest.signed_fields())
    return manifest


def parse_member(key: str, raw: Any, run_id: str) -> MemberRecord:
    """A member record from the document, its author's signature checked."""
    _need(isinstance(raw, dict), f"member {key[:64]!r} is not a map")
    expected = {f.name for f in fields(MemberRecord)}
    _need(set(raw) == expected, f"member {key[:64]!r} has fields {sorted(raw)[:10]}")
    peer_id = _as_str(raw["peer_id"], "member.peer_id", 64, PEER_ID_PATTERN)
    _need(peer_id == key, f"member record under {key[:64]!r} names {peer_id}")
    addrs = raw["addrs"]
    _need(isinstance(addrs, list) and len(addrs) <= MAX_ADDRS, "member.addrs is not a short list")
    role = _as_str(raw["role"], "member.role", 16)
    _need(role in ROLES, f"member.role {role!r} is unknown")
    record = MemberRecord(
        peer_id=peer_id,
        addrs=tuple(_as_str(a, "member.addrs[]", MAX_ADDR_LEN) for a in addrs),
        role=role,
        device=_as_str(raw["device"], "member.device", 64),
        memory_nbytes=_as_int(raw["memory_nbytes"], "member.memory_nbytes"),
        joined_at=_as_time(raw["joined_at"], "member.joined_at"),
        seq=_as_int(raw["seq"], "member.seq"),
        sig=_as_sig(raw["sig"], "member.sig"),
    )
    keys.verify(peer_id, record.sig, MEMBER_DOMAIN, record.signed_fields(run_id))
    return record


def parse_lease(key: str, raw: Any, run_id: str) -> LeaseRecord:
    """A lease from the document, its owner's signature checked."""
    _need(isinstance(raw, dict), f"lease {key[:16]!r} is not a map")
    expected = {f.name for f in fields(LeaseRecord)}
    _need(set(raw) == expected, f"lease {key[:16]!r} has fields {sorted(raw)[:10]}")
    expert = _as_int(raw["expert"], "lease.expert", hi=MAX_EXPERTS - 1)
    _need(key == str(expert), f"lease under {key[:16]!r} is for expert {expert}")
    record = LeaseRecord(
        expert=expert,
        owner=_as_str(raw["owner"], "lease.owner", 64, PEER_ID_PATTERN),
        epoch=_as_int(raw["epoch"], "lease.epoch", lo=1, hi=MAX_EPOCH),
        round=_as_int(raw["round"], "lease.round"),
        sig=_as_sig(raw["sig"], "lease.sig"),
    )
    keys.verify(record.owner, record.sig, LEASE_DOMAIN, record.signed_fields(run_id))
    return record


def _root_names(doc: Doc[Any]) -> list[str]:
    """The document's roots, sorted; ``BadMessage`` if one is not ours."""
    names = sorted(doc.keys())
    extra = [n for n in names if n not in ROOTS]
    _need(not extra, f"unknown top-level entries {extra[:5]}")
    return names


def _root_maps(doc: Doc[Any]) -> dict[str, Any]:
    """Each known root's content; ``BadMessage`` for an unknown root or one of another type.

    A root written as an Array or Text where we expect a Map would otherwise hide content
    from the checks below (and grow the document past every count we make).
    """
    content: dict[str, Any] = {}
    for name in _root_names(doc):
        value = doc.get(name, type=Map).to_py()
        _need(isinstance(value, dict), f"document root {name!r} is not a map")
        content[name] = value
    return content


@dataclass(frozen=True, slots=True)
class Content:
    """What a valid document holds."""

    manifest: Manifest | None
    members: dict[str, MemberRecord]
    leases: dict[int, LeaseRecord]


def _observe_keys(doc: Doc[Any]) -> tuple[dict[str, set[str]], Callable[[], None]]:
    """Which keys of each root map change from now on (and a call that stops watching)."""
    touched: dict[str, set[str]] = {}
    watched = []

    def noting(root: str) -> Callable[[Any], None]:
        def note(event: Any) -> None:  # one parameter: pycrdt passes the transaction to two
            touched.setdefault(root, set()).update(event.keys)

        return note

    for root in sorted(ROOTS):
        target = doc.get(root, type=Map)
        watched.append((target, target.observe(noting(root))))

    def stop() -> None:
        for target, subscription in watched:
            target.unobserve(subscription)

    return touched, stop


def _read_changed(doc: Doc[Any], run_id: str, base: Content, touched: dict[str, set[str]]) -> Content:
    """``base`` (the content ``doc`` held) with the entries of ``touched`` read again from
    ``doc``: ``_read``'s checks on what changed, not on every record."""
    _root_names(doc)
    manifest = base.manifest
    if touched.get("manifest"):
        raw_manifest = doc.get("manifest", type=Map).to_py() or {}
        manifest = parse_manifest(raw_manifest) if raw_manifest else None
        _need(manifest is None or manifest.run_id == run_id, "manifest belongs to another run")
    members = base.members
    if touched.get("members"):
        members, target = dict(members), doc.get("members", type=Map)
        for key in touched["members"]:
            if key in target:
                members[key] = parse_member(key, target[key], run_id)
            else:
                members.pop(key, None)
    leases = base.leases
    if touched.get("leases"):
        target = doc.get("leases", type=Map)
        _need(len(target) <= MAX_EXPERTS, f"more than {MAX_EXPERTS} leases")
        by_key = {str(expert): lease for expert, lease in leases.items()}
        for key in touched["leases"]:
            if key in target:
                by_key[key] = parse_lease(key, target[key], run_id)
            else:
                by_key.pop(key, None)
        leases = {lease.expert: lease for lease in by_key.values()}
    return Content(manifest, members, leases)


def _past_clock(encoded: bytes, state: dict[int, int]) -> bool:
    """Whether a document's encoding holds structs past its state vector (items yrs holds
    beyond a clock gap, or waiting for what they depend on)."""
    try:
        shape = crdt_check.check_update(encoded, max_structs=crdt_check.MAX_CLOCK)
    except BadMessage:
        return True
    return any(end > state.get(c, 0) for c, (_, end) in shape.clients.items())


def _num_entries(doc: Doc[Any], root: str) -> int:
    return len(doc.get(root, type=Map))


def _read(doc: Doc[Any], run_id: str) -> Content:
    """Validate a whole document; ``BadMessage`` names the first thing wrong with it."""
    content = _crdt("unreadable document", lambda: _root_maps(doc))
    raw_manifest = content.get("manifest") or {}
    raw_members = content.get("members") or {}
    raw_leases = content.get("leases") or {}
    manifest = parse_manifest(raw_manifest) if raw_manifest else None
    _need(manifest is None or manifest.run_id == run_id, "manifest belongs to another run")
    members = {key: parse_member(key, value, run_id) for key, value in raw_members.items()}
    _need(len(raw_leases) <= MAX_EXPERTS, f"more than {MAX_EXPERTS} leases")
    leases = [parse_lease(key, value, run_id) for key, value in raw_leases.items()]
    return Content(manifest, members, {lease.expert: lease for lease in leases})


class RunState:
    """One run's document, its validated view, and a way to wait for changes."""

    def __init__(self, run_id: str) -> None:
        if not RUN_ID_PATTERN.fullmatch(run_id):
            raise ValueError(f"invalid run id {run_id!r}")
        self.run_id = run_id
        self._doc: Doc[Any] = Doc()
        self._good = bytes(self._doc.get_update())
        """The document's last checked encoding: each remote update starts from it."""
        self._gapped = False
        """Our document holds items past a clock gap: remote updates are read whole."""
        self._state_in: bytes | None = None
        self._state: dict[int, int] = {}
        """``_own_state``'s cache: the state vector when ``_good`` was ``_state_in``."""
        self._deleted_in: bytes | None = None
        self._deleted_ranges: dict[int, list[tuple[int, int]]] = {}
        """``_deleted``'s cache: the delete set of ``_deleted_in`` (``_good`` when it was read)."""
        self._manifest: Manifest | None = None
        self._in_doc: dict[str, MemberRecord] = {}
        """The member records the document shows now."""
        self._members: dict[str, MemberRecord] = {}
        """Our view: per author, the newest record we ever saw (minus evicted ones)."""
        self._leases_in_doc: dict[int, LeaseRecord] = {}
        self._leases: dict[int, LeaseRecord] = {}
        """Our view: per expert, the best claim we ever saw (``better_lease``)."""
        self._claims: dict[int, dict[str, LeaseRecord]] = {}
        """Per expert, the best claim we saw of each owner (the best ``LEASE_OWNERS_KEPT``)."""
        self._entry_hashes: dict[tuple[str, str], int] = {}
        """Each document entry's hash (``_compute_digest``)."""
        self._entry_sum = 0
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
    def num_members(self) -> int:
        """How many records ``members`` holds (without its copy)."""
        return len(self._members)

    def has_member(self, peer_id: str) -> bool:
        """Whether our view holds a record of ``peer_id`` (``members`` without its copy)."""
        return peer_id in self._members

    @property
    def leases(self) -> dict[int, LeaseRecord]:
        return dict(self._leases)

    def leases_apart_from(self, excluded: Callable[[str], bool]) -> dict[int, LeaseRecord]:
        """Per expert, the best claim we saw whose owner is not ``excluded`` (a peer we
        banned): what the view would be had its claims never come."""
        view = {}
        for expert in self._leases:
            lease = self.lease_apart_from(expert, excluded)
            if lease is not None:
                view[expert] = lease
        return view

    def lease_apart_from(self, expert: int, excluded: Callable[[str], bool]) -> LeaseRecord | None:
        """``leases_apart_from`` for one expert."""
        lease = self._leases.get(expert)
        if lease is None or not excluded(lease.owner):
            return lease  # the best of all is the best of the others too
        best = None
        for other in self._claims.get(expert, {}).values():
            if not excluded(other.owner) and better_lease(self.run_id, other, best):
                best = other
        return best

    @property
    def digest(self) -> str:
        """A hash of the document's content (manifest and member records): equal digests
        mean nothing to pull. The view (``members``) may hold more (see ``stale``)."""
        return self._digest

    def stale(self) -> list[str]:
        """Authors whose record in the document is older than ours, or gone from it."""
        return sorted(p for p, r in self._members.items() if r.newer_than(self._in_doc.get(p)))

    def stale_leases(self) -> list[int]:
        """Experts whose claim in the document is worse than our view's, or gone from it."""
        return sorted(e for e, r in self._leases.items() if r != self._leases_in_doc.get(e))

    def state_vector(self) -> bytes:
        return bytes(self._doc.get_state())

    def encode(self) -> bytes:
        """The whole document as one update (what a newcomer or the save file needs)."""
        return self._good

    def diff(self, remote_state_vector: bytes) -> bytes:
        """What a peer with ``remote_state_vector`` lacks."""
        crdt_check.check_state_vector(remote_state_vector)
        return bytes(_crdt("undecodable state vector", lambda: self._doc.get_update(remote_state_vector)))

    async def wait_changed(self) -> None:
        await self._changed.wait()

    @property
    def changed(self) -> trio.Event:
        """Set at the next change: take it before checking a condition, then wait on it."""
        return self._changed

    # --- writing (each returns the update to push to peers) ---

    def create_manifest(self, manifest: Manifest, seed: bytes) -> bytes:
        """Write the manifest, signed by its creator's key ``seed`` (only once)."""
        if manifest.run_id != self.run_id:
            raise ValueError("manifest is for another run")
        if keys.peer_id_of(seed) != manifest.creator:
            raise ValueError("a manifest is signed by its creator")
        if self._manifest is not None:
            raise ValueError(f"run {self.run_id} already has a manifest")
        value = {**asdict(manifest), "sig": keys.sign(seed, MANIFEST_DOMAIN, manifest.signed_fields())}
        return self._write("manifest", [(k, v) for k, v in value.items()])

    def put_member(self, record: MemberRecord) -> bytes:
        """Write a signed member record (``sign_member``) newer than the one we hold."""
        keys.verify(record.peer_id, record.sig, MEMBER_DOMAIN, record.signed_fields(self.run_id))
        if not record.newer_than(self._members.get(record.peer_id)):
            raise ValueError(f"{record.peer_id} already has a record of seq ≥ {record.seq}")
        return self._write("members", [(record.peer_id, _member_value(record))])

    def restore(self, peer_ids: Iterable[str]) -> bytes:
        """Write our newest record of each of ``peer_ids`` back into the document (those
        ``stale`` named: a delete or a replay took them back); b"" if none needed it."""
        todo = [p for p in peer_ids if p in self._members and self._members[p].newer_than(self._in_doc.get(p))]
        return self._write("members", [(p, _member_value(self._members[p])) for p in todo]) if todo else b""

    def put_lease(self, record: LeaseRecord) -> bytes:
        """Write our signed claim (``sign_lease``); it must beat the view's claim on its expert."""
        keys.verify(record.owner, record.sig, LEASE_DOMAIN, record.signed_fields(self.run_id))
        if not 0 <= record.expert < MAX_EXPERTS or not 1 <= record.epoch <= MAX_EPOCH:
            raise ValueError(f"lease on expert {record.expert} at epoch {record.epoch} is out of range")
        if not better_lease(self.run_id, record, self._leases.get(record.expert)):
            raise ValueError(f"expert {record.expert} already has a lease as good as epoch {record.epoch}")
        return self._write("leases", [(str(record.expert), asdict(record))])

    def restore_leases(self, experts: Iterable[int]) -> bytes:
        """Write our view's claim on each of ``experts`` back (those ``stale_leases`` named)."""
        todo = [e for e in experts if e in self._leases and self._leases[e] != self._leases_in_doc.get(e)]
        return self._write("leases", [(str(e), asdict(self._leases[e])) for e in todo]) if todo else b""

    def evict(self, peer_ids: Iterable[str]) -> bytes:
        """Remove records from the document and our view (the silent oldest, past
        ``MAX_MEMBERS``); an evicted member comes back with a newer record."""
        todo = [p for p in peer_ids if p in self._members or p in self._in_doc]
        for peer_id in todo:
            self._members.pop(peer_id, None)
        return self._write("members", [(p, None) for p in todo]) if todo else b""

    def apply_remote(self, update: bytes) -> bool:
        """Merge an update from a peer after validating the result; True if anything changed.

        Raises ``BadMessage`` (and leaves the document untouched) if the update is garbage,
        would make the document invalid, or would change the manifest; ``Overfull`` if the
        document would pass its byte cap.
        """
        _need(len(update) <= MAX_DOC_NBYTES, f"update of {len(update)} bytes is too large")
        ours = self._own_state()
        client_id = self._doc.client_id
        shape = crdt_check.check_update(
            update, max_structs=MAX_UPDATE_STRUCTS, own_client=client_id, own_clock=ours.get(client_id, 0)
        )
        if all(end <= ours.get(c, 0) for c, (_, end) in shape.clients.items()) and crdt_check.covers(
            self._deleted(), shape.deleted
        ):
            # Every struct is one we hold, every deletion one we made: nothing new (most
            # pulls and pushed updates of a settled run). Not decoded, not copied, not read.
            return False
        before = Content(self._manifest, self._in_doc, self._leases_in_doc)
        # Only the entries the update changes are read again (the rest passed when they came):
        # a change costs its own records, not the document's (O(N) a change at N members).
        # Not where yrs may integrate an item past a clock gap (no event then names its key
        # again, its later deletion included): an update that starts past our clock, or a
        # document holding such items. Nor where watching made pycrdt panic (seen on states
        # hostile updates built): then the update is applied again, unwatched.
        gapless = not self._gapped and all(first <= ours.get(c, 0) for c, (first, _) in shape.clients.items())
        scratch, touched = self._merged(update, client_id, watched=gapless)
        theirs = crdt_check.check_state_vector(bytes(_crdt("unreadable state", scratch.get_state)))
        _need(all(theirs.get(c, 0) >= clock for c, clock in ours.items()), "update would move a clock back")
        content = _crdt(
            "unreadable document",
            lambda: (
                _read(scratch, self.run_id) if touched is None else _read_changed(scratch, self.run_id, before, touched)
            ),
        )
        _need(self._manifest is None or content.manifest == self._manifest, "update would change the run manifest")
        encoded = bytes(_crdt("unencodable document", scratch.get_update))
        if len(encoded) > MAX_DOC_NBYTES:
            raise Overfull(f"the document would hold {len(encoded)} bytes, over {MAX_DOC_NBYTES}")
        if theirs == ours and content == before:
            return False  # nothing new: keep the document as it was, byte for byte
        # What we adopt must also load again (the next update starts from it, newcomers and
        # the save file get it): yrs accepted updates whose export it could not read back, or
        # read back with clients missing (every later update then "moved a clock back").
        check: Doc[Any] = Doc()
        _crdt("document does not load again", lambda: check.apply_update(encoded))
        reloaded_state = crdt_check.check_state_vector(bytes(_crdt("unreadable state", check.get_state)))
        if touched is None:
            reloaded = _read(check, self.run_id)
        else:  # as many entries of each root, and what changed reads the same
            reloaded = _crdt("unreadable document", lambda: _read_changed(check, self.run_id, before, touched))
            _need(all(_num_entries(check, r) == _num_entries(scratch, r) for r in ROOTS), "entries lost on reload")
        _need(reloaded == content and reloaded_state == theirs, "document reads differently once reloaded")
        # Items past a clock gap: in the encoding, beyond the state vector (read only when
        # this update could have brought some: no gap-free watched update does).
        if touched is None:
            self._gapped = _past_clock(encoded, theirs)
        elif any(end > theirs.get(c, 0) for c, (_, end) in shape.clients.items()):
            self._gapped = True  # some of it waits for what it depends on
        self._doc, self._good = scratch, encoded
        self._adopt(content, touched)
        return True

    def _merged(self, update: bytes, client_id: int, *, watched: bool) -> tuple[Doc[Any], dict[str, set[str]] | None]:
        """Our document with ``update`` applied, on a copy; and, when ``watched``, the keys
        of each root it changed (None: read the whole copy)."""
        if watched:
            scratch = self._copy(client_id)
            touched, stop = _observe_keys(scratch)
            try:
                _crdt("undecodable CRDT update", lambda: scratch.apply_update(update))
                return scratch, touched
            except BadMessage:
                pass  # blamed only if the unwatched apply fails too
            finally:
                stop()
        scratch = self._copy(client_id)
        _crdt("undecodable CRDT update", lambda: scratch.apply_update(update))
        return scratch, None

    def _copy(self, client_id: int) -> Doc[Any]:
        """Our document, on a scratch copy. It takes our client id: once it passes, it
        *becomes* our document, so an update is decoded once and a native panic can only
        ever hit the copy."""
        scratch: Doc[Any] = Doc(client_id=client_id)
        scratch.apply_update(self._good)
        return scratch

    def _own_state(self) -> dict[int, int]:
        """Our state vector, client → clock (read once per change of the document)."""
        if self._state_in is not self._good:
            self._state = crdt_check.check_state_vector(self.state_vector())
            self._state_in = self._good
        return dict(self._state)

    def _deleted(self) -> dict[int, list[tuple[int, int]]]:
        """Our document's delete set, each client's ranges merged (read from the document
        once per change of it)."""
        if self._deleted_in is not self._good:
            # An update against our own state vector holds no struct: the delete set alone.
            only_deletes = bytes(self._doc.get_update(self._doc.get_state()))
            try:
                shape = crdt_check.check_update(only_deletes, max_structs=crdt_check.MAX_CLOCK)
            except BadMessage:  # never seen: then no update counts as nothing new
                shape = crdt_check.UpdateShape(0, {}, {})
            self._deleted_ranges = {c: crdt_check.merged(r) for c, r in shape.deleted.items()}
            self._deleted_in = self._good
        return self._deleted_ranges

    def load(self, update: bytes) -> None:
        """Restore a saved document (same checks as a remote update)."""
        self.apply_remote(update)

    def _write(self, root: str, entries: list[tuple[str, Any]]) -> bytes:
        before = self._doc.get_state()
        target = self._doc.get(root, type=Map)
        with self._doc.transaction():
            for key, value in entries:
                if value is None:
                    target.pop(key, None)
                else:
                    target[key] = value
        content = _read(self._doc, self.run_id)
        self._good = bytes(self._doc.get_update())
        self._adopt(content)
        return bytes(self._doc.get_update(before))

    def _adopt(self, content: Content, touched: dict[str, set[str]] | None = None) -> None:
        """``content`` becomes the document's; the view takes what is newer in it (only in
        the ``touched`` entries when given: the others are as they were)."""
        self._manifest, self._in_doc, self._leases_in_doc = content.manifest, content.members, content.leases
        members: Iterable[str] = content.members if touched is None else touched.get("members", ())
        self._members = dict(self._members)
        for peer_id in members:
            record = content.members.get(peer_id)
            if record is not None and record.newer_than(self._members.get(peer_id)):
                self._members[peer_id] = record
        experts: Iterable[int] = content.leases
        if touched is not None:
            experts = [int(key) for key in touched.get("leases", ()) if key.isdigit()]
        self._leases = dict(self._leases)
        for expert in experts:
            lease = content.leases.get(expert)
            if lease is None:
                continue
            if better_lease(self.run_id, lease, self._leases.get(expert)):
                self._leases[expert] = lease
            self._keep_claim(lease)
        self._note_change(touched)

    def _keep_claim(self, lease: LeaseRecord) -> None:
        by_owner = self._claims.setdefault(lease.expert, {})
        if not better_lease(self.run_id, lease, by_owner.get(lease.owner)):
            return
        by_owner[lease.owner] = lease
        if len(by_owner) > LEASE_OWNERS_KEPT:
            worst = min(by_owner.values(), key=functools.cmp_to_key(self._compare_leases))
            del by_owner[worst.owner]

    def _compare_leases(self, a: LeaseRecord, b: LeaseRecord) -> int:
        return 0 if a == b else (1 if better_lease(self.run_id, a, b) else -1)

    def _note_change(self, touched: dict[str, set[str]] | None = None) -> None:
        self._digest = self._compute_digest(touched)
        self.num_changes += 1
        self._changed.set()
        self._changed = trio.Event()

    def _compute_digest(self, touched: dict[str, set[str]] | None = None) -> str:
        """A hash of the manifest and of the sum (mod 2^256) of each entry's hash: equal
        content, equal digest; a change hashes its own entries (``touched``), all without."""
        if touched is None:
            self._entry_hashes, self._entry_sum = {}, 0
            touched = {"members": set(self._in_doc), "leases": {str(e) for e in self._leases_in_doc}}
        for root in ("members", "leases"):
            for key in touched.get(root, ()):
                self._entry_sum -= self._entry_hashes.pop((root, key), 0)
                value = self._entry(root, key)
                if value is not None:
                    entry = self._entry_hashes[(root, key)] = _entry_hash(root, key, value)
                    self._entry_sum += entry
        self._entry_sum %= DIGEST_MODULUS
        manifest = json.dumps(_jsonable(asdict(self._manifest)) if self._manifest else None, sort_keys=True)
        return hashlib.sha256(manifest.encode() + self._entry_sum.to_bytes(32, "big")).hexdigest()[:16]

    def _entry(self, root: str, key: str) -> "MemberRecord | LeaseRecord | None":
        """The document's entry under ``key`` of ``root`` ("members" or "leases"), if any."""
        if root == "members":
            return self._in_doc.get(key)
        return self._leases_in_doc.get(int(key)) if key.isdigit() else None


def _entry_hash(root: str, key: str, value: "MemberRecord | LeaseRecord") -> int:
    canonical = json.dumps([root, key, _jsonable(asdict(value))], sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(canonical.encode()).digest(), "big")


def _member_value(record: MemberRecord) -> dict[str, Any]:
    value = asdict(record)
    value["addrs"] = list(record.addrs)
    return value


def _jsonable(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v.hex() if isinstance(v, bytes) else v for k, v in value.items()}
