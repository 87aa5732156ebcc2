"""The strict CRDT reader (protocol/runstate/crdt_check.py): what we write passes, what yrs trips on does not.

The hostile vectors (tests/vectors/crdt_hostile_v1.json) panicked, segfaulted, hung or
poisoned pycrdt 0.14.13 when applied on top of a run document. A segfault cannot be
caught, so they run in a child process: a regression shows as that child dying, and this
test failing, instead of the whole test run vanishing.
"""

import contextlib
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycrdt import Array, Doc, Map, Text

from protocol.errors import BadMessage
from protocol.runstate import crdt_check
from protocol.runstate.state import MAX_UPDATE_STRUCTS, Manifest, RunState
from tests.test_state import PEER_B, member, populated, raw

VECTORS = Path(__file__).parent / "vectors" / "crdt_hostile_v1.json"

CHILD = """
import json, sys
from protocol.errors import ProtocolError
from protocol.runstate.state import RunState
from tests.test_state import PEER_A, populated
results = []
for case in json.load(open(sys.argv[1]))["cases"]:
    state = populated()
    outcomes = []
    for update in case["updates"]:
        try:
            outcomes.append("accepted" if state.apply_remote(bytes.fromhex(update)) else "no change")
        except ProtocolError as exc:
            outcomes.append(f"refused: {exc}"[:120])
    again = RunState(state.run_id)
    again.load(state.encode())  # still loads, and reads the same
    healthy = again.members == state.members and again.manifest == state.manifest and PEER_A in state.members
    results.append({"what": case["what"], "outcomes": outcomes, "healthy": healthy})
print(json.dumps(results))
"""


def test_every_hostile_vector_is_refused_and_the_document_stays_healthy() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(VECTORS)], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    results = json.loads(done.stdout)
    assert len(results) == len(json.loads(VECTORS.read_text())["cases"]) > 40
    for result in results:
        assert result["healthy"], result
        # The last update of each case is the one that hurt pycrdt: it never gets in.
        assert result["outcomes"][-1].startswith("refused"), result


def own_updates() -> list[bytes]:
    """Updates RunState itself writes: a manifest, records, rewrites, restores, evictions."""
    state = populated()
    out = [state.encode()]
    out.append(state.put_member(member(PEER_B)))
    out.append(state.put_member(member(PEER_B, seq=2, addrs=("/ip4/10.1.2.3/tcp/9", "/ip6/::1/tcp/9"))))
    out.append(state.evict([PEER_B]))
    out.append(state.encode())
    return out


OWN_UPDATES = own_updates()  # once: every document draws a random client id


def test_what_we_write_passes() -> None:
    shapes = [crdt_check.check_update(u, max_structs=MAX_UPDATE_STRUCTS) for u in OWN_UPDATES]
    # A whole document (each manifest field, its signature, a member record); an eviction deletes only.
    assert shapes[0].num_structs >= len(fields(Manifest)) + 2 and shapes[3].num_structs == 0
    state = populated()
    assert crdt_check.check_state_vector(state.state_vector())


def build(write: Any) -> bytes:
    doc: Doc[Any] = Doc()
    write(doc)
    return bytes(doc.get_update())


@pytest.mark.parametrize(
    ("write", "reason"),
    [
        (lambda d: d.get("members", type=Array).append("x"), "without a key"),
        (lambda d: d.get("members", type=Text).insert(0, "hidden"), "kind 4"),
        (lambda d: d.get("evil", type=Map).__setitem__("k", 1), "unknown"),
        (lambda d: d.get("members", type=Map).__setitem__("k", Map({"nested": 1})), "kind 7"),
        (lambda d: d.get("members", type=Map).__setitem__("k", b"\0" * 4), None),
    ],
)
def test_shapes_we_never_write_are_refused(write: Any, reason: str | None) -> None:
    update = build(write)
    if reason is None:  # bytes values are fine structurally (the schema refuses them later)
        crdt_check.check_update(update, max_structs=MAX_UPDATE_STRUCTS)
        return
    with pytest.raises(BadMessage, match=reason):
        crdt_check.check_update(update, max_structs=MAX_UPDATE_STRUCTS)


def test_two_blocks_of_one_client_are_refused() -> None:
    # 36 bytes that segfaulted pycrdt's first read of the map (no exception, the process died).
    update = bytes.fromhex("020107002801076d656d626572730161017e0107002801076d656d626572730162017e00")
    with pytest.raises(BadMessage, match="two blocks of one client"):
        crdt_check.check_update(update, max_structs=MAX_UPDATE_STRUCTS)


def test_clocks_near_the_u32_limit_are_refused() -> None:
    update = bytes.fromhex("010107ffffffff0f0401076d656d626572730261620107010001")
    with pytest.raises(BadMessage):
        crdt_check.check_update(update, max_structs=MAX_UPDATE_STRUCTS)


def test_a_peer_cannot_write_under_our_client_id() -> None:
    state = populated()
    ours = state._doc.client_id  # the id our own writes use
    doc: Doc[Any] = Doc(client_id=ours)
    doc.apply_update(state.encode())
    before = doc.get_state()
    doc.get("members", type=Map)[PEER_B] = raw(member(PEER_B))
    forged = bytes(doc.get_update(before))
    with pytest.raises(BadMessage, match="our own client id"):
        state.apply_remote(forged)
    # The same structs, once ours (we wrote them), may come back in a peer's diff.
    crdt_check.check_update(state.encode(), max_structs=MAX_UPDATE_STRUCTS, own_client=ours, own_clock=10**6)


def test_too_many_structs_are_refused_before_pycrdt_sees_them() -> None:
    def flood(doc: Doc[Any]) -> None:
        members = doc.get("members", type=Map)
        for i in range(MAX_UPDATE_STRUCTS + 1):
            members[f"k{i}"] = i

    with pytest.raises(BadMessage, match="structs"):
        crdt_check.check_update(build(flood), max_structs=MAX_UPDATE_STRUCTS)


@settings(max_examples=400)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_give_a_clean_answer(data: bytes) -> None:
    with contextlib.suppress(BadMessage):
        crdt_check.check_update(data, max_structs=MAX_UPDATE_STRUCTS)
    with contextlib.suppress(BadMessage):
        crdt_check.check_state_vector(data)


@settings(max_examples=300)
@given(st.data())
def test_mutated_updates_of_ours_are_refused_or_applied_safely(data: st.DataObject) -> None:
    update = bytearray(data.draw(st.sampled_from(OWN_UPDATES)))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(update) - 1))
        update[position] = data.draw(st.integers(0, 255))
    state = populated()
    before = state.members
    try:
        state.apply_remote(bytes(update))
    except BadMessage:
        return
    # Applied: the document reloads as it reads (what a newcomer and the save file get)...
    again = RunState(state.run_id)
    again.load(state.encode())
    assert again.members == state._in_doc and again.leases == state._leases_in_doc
    # ...and our view lost nothing. A mutated update may delete a record from the document
    # (hypothesis found one: our own update with its first clock moved by one, which deletes
    # or not as the two documents' random client ids order); the view keeps the record and
    # lists it as stale, and the run service writes it back (tests/adversarial/test_run_state.py).
    assert all(p in state.members and not r.newer_than(state.members[p]) for p, r in before.items())
    assert set(before) - set(state._in_doc) <= set(state.stale())
