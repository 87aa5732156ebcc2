"""The run document: signed records, merging, validation before anything is applied, the view."""

import contextlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycrdt import Array, Doc, Map, Text

from protocol import keys
from protocol.errors import BadMessage, UnsupportedVersion
from protocol.runstate import state as state_module
from protocol.runstate.state import (
    FORMAT_VERSION,
    MAX_DOC_NBYTES,
    Manifest,
    MemberRecord,
    Overfull,
    RunState,
    sign_member,
)
from tests import yjs
from training.settings import RunSettings

RUN = "demo-abc123"
SEED_A, SEED_B, SEED_C = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32
PEER_A, PEER_B, PEER_C = (keys.peer_id_of(s) for s in (SEED_A, SEED_B, SEED_C))
SEEDS = {PEER_A: SEED_A, PEER_B: SEED_B, PEER_C: SEED_C}


def member(peer_id: str, **changes: Any) -> MemberRecord:
    fields: dict[str, Any] = {
        "peer_id": peer_id,
        "addrs": ("/ip4/127.0.0.1/tcp/4001",),
        "role": "trainer",
        "device": "cpu",
        "memory_nbytes": 8 << 30,
        "joined_at": 1.7e9,
        "seq": 1,
    }
    fields.update(changes)
    return sign_member(MemberRecord(**fields), SEEDS[peer_id], RUN)


def member_of(seed: bytes) -> MemberRecord:
    """A record of another peer than A, B and C."""
    SEEDS[keys.peer_id_of(seed)] = seed
    return member(keys.peer_id_of(seed))


def manifest() -> Manifest:
    return Manifest(run_id=RUN, name="demo", creator=PEER_A, created_at=1.7e9)


def populated() -> RunState:
    state = RunState(RUN)
    state.create_manifest(manifest(), SEED_A)
    state.put_member(member(PEER_A))
    return state


def sync(a: RunState, b: RunState) -> None:
    a.apply_remote(b.diff(a.state_vector()))
    b.apply_remote(a.diff(b.state_vector()))


def raw(record: MemberRecord) -> dict[str, Any]:
    value = asdict(record)
    value["addrs"] = list(record.addrs)
    return value


def hostile(build: Any, base: RunState | None = None) -> bytes:
    """An update a peer wrote by hand (optionally on top of ``base``'s document)."""
    doc: Doc[Any] = Doc()
    if base is not None:
        doc.apply_update(base.encode())
    before = doc.get_state()
    build(doc)
    return bytes(doc.get_update(before if base is not None else None))


def test_two_docs_converge_and_digests_match() -> None:
    a, b = populated(), RunState(RUN)
    b.put_member(member(PEER_B))
    assert a.digest != b.digest
    sync(a, b)
    assert a.digest == b.digest
    assert set(a.members) == {PEER_A, PEER_B}
    assert b.manifest == manifest()
    assert b.members[PEER_A].memory_nbytes == 8 << 30  # an int again, though pycrdt stores floats


def test_applying_the_same_update_twice_changes_nothing() -> None:
    a, b = populated(), RunState(RUN)
    update = a.diff(b.state_vector())
    assert b.apply_remote(update) is True
    changes = b.num_changes
    assert b.apply_remote(update) is False
    assert b.num_changes == changes


