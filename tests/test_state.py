"""The run document: merging, validation before anything is applied, and the digest."""

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycrdt import Array, Doc, Map

from protocol.errors import BadMessage
from protocol.state import Manifest, MemberRecord, RunState

RUN = "demo-abc123"
PEER_A = "12D3KooWRQR6dEJXaYFpJcVNJ2gCWNScK5th5Cp4oFTyJnM2bvKx"
PEER_B = "12D3KooWN85xJLVT8U5HnyLGAebBCVpaQXmtoxP3x5Ljc2yGJZJm"


def member(peer_id: str, **changes: Any) -> MemberRecord:
    fields: dict[str, Any] = {
        "peer_id": peer_id,
        "addrs": ("/ip4/127.0.0.1/tcp/4001",),
        "role": "trainer",
        "device": "cpu",
        "memory_nbytes": 8 << 30,
        "joined_at": 1.7e9,
    }
    fields.update(changes)
    return MemberRecord(**fields)


def manifest() -> Manifest:
    return Manifest(run_id=RUN, name="demo", creator=PEER_A, created_at=1.7e9)


def populated() -> RunState:
    state = RunState(RUN)
    state.create_manifest(manifest())
    state.put_member(member(PEER_A))
    return state


def sync(a: RunState, b: RunState) -> None:
    a.apply_remote(b.diff(a.state_vector()))
    b.apply_remote(a.diff(b.state_vector()))


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


def test_manifest_is_written_once() -> None:
    state = populated()
    with pytest.raises(ValueError, match="already has a manifest"):
        state.create_manifest(manifest())


def test_saved_document_restores_the_same_state() -> None:
    a = populated()
    restored = RunState(RUN)
    restored.load(a.encode())
    assert restored.digest == a.digest


def _hostile(build: Any) -> bytes:
    doc: Doc[Any] = Doc()
    build(doc)
    return bytes(doc.get_update())


HOSTILE = {
    "unknown root": lambda d: d.get("evil", type=Array).append(1),
    "member key mismatch": lambda d: d.get("members", type=Map).__setitem__(
        PEER_B, {**vars_of(member(PEER_A)), "addrs": []}
    ),
    "member missing field": lambda d: d.get("members", type=Map).__setitem__(PEER_B, {"peer_id": PEER_B}),
    "member bad role": lambda d: d.get("members", type=Map).__setitem__(
        PEER_B, {**vars_of(member(PEER_B)), "addrs": [], "role": "king"}
    ),
    "member huge memory": lambda d: d.get("members", type=Map).__setitem__(
        PEER_B, {**vars_of(member(PEER_B)), "addrs": [], "memory_nbytes": 1e300}
    ),
    "member not a map": lambda d: d.get("members", type=Map).__setitem__(PEER_B, "hello"),
}


def vars_of(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_updates_are_rejected_and_change_nothing(case: str) -> None:
    state = populated()
    before_digest, before_doc = state.digest, state.encode()
    with pytest.raises(BadMessage):
        state.apply_remote(_hostile(HOSTILE[case]))
    assert state.digest == before_digest
    assert state.encode() == before_doc


def test_manifest_of_another_run_is_rejected() -> None:
    state = RunState(RUN)
    state.put_member(member(PEER_A))
    before = state.encode()
    other = _hostile(lambda d: d.get("manifest", type=Map).update({**vars_of(manifest()), "run_id": "other-abc123"}))
    with pytest.raises(BadMessage, match="another run"):
        state.apply_remote(other)
    assert state.encode() == before
    assert state.manifest is None


@pytest.mark.parametrize("data", [b"\xd9\x94\xcew\x01,Y^\xd3", b"\x80\x80\x80\x80\x01"])
def test_inflated_counts_are_refused_before_pycrdt_allocates(data: bytes) -> None:
    # Found by Hypothesis: yrs reserves memory for the declared count (≈500 MB for 9 bytes).
    state = populated()
    with pytest.raises(BadMessage, match="declares"):
        state.apply_remote(data)
    with pytest.raises(BadMessage, match="declares"):
        state.diff(data)


def test_concurrent_manifest_rewrite_is_rejected() -> None:
    state = populated()
    rival = RunState(RUN)
    rival.create_manifest(Manifest(run_id=RUN, name="mine", creator=PEER_B, created_at=1.8e9))
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
