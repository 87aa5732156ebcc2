"""How SPES's expert versions travel (training/encodings/experts.py): int8 where the run
compresses, each value back within half a step; keyframes and deltas rebuilt bit for bit
along a chain under sparseloco; and a stranger's bytes refused when they lie."""

import hashlib
import math

import numpy as np
import pytest

from training.encodings import EXPERT_VERSIONS, NAMES, expert_versions, topk
from training.encodings.experts import BLOCK, CHAIN, DELTA, KEYFRAME, MAX_MAGNITUDE, MAX_SCALE, Chain, Int8, Sparse

INT8 = Int8()


def weights(numel: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(numel) * 0.02).astype(np.float32)


def test_every_encoding_names_how_its_versions_travel() -> None:
    assert set(EXPERT_VERSIONS) == set(NAMES)
    assert expert_versions("none").name == "float32"
    assert expert_versions("int8").name == "int8"
    assert expert_versions("sparseloco").name == "sparse"
    with pytest.raises(ValueError):
        expert_versions("zip")


@pytest.mark.parametrize("numel", [1, BLOCK, 3 * BLOCK + 7, 40_000])
def test_an_int8_version_is_a_quarter_of_the_bytes_and_each_value_within_half_a_step(numel: int) -> None:
    x = weights(numel)
    x[0] = 0.0
    if numel > BLOCK:
        x[BLOCK : 2 * BLOCK] = 0.0  # a zero block: scale 0, exactly zero back
    wire = INT8.encode(x.tobytes())
    assert len(wire) == INT8.nbytes(numel) == numel + 4 * math.ceil(numel / BLOCK)
    back = np.frombuffer(INT8.decode(wire, numel), dtype=np.float32)
    blocks = np.pad(np.abs(x), (0, (-numel) % BLOCK)).reshape(-1, BLOCK)
    half_step = np.repeat(blocks.max(axis=1) / np.float32(127) / 2, BLOCK)[:numel]
    # Half a step, plus the roundings of one division and one product (a few float32 ulps).
    assert (np.abs(back - x) <= half_step * (1 + 4 * 2.0**-23)).all()
    assert back[0] == 0.0 and (numel <= BLOCK or not back[BLOCK : 2 * BLOCK].any())
    assert np.isfinite(back).all()


def test_a_version_of_non_finite_weights_carries_non_finite_scales_and_is_refused() -> None:
    x = weights(3 * BLOCK)
    x[BLOCK + 5] = np.nan
    wire = INT8.encode(x.tobytes())
    with pytest.raises(ValueError, match="scales"):
        INT8.decode(wire, len(x))


@pytest.mark.parametrize("damage", ["short", "long", "nan scale", "inf scale", "negative scale", "huge scale"])
def test_a_lying_int8_version_is_refused(damage: str) -> None:
    numel = 2 * BLOCK + 3
    wire = bytearray(INT8.encode(weights(numel).tobytes()))
    if damage == "short":
        wire = wire[:-1]
    elif damage == "long":
        wire += bytes(1)
    else:
        bad = {"nan scale": np.nan, "inf scale": np.inf, "negative scale": -1.0, "huge scale": MAX_SCALE * 2}
        wire[numel + 4 : numel + 8] = np.array([bad[damage]], dtype="<f4").tobytes()  # the second block's
    with pytest.raises(ValueError):
        INT8.decode(bytes(wire), numel)


def test_the_largest_scale_accepted_decodes_finite() -> None:
    numel = BLOCK
    codes = np.full(numel, 127, dtype=np.int8).tobytes() + np.array([MAX_SCALE], dtype="<f4").tobytes()
    codes_negative = np.full(numel, -127, dtype=np.int8).tobytes() + np.array([MAX_SCALE], dtype="<f4").tobytes()
    for wire in (codes, codes_negative):
        assert np.isfinite(np.frombuffer(INT8.decode(wire, numel), dtype=np.float32)).all()


def test_float32_versions_travel_as_they_are_and_must_have_the_size() -> None:
    versions = expert_versions("none")
    data = weights(100).tobytes()
    assert versions.encode(data) == data == versions.decode(data, 100)
    with pytest.raises(ValueError):
        versions.decode(data[:-4], 100)


SPARSE = Sparse()


