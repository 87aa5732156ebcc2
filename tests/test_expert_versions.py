"""How SPES's expert versions travel (training/encodings/experts.py): int8 where the run
compresses, each value back within half a step, and a stranger's bytes refused when they lie."""

import math

import numpy as np
import pytest

from training.encodings import EXPERT_VERSIONS, NAMES, expert_versions
from training.encodings.experts import BLOCK, MAX_SCALE, Int8

INT8 = Int8()


def weights(numel: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(numel) * 0.02).astype(np.float32)


def test_every_encoding_names_how_its_versions_travel() -> None:
    assert set(EXPERT_VERSIONS) == set(NAMES)
    assert expert_versions("none").name == "float32"
    assert expert_versions("int8").name == expert_versions("sparseloco").name == "int8"
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
