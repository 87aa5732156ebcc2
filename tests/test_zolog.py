"""The ZO update log: signed batches, and everything it must refuse."""

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.algorithms.zo import zolog
from protocol.errors import BadMessage
from protocol.net.host import peer_id_from_seed

RUN = "zo-run-abcdef"
ALICE, BOB, MALLORY = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
MEMBERS = {zolog.peer_id_of(ALICE), zolog.peer_id_of(BOB)}


def log() -> zolog.UpdateLog:
    return zolog.UpdateLog(RUN, is_member=MEMBERS.__contains__)


def wire(batch: zolog.Batch) -> zolog.Batch:
    """Through the bytes and back, as a peer would receive it."""
    return zolog.decode_batch(batch.encode(), RUN)


@settings(max_examples=20, deadline=None)
@given(st.binary(min_size=32, max_size=32))
def test_peer_ids_match_libp2ps_without_importing_it(seed: bytes) -> None:
    assert zolog.peer_id_of(seed) == peer_id_from_seed(seed)


@given(
    st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=50),
    st.integers(min_value=0, max_value=10**6),
    st.binary(min_size=50, max_size=50),
)
def test_batches_round_trip(steps: list[int], start: int, g: bytes) -> None:
    rounds = [start + sum(steps[: i + 1]) for i in range(len(steps))]
    batch = zolog.sign_batch(ALICE, RUN, 7, rounds, g[: len(rounds)])
    assert wire(batch) == batch
    assert [e.seq for e in batch.entries()] == list(range(7, 7 + len(rounds)))


def test_bytes_per_update() -> None:
    # One signature is shared by the batch: ≈ 7 bytes per update at 32, ≈ 3 at 256.
    for size, bound in ((1, 170), (32, 8), (256, 3)):
        batch = zolog.sign_batch(ALICE, RUN, 0, list(range(size)), bytes(size))
        assert len(batch.encode()) / size <= bound


def tampered(batch: zolog.Batch, **fields: object) -> bytes:
    msg = msgpack.unpackb(batch.encode(), raw=False)
    msg.update(fields)
    return msgpack.packb(msg, use_bin_type=True)  # type: ignore[no-any-return]


def test_forged_unsigned_and_foreign_batches_are_refused() -> None:
    batch = zolog.sign_batch(ALICE, RUN, 0, [1, 2, 3], b"\x01\x02\x03")
    for raw, reason in [
        (tampered(batch, g=b"\x01\x02\x7f"), "signature"),  # a changed g
        (tampered(batch, first_seq=1), "signature"),  # moved along the chain
        (tampered(batch, sig=bytes(64)), "signature"),  # unsigned
        (tampered(batch, peer=zolog.peer_id_of(BOB)), "signature"),  # claims another author
        (tampered(batch, sig=b"short"), "signature length"),
        (b"\x93garbage", "wrong fields|undecodable"),
    ]:
        with pytest.raises(BadMessage, match=reason):
            zolog.decode_batch(raw, RUN)
    with pytest.raises(BadMessage, match="signature"):
        zolog.decode_batch(batch.encode(), "another-run-abcdef")  # replayed into another run


def test_several_updates_in_one_round_share_a_batch_and_rounds_never_go_back() -> None:
    batch = wire(zolog.sign_batch(ALICE, RUN, 0, [4, 4, 4, 5], b"\x01\x02\x03\x04"))
    assert [e.round for e in batch.entries()] == [4, 4, 4, 5]
    with pytest.raises(ValueError, match="never decrease"):
        zolog.sign_batch(ALICE, RUN, 0, [5, 4], b"\x01\x02")
    # The wire form cannot say "decrease" (deltas are unsigned); a later batch can, and is refused.
    updates = log()
    updates.add(batch, max_round=10)
    with pytest.raises(BadMessage, match="decrease"):
        updates.add(wire(zolog.sign_batch(ALICE, RUN, 4, [3], b"\x01")), max_round=10)
    assert len({zolog.seed_of(RUN, e.peer_id, e.round, e.seq) for e in batch.entries()}) == 4