def owner_chain(
    numel: int, rounds: int, *, seed: int = 0, step: float = 0.002
) -> list[tuple[bytes, Chain, np.ndarray]]:
    """An owner's versions over ``rounds`` rounds of random updates: (wire, chain after it, weights)."""
    rng = np.random.default_rng(seed)
    x = weights(numel, seed)
    chain: Chain | None = None
    out = []
    for _ in range(rounds):
        x = (x + rng.standard_normal(numel).astype(np.float32) * np.float32(step)).astype(np.float32)
        wire, next_chain = SPARSE.encode_next(x.tobytes(), chain)
        assert next_chain is not None
        chain = next_chain
        out.append((wire, chain, x.copy()))
    return out


@pytest.mark.parametrize("numel", [1, 4096, 3 * 4096 + 777])
def test_a_chain_is_rebuilt_bit_for_bit_from_its_keyframe_or_from_any_version_held(numel: int) -> None:
    versions = owner_chain(numel, 2 * CHAIN + 3)
    kinds = [SPARSE.link(wire, numel) for wire, _, _ in versions]
    # A keyframe every CHAIN versions, the first one included; each delta names the version before.
    assert [depth for depth, _ in kinds] == [i % CHAIN for i in range(len(versions))]
    for i, (depth, base) in enumerate(kinds):
        assert (base is None) == (depth == 0)
        assert base is None or base == hashlib.sha256(versions[i - 1][0]).digest()
        wire = versions[i][0]
        assert len(wire) == (SPARSE.nbytes(numel) if depth == 0 else SPARSE.delta_nbytes(numel))
        assert wire[0] == (KEYFRAME if depth == 0 else DELTA)
    for i, (wire, chain, _) in enumerate(versions):
        start = i - kinds[i][0]
        wires = [w for w, _, _ in versions[start : i + 1]]
        whole = SPARSE.decode_chain(wires, numel)
        assert whole.dtype == np.float32 and np.array_equal(whole.view(np.uint32), chain.public.view(np.uint32))
        assert chain.sha256 == hashlib.sha256(wire).digest()
        for held in range(start, i):  # a holder of an earlier version applies only what follows it
            onward = SPARSE.decode_chain(
                wires[held - start + 1 :], numel, base=versions[held][1].public, base_depth=held - start
            )
            assert np.array_equal(onward.view(np.uint32), chain.public.view(np.uint32))


def test_deltas_are_a_fifth_of_a_keyframe_and_the_public_copy_stays_near_the_weights() -> None:
    numel = 16 * 4096
    assert SPARSE.sizes(numel) == {SPARSE.nbytes(numel), SPARSE.delta_nbytes(numel)}
    assert SPARSE.nbytes(numel) == 1 + INT8.nbytes(numel)
    assert SPARSE.delta_nbytes(numel) == 2 + 32 + numel // 8 + 2 * (numel // 4) // 8 + 8 * 16
    assert SPARSE.delta_nbytes(numel) < 0.19 * SPARSE.nbytes(numel)
    # Updates of 10% of the weights' norm a round (random: the worst case for error feedback);
    # what was not sent stays in x − x̂, about one round's update at most.
    for _, chain, x in owner_chain(numel, 2 * CHAIN, step=0.002):
        assert np.linalg.norm(x - chain.public) < 0.1 * np.linalg.norm(x)


def test_non_finite_weights_go_as_a_keyframe_whose_scales_are_refused() -> None:
    numel = 3 * BLOCK
    wire, chain, x = owner_chain(numel, 2)[-1]
    assert SPARSE.link(wire, numel)[0] == 1
    x[5] = np.inf
    bad, _ = SPARSE.encode_next(x.tobytes(), chain)
    assert SPARSE.link(bad, numel) == (0, None)
    with pytest.raises(ValueError, match="scales"):
        SPARSE.decode_chain([bad], numel)


def _delta_of(numel: int) -> tuple[list[bytes], Chain]:
    versions = owner_chain(numel, 3)
    return [w for w, _, _ in versions], versions[0][1]