def test_an_update_that_holds_nothing_new_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A settled run's pulls and pushes mostly bring what we hold: not decoded or re-read
    (each read parsed every member record: at 64 nodes in bench/scale.py, most of the
    protocol's CPU)."""
    a, b = populated(), RunState(RUN)
    sync(a, b)
    reads = []
    read = state_module._read_changed
    monkeypatch.setattr(state_module, "_read_changed", lambda *args: reads.append(1) or read(*args))
    assert b.apply_remote(a.diff(b.state_vector())) is False  # the structs known, the delete set too
    assert b.apply_remote(a.encode()) is False
    assert reads == []
    a.put_member(member(PEER_B))
    assert b.apply_remote(a.diff(b.state_vector())) is True and len(reads) == 2  # read, then reloaded
    assert PEER_B in b.members


def test_a_change_reads_its_own_records_not_every_member(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new member in a document of many costs its own record's checks (twice: read and
    reloaded), not every record's: O(N) a change made a run of N members O(N²) to join."""
    a, b = populated(), RunState(RUN)
    seeds = [bytes([i + 100]) * 32 for i in range(20)]
    for seed in seeds:
        a.put_member(member_of(seed))
    sync(a, b)
    assert len(b.members) == 21
    parsed = []
    parse = state_module.parse_member
    monkeypatch.setattr(state_module, "parse_member", lambda *args: parsed.append(args[0]) or parse(*args))
    newcomer = member_of(bytes([99]) * 32)
    a.put_member(newcomer)
    parsed.clear()  # a's own write read its document whole
    assert b.apply_remote(a.diff(b.state_vector())) is True
    assert parsed == [newcomer.peer_id, newcomer.peer_id]
    assert b.digest == a.digest and len(b.members) == 22
    fresh = RunState(RUN)
    fresh.apply_remote(b.encode())
    assert fresh.digest == b.digest  # one whole read agrees with the incremental ones


def test_a_deletion_alone_is_new_though_every_struct_is_known() -> None:
    """An eviction moves no clock we lack, only the delete set: it is still taken."""
    a, b = populated(), RunState(RUN)
    a.put_member(member(PEER_B))
    sync(a, b)
    before = b.state_vector()
    a.evict([PEER_B])
    update = a.diff(before)
    assert b.state_vector() == before and a.state_vector() == before  # a deletion moves no clock
    assert b.apply_remote(update) is True
    assert b.stale() == [PEER_B]  # out of b's document; its view keeps it (a delete by anyone)
    fresh = RunState(RUN)
    fresh.apply_remote(b.encode())
    assert PEER_B not in fresh.members  # gone from b's document, as from a's


def test_a_deletion_past_a_clock_gap_leaves_the_view_and_the_document_agreeing() -> None:
    """yrs integrates an item whose client skipped a clock, and its map events then name no
    change when it is deleted: a relayed copy of B's record written that way and deleted
    again took B out of the document while the view, the digest and ``stale`` said it was
    there (no upkeep restored it; newcomers never saw B). Such updates are read whole."""
    honest = populated()
    honest.put_member(member(PEER_B))
    state = RunState(RUN)
    state.apply_remote(honest.encode())
    evil, padder = 4242, 77

    def pad(clock: int) -> bytes:  # moves a clock, shows nothing
        return yjs.item(None, root="members", key=f"pad{clock}", deleted=1)

    after_b = yjs.entry_id(state.encode(), "members", PEER_B)
    relayed = yjs.item([raw(member(PEER_B))], origin=after_b)
    assert state.apply_remote(yjs.update({evil: (1, [relayed]), padder: (0, [pad(0)])}))  # clock 0 never sent
    assert state.apply_remote(yjs.update({padder: (1, [pad(1)])}, {evil: [(1, 1)]}))
    whole = state_module._read(state._doc, RUN)
    fresh = RunState(RUN)
    fresh.apply_remote(state.encode())
    assert (PEER_B in whole.members) == (PEER_B in state._in_doc) == (PEER_B in fresh.members)
    assert fresh.digest == state.digest
    if PEER_B not in whole.members:
        assert state.stale() == [PEER_B]  # and upkeep writes it back


def test_an_update_pycrdt_panics_on_while_watched_is_taken_unwatched() -> None:
    """A state hostile updates built (all accepted), then an honest writer's diff: pycrdt's
    map observer panics on it (a second reader's fuzzing found it; it was not reduced)."""
    vector = json.loads((Path(__file__).parent / "vectors" / "crdt_observer_panic_v1.json").read_text())
    state = RunState(RUN)
    state.apply_remote(bytes.fromhex(vector["state"]))
    assert state.apply_remote(bytes.fromhex(vector["update"])) is True
    whole = state_module._read(state._doc, RUN)
    assert (whole.manifest, whole.members, whole.leases) == (state.manifest, state._in_doc, state._leases_in_doc)


def test_a_merge_that_reloads_with_a_client_missing_is_refused() -> None:
    """yrs adopted this hostile update, but the merged document's encoding reloaded without
    one of its clients: every later update then "moved a clock back" and cost its honest
    sender a point. Refused or taken, the next honest update applies."""
    vector = json.loads((Path(__file__).parent / "vectors" / "crdt_reload_loses_client_v1.json").read_text())
    state = RunState(RUN)
    state.apply_remote(bytes.fromhex(vector["document"]))
    with contextlib.suppress(BadMessage):
        state.apply_remote(bytes.fromhex(vector["update"]))
    writer = RunState(RUN)
    writer.apply_remote(state.encode())
    newcomer = member_of(b"\x42" * 32)
    writer.put_member(newcomer)
    assert state.apply_remote(writer.diff(state.state_vector())) is True
    assert newcomer.peer_id in state.members


def test_manifest_is_written_once_and_only_by_its_creator() -> None:
    state = populated()
    with pytest.raises(ValueError, match="already has a manifest"):
        state.create_manifest(manifest(), SEED_A)
    with pytest.raises(ValueError, match="creator"):
        RunState(RUN).create_manifest(manifest(), SEED_B)


def test_records_are_signed_by_their_member_only() -> None:
    with pytest.raises(ValueError, match="signed by the member"):
        sign_member(member(PEER_B), SEED_A, RUN)
    with pytest.raises(BadMessage, match="signature"):
        RunState(RUN).put_member(replace(member(PEER_B), role="observer"))  # changed after signing


def test_saved_document_restores_the_same_state() -> None:
    a = populated()
    restored = RunState(RUN)
    restored.load(a.encode())
    assert restored.digest == a.digest and restored.members == a.members


def test_a_newer_record_replaces_the_older_one() -> None:
    a, b = populated(), RunState(RUN)
    b.apply_remote(a.encode())
    a.put_member(member(PEER_A, seq=2, addrs=("/ip4/10.0.0.1/tcp/1",)))
    sync(a, b)
    assert b.members[PEER_A].seq == 2 and b.members[PEER_A].addrs == ("/ip4/10.0.0.1/tcp/1",)


def test_concurrent_writes_of_one_record_settle_on_the_newest_after_a_restore() -> None:
    # Two nodes write A's record at once (A a newer one, B restoring an older one it held):
    # the CRDT keeps one of them by client id, maybe the older. The author then finds its
    # record stale and writes it again, after the other: the newest wins everywhere.
    a, b = populated(), RunState(RUN)
    b.apply_remote(a.encode())
    a.put_member(member(PEER_A, seq=2))
    b.apply_remote(hostile(lambda d: d.get("members", type=Map).__setitem__(PEER_A, raw(member(PEER_A))), b))
    sync(a, b)
    for state in (a, b):
        for update in [state.restore(state.stale())]:
            for other in (a, b):
                if update:
                    other.apply_remote(update)
    sync(a, b)
    assert a.members[PEER_A].seq == b.members[PEER_A].seq == 2
    assert a.digest == b.digest and a.stale() == b.stale() == []


def test_a_replayed_older_record_changes_nothing_in_the_view_and_is_restored() -> None:
    state = populated()
    state.put_member(member(PEER_A, seq=5))
    old = member(PEER_A, seq=1)  # genuinely signed, but superseded
    state.apply_remote(hostile(lambda d: d.get("members", type=Map).__setitem__(PEER_A, raw(old)), state))
    assert state.members[PEER_A].seq == 5
    assert state.stale() == [PEER_A]
    fresh = RunState(RUN)
    fresh.apply_remote(state.encode())
    assert fresh.members[PEER_A].seq == 1  # what the document now says...
    fresh.apply_remote(state.diff(fresh.state_vector()))
    fresh.apply_remote(state.restore(state.stale()))  # ...until the newest record is written back
    assert fresh.members[PEER_A].seq == 5 and state.stale() == []


def test_a_delete_by_anyone_changes_nothing_in_the_view_and_is_restored() -> None:
    state = populated()
    state.put_member(member(PEER_B))
    state.apply_remote(hostile(lambda d: d.get("members", type=Map).pop(PEER_B), state))
    assert PEER_B in state.members and state.stale() == [PEER_B]
    restore = state.restore([PEER_B])
    assert restore and state.stale() == []
    fresh = RunState(RUN)
    fresh.apply_remote(state.encode())
    assert PEER_B in fresh.members


def test_evicted_records_leave_the_view_until_a_newer_one_comes() -> None:
    state = populated()
    state.put_member(member(PEER_B))
    state.evict([PEER_B])
    assert PEER_B not in state.members and state.stale() == []
    fresh = RunState(RUN)
    fresh.apply_remote(state.encode())
    assert PEER_B not in fresh.members  # gone from the document too: newcomers never see it
    newer = raw(member(PEER_B, seq=9))  # written by its author after syncing, as authors do
    state.apply_remote(hostile(lambda d: d.get("members", type=Map).__setitem__(PEER_B, newer), state))
    assert state.members[PEER_B].seq == 9


HOSTILE = {
    "unknown root": lambda d: d.get("evil", type=Array).append(1),
    "members root is an array": lambda d: d.get("members", type=Array).append("x" * 100),
    "members root is text": lambda d: d.get("members", type=Text).insert(0, "x" * 100),
    "manifest root is an array": lambda d: d.get("manifest", type=Array).append(1),
    "forged member": lambda d: d.get("members", type=Map).__setitem__(
        PEER_B, {**raw(member(PEER_B)), "role": "observer"}
    ),
    "member signed by another": lambda d: d.get("members", type=Map).__setitem__(
        PEER_B, {**raw(member(PEER_B)), "sig": member(PEER_C).sig}
    ),
    "member unsigned": lambda d: d.get("members", type=Map).__setitem__(PEER_B, {**raw(member(PEER_B)), "sig": b""}),
    "member key mismatch": lambda d: d.get("members", type=Map).__setitem__(PEER_B, raw(member(PEER_C))),
    "member missing field": lambda d: d.get("members", type=Map).__setitem__(PEER_B, {"peer_id": PEER_B}),
    "member bad role": lambda d: d.get("members", type=Map).__setitem__(PEER_B, raw(member(PEER_B, role="king"))),
    "member huge memory": lambda d: d.get("members", type=Map).__setitem__(
        PEER_B, {**raw(member(PEER_B)), "memory_nbytes": 1e300}
    ),
    "member not a map": lambda d: d.get("members", type=Map).__setitem__(PEER_B, "hello"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_updates_are_rejected_and_change_nothing(case: str) -> None:
    state = populated()
    before_digest, before_doc = state.digest, state.encode()
    with pytest.raises(BadMessage):
        state.apply_remote(hostile(HOSTILE[case]))
    assert state.digest == before_digest
    assert state.encode() == before_doc


def test_a_forged_manifest_is_rejected() -> None:
    state = RunState(RUN)
    state.put_member(member(PEER_A))
    before = state.encode()
    genuine = populated()
    other = RunSettings(algorithm="noloco", rounds=10_000).encode()
    forged = hostile(lambda d: d.get("manifest", type=Map).__setitem__("settings", other), genuine)
    victim = RunState(RUN)
    with pytest.raises(BadMessage, match="signature"):
        victim.apply_remote(genuine.encode())
        victim.apply_remote(forged)
    assert state.encode() == before


def test_manifest_of_another_run_is_rejected() -> None:
    state = RunState(RUN)
    state.put_member(member(PEER_A))
    before = state.encode()
    other_run = RunState("other-abc123")
    other_run.create_manifest(replace(manifest(), run_id="other-abc123"), SEED_A)
    with pytest.raises(BadMessage):
        state.apply_remote(other_run.encode())
    assert state.encode() == before
    assert state.manifest is None


def test_a_document_of_another_format_is_refused_naming_both() -> None:
    old = hostile(lambda d: d.get("manifest", type=Map).update({**asdict(manifest()), "version": 2}))
    with pytest.raises(UnsupportedVersion, match=f"format 2; this node reads format {FORMAT_VERSION}"):
        RunState(RUN).apply_remote(old)


def test_past_the_byte_cap_an_update_is_refused_without_blame() -> None:
    state = populated()
    long_addrs = tuple(f"/dns4/{'x' * 230}.example/tcp/{i}" for i in range(16))  # ≈ 4 KiB a record
    half = MAX_DOC_NBYTES // 2 // 4000

    def fill(start: int) -> Any:
        records = []
        for i in range(start, start + half):
            seed = i.to_bytes(4, "big") * 8
            record = MemberRecord(keys.peer_id_of(seed), long_addrs, "trainer", "cpu", 1, 1.7e9, 1)
            records.append(raw(sign_member(record, seed, RUN)))

        def build(doc: Doc[Any]) -> None:
            members = doc.get("members", type=Map)
            with doc.transaction():
                for record in records:
                    members[record["peer_id"]] = record

        return build

    assert state.apply_remote(hostile(fill(0), state))  # under the cap: taken
    before = state.encode()
    with pytest.raises(Overfull):
        state.apply_remote(hostile(fill(half), state))  # each update is fine; together, too much
    assert not isinstance(Overfull("x"), BadMessage)  # the guard does not penalize it
    assert state.encode() == before and len(state.members) == half + 1


@pytest.mark.parametrize("data", [b"\xd9\x94\xcew\x01,Y^\xd3", b"\x80\x80\x80\x80\x01"])
def test_inflated_counts_are_refused_before_pycrdt_allocates(data: bytes) -> None:
    # Found by Hypothesis: yrs reserves memory for the declared count (≈500 MB for 9 bytes).
    state = populated()
    with pytest.raises(BadMessage, match="exceeds"):
        state.apply_remote(data)
    with pytest.raises(BadMessage, match="exceeds"):
        state.diff(data)


def test_concurrent_manifest_rewrite_is_rejected() -> None:
    state = populated()
    rival = RunState(RUN)
    rival.create_manifest(replace(manifest(), name="mine", creator=PEER_B, created_at=1.8e9), SEED_B)
    before = state.encode()
    try:
        state.apply_remote(rival.encode())
    except BadMessage:
        assert state.encode() == before
    # Merged concurrent writes resolve by client id: the rival may lose on every key (then
    # nothing visible changed) but it never replaces the manifest we hold.
    assert state.manifest == manifest()


@settings(max_examples=300)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_as_update_change_nothing(data: bytes) -> None:
    state = populated()
    before = state.encode()
    with contextlib.suppress(BadMessage):
        state.apply_remote(data)
    # Whatever was accepted must still be a valid document of the same run.
    assert state.manifest == manifest()
    assert PEER_A in state.members
    if state.encode() != before:
        assert state.num_changes > 2


@given(st.binary(max_size=128))
def test_arbitrary_bytes_as_state_vector(data: bytes) -> None:
    state = populated()
    with contextlib.suppress(BadMessage):
        state.diff(data)