def test_unknown_peers_far_future_rounds_and_equivocation_are_refused() -> None:
    updates = log()
    with pytest.raises(zolog.UnknownAuthor, match="not a member"):
        updates.add(wire(zolog.sign_batch(MALLORY, RUN, 0, [1], b"\x01")), max_round=10)
    with pytest.raises(zolog.NotYet, match="beyond"):
        updates.add(wire(zolog.sign_batch(ALICE, RUN, 0, [11], b"\x01")), max_round=10)
    assert len(updates.add(wire(zolog.sign_batch(ALICE, RUN, 0, [1, 2], b"\x01\x02")), max_round=10)) == 2
    other = wire(zolog.sign_batch(ALICE, RUN, 1, [2], b"\x09"))
    with pytest.raises(zolog.Equivocation, match="two different entries") as caught:
        updates.add(other, max_round=10)
    assert caught.value.author == zolog.peer_id_of(ALICE) and caught.value.other == other
    assert zolog.sign_batch(ALICE, RUN, 0, [1, 2], b"\x01\x02") == caught.value.held
    with pytest.raises(BadMessage, match="decrease"):
        updates.add(wire(zolog.sign_batch(ALICE, RUN, 2, [1], b"\x09")), max_round=10)
    assert updates.vector() == {zolog.peer_id_of(ALICE): 2}


def test_the_run_s_rules_convict_the_author() -> None:
    updates = zolog.UpdateLog(RUN, is_member=MEMBERS.__contains__, rounds=5, max_per_round=3)
    with pytest.raises(zolog.Forbidden, match="the run has 5") as caught:
        updates.add(wire(zolog.sign_batch(ALICE, RUN, 0, [5], b"\x01")), max_round=100)
    assert caught.value.author == zolog.peer_id_of(ALICE)
    updates.add(wire(zolog.sign_batch(ALICE, RUN, 0, [1, 1], b"\x01\x02")), max_round=100)
    with pytest.raises(zolog.Forbidden, match="4 entries for round 1"):
        updates.add(wire(zolog.sign_batch(ALICE, RUN, 2, [1, 1], b"\x01\x02")), max_round=100)
    assert updates.vector() == {zolog.peer_id_of(ALICE): 2}


def test_the_agreed_round_is_not_the_largest_anyone_claims() -> None:
    members = {zolog.peer_id_of(s) for s in (ALICE, BOB, MALLORY)}
    updates = zolog.UpdateLog(RUN, is_member=members.__contains__)
    updates.add(wire(zolog.sign_batch(ALICE, RUN, 0, [0, 1, 2], b"\x01" * 3)), max_round=10**6)
    updates.add(wire(zolog.sign_batch(BOB, RUN, 0, [0, 1, 2, 3], b"\x01" * 4)), max_round=10**6)
    updates.add(wire(zolog.sign_batch(MALLORY, RUN, 0, [999_000], b"\x01")), max_round=10**6)
    assert updates.max_round() == 999_000
    assert updates.agreed_round() == 4  # the lower median of 3, 4, 999001


def test_an_excluded_author_leaves_the_log_and_stays_out() -> None:
    updates = log()
    first = wire(zolog.sign_batch(ALICE, RUN, 0, [1], b"\x01"))
    second = wire(zolog.sign_batch(ALICE, RUN, 0, [1], b"\x02"))
    updates.add(first, max_round=10)
    updates.add(wire(zolog.sign_batch(BOB, RUN, 0, [1], b"\x03")), max_round=10)
    assert updates.exclude(zolog.peer_id_of(ALICE), (first, second)) is True
    assert updates.exclude(zolog.peer_id_of(ALICE), (first, second)) is False
    assert [e.peer_id for e in updates.ordered(below_round=10)] == [zolog.peer_id_of(BOB)]
    with pytest.raises(zolog.Excluded):
        updates.add(wire(zolog.sign_batch(ALICE, RUN, 1, [2], b"\x01")), max_round=10)