@pytest.mark.parametrize(
    "damage",
    [
        "short",
        "long",
        "unknown kind",
        "depth 0",
        "depth past the chain",
        "nan magnitude",
        "negative magnitude",
        "huge magnitude",
        "a chunk's count",
        "bit past the end",
    ],
)
def test_a_lying_delta_is_refused(damage: str) -> None:
    numel = 4096 + 100
    wires, keyframe = _delta_of(numel)
    wire = bytearray(wires[1])
    chunks = topk.chunk_sizes(numel)
    mask_end = 34 + -(-numel // 8)
    magnitudes_at = len(wire) - 8 * len(chunks)
    if damage == "short":
        wire = wire[:-1]
    elif damage == "long":
        wire += bytes(1)
    elif damage == "unknown kind":
        wire[0] = 3
    elif damage == "depth 0":
        wire[1] = 0
    elif damage == "depth past the chain":
        wire[1] = CHAIN
    elif damage in ("nan magnitude", "negative magnitude", "huge magnitude"):
        bad = {"nan magnitude": np.nan, "negative magnitude": -1.0, "huge magnitude": MAX_MAGNITUDE * 2}[damage]
        wire[magnitudes_at + 4 : magnitudes_at + 8] = np.array([bad], dtype="<f4").tobytes()
    elif damage == "a chunk's count":
        wire[34] ^= 0xFF  # 8 values of the first chunk flipped in or out
    else:
        wire[mask_end - 1] |= 0x80  # numel is not a multiple of 8: the last byte's top bit is past it
    with pytest.raises(ValueError):
        SPARSE.decode_chain([wires[0], bytes(wire)], numel)
    with pytest.raises(ValueError):
        SPARSE.decode_chain([bytes(wire)], numel, base=keyframe.public)


def test_a_chain_that_does_not_hold_together_is_refused() -> None:
    numel = 2 * 4096
    wires, keyframe = _delta_of(numel)
    other = [w for w, _, _ in owner_chain(numel, 3, seed=5)]  # the same shapes, another owner's history
    for chain in (
        [wires[1]],  # a delta alone: no base
        [wires[0], wires[2]],  # a delta skipping the one it names
        [wires[0], other[1]],  # a delta of another chain
        [wires[0], wires[1], wires[0]],  # a keyframe inside
        [other[0], wires[1]],
        [],
    ):
        with pytest.raises(ValueError):
            SPARSE.decode_chain(chain, numel)
    with pytest.raises(ValueError):  # from a base, the first must be a delta
        SPARSE.decode_chain([wires[0]], numel, base=keyframe.public)
    with pytest.raises(ValueError):  # a keyframe needs no base; a delta's is not decodable alone
        SPARSE.decode(wires[1], numel)
    # Longer than a chain may be: CHAIN + 1 versions are refused whatever they hold.
    long = [w for w, _, _ in owner_chain(numel, CHAIN + 1)]
    with pytest.raises(ValueError):
        SPARSE.decode_chain([*long[:CHAIN], long[CHAIN]], numel)
    with pytest.raises(ValueError):
        SPARSE.decode_chain([long[0], *long[1:CHAIN], long[1]], numel)


def test_a_delta_cannot_take_a_value_past_float32s_range() -> None:
    numel = 4096
    wires, _ = _delta_of(numel)
    base = np.full(numel, MAX_MAGNITUDE * 3.9, dtype=np.float32)
    wire = bytearray(wires[1])
    magnitudes_at = len(wire) - 8
    wire[magnitudes_at:] = np.array([MAX_MAGNITUDE, MAX_MAGNITUDE], dtype="<f4").tobytes()
    with pytest.raises(ValueError, match="range"):
        SPARSE.decode_chain([bytes(wire)], numel, base=base)


def test_an_owner_whose_delta_no_holder_would_take_sends_a_keyframe_instead() -> None:
    """Finite weights whose difference from the public copy is past float32's range (1e38
    then −1e38): the delta's magnitudes would be refused by every holder, and the owner's
    own encoder raised on them, restarting its worker every round. A keyframe goes."""
    numel = 4096
    first = np.full(numel, 1e38, dtype=np.float32)
    wire, chain = SPARSE.encode_next(first.tobytes(), None)
    assert wire[0] == KEYFRAME and chain.depth == 0
    wire, chain = SPARSE.encode_next((-first).tobytes(), chain)
    assert wire[0] == KEYFRAME and chain.depth == 0
    assert np.array_equal(SPARSE.decode_chain([wire], numel), chain.public)