def entries(author: str, round_index: int, codes: list[int]) -> list[zolog.Entry]:
    return [zolog.Entry(round_index, author, k, code) for k, code in enumerate(codes)]


def test_robust_codes_clip_outliers_and_silence_a_flooding_author() -> None:
    honest = ["a", "b", "c"]
    log_entries: list[zolog.Entry] = []
    for r in range(6):
        for author in honest:
            log_entries += entries(author, r, [60, 0x80 | 62, 58, 61] * 3)  # levels ≈ 60
        log_entries += entries("z", r, [127] * 12)  # the flood: every g at the largest level
    log_entries.sort()
    robust = zolog.robust_codes(log_entries)
    by_entry = dict(zip(log_entries, robust.codes, strict=True))
    early = [c for e, c in by_entry.items() if e.peer_id == "z" and e.round == 0]
    late = [c for e, c in by_entry.items() if e.peer_id == "z" and e.round >= 2]
    assert early == [127] * 12  # round 0: no history yet, nothing known to clip against
    # Round 1: 12 of its entries seen, fewer than MIN_AUTHOR_SAMPLES: clipped, not zeroed.
    assert {c for e, c in by_entry.items() if e.peer_id == "z" and e.round == 1} == {61 + zolog.CLIP_LEVELS}
    assert set(late) == {0} and robust.silenced == len(late) and robust.silenced_authors == {"z"}
    assert all(c == e.g_code for e, c in by_entry.items() if e.peer_id != "z")  # honest ones untouched
    # One honest outlier is clipped to 4× the scale, its sign kept. The scale is the lower
    # median of the window's levels, the flood's included (a median shrugs off a quarter):
    # 9 × 58, 9 × 60, 9 × 61, 9 × 62 and 12 × 127 a round → 61.
    spike = [*log_entries, zolog.Entry(6, "a", 99, 0x80 | 120)]
    assert zolog.robust_codes(spike).codes[-1] == 0x80 | (61 + zolog.CLIP_LEVELS)


def test_replays_add_nothing_and_gaps_wait_for_their_fill() -> None:
    updates = log()
    first = wire(zolog.sign_batch(ALICE, RUN, 0, [1, 2], b"\x01\x02"))
    later = wire(zolog.sign_batch(ALICE, RUN, 2, [3, 4], b"\x03\x04"))
    assert updates.add(later, max_round=10) == []  # seq 2 before 0 and 1: kept aside
    assert [e.seq for e in updates.add(first, max_round=10)] == [0, 1, 2, 3]
    assert updates.add(first, max_round=10) == [] and updates.add(later, max_round=10) == []
    assert updates.next_seq(zolog.peer_id_of(ALICE)) == 4
    assert updates.batches_after(zolog.peer_id_of(ALICE), 3) == [later]


def test_the_canonical_order_is_round_then_peer_then_seq() -> None:
    updates = log()
    updates.add(wire(zolog.sign_batch(BOB, RUN, 0, [1, 2], b"\x0b\x0c")), max_round=10)
    updates.add(wire(zolog.sign_batch(ALICE, RUN, 0, [2, 3], b"\x01\x02")), max_round=10)
    order = [(e.round, e.peer_id) for e in updates.ordered(below_round=3)]
    assert order == sorted(order) and len(order) == 3  # round 3 not yet included
    assert zolog.seed_of(RUN, "a", 1, 0) != zolog.seed_of(RUN, "a", 2, 0) != zolog.seed_of(RUN, "b", 1, 0)


@given(st.binary(max_size=400))
def test_garbage_never_escapes_as_another_error(raw: bytes) -> None:
    with contextlib.suppress(BadMessage):
        zolog.decode_batch(raw, RUN)
