"""The perturbation generator against its definition and the published test vectors."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import rng

VECTORS = json.loads((Path(__file__).parent / "vectors" / "rng_v1.json").read_text())
VECTORS_V2 = json.loads((Path(__file__).parent / "vectors" / "rng_v2.json").read_text())


@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.integers(min_value=0, max_value=2**32 - 64),
)
def test_the_torch_reference_matches_the_definition(seed: int, param_index: int, offset: int) -> None:
    got = rng.bits(seed, param_index, 64, offset=offset).tolist()
    assert got == [rng.bits_int(seed, param_index, offset + i) for i in range(64)]


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: f"s{c['seed']}-p{c['param_index']}")
def test_published_vectors(case: dict) -> None:  # type: ignore[type-arg]
    seed, p = int(case["seed"]), case["param_index"]
    assert VECTORS["version"] == rng.VERSION
    assert list(rng.key(seed, p)) == [case["ka"], case["kb"]]
    assert rng.bits(seed, p, 16).tolist() == case["bits_0_16"]
    assert rng.bits(seed, p, 8, offset=2**32 - 8).tolist() == case["bits_last_8"]
    signs = (rng.bits(seed, p, 1 << 20) >> 31).to(torch.uint8).numpy()
    assert hashlib.sha256(np.packbits(signs).tobytes()).hexdigest() == case["sign_bits_2_20_sha256"]
    z = rng.rademacher(seed, p, 1 << 20)
    assert z.dtype == torch.float32 and set(z.unique().tolist()) == {-1.0, 1.0}
    assert int(z.sum()) == case["sign_sum_2_20"]


@given(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.integers(min_value=0, max_value=2**32 - 100),
    st.integers(min_value=0, max_value=100),
)
def test_version_2_takes_32_signs_from_each_word_at_any_offset(
    seed: int, param_index: int, offset: int, count: int
) -> None:
    got = rng.sign_bits(seed, param_index, count, offset=offset, version=2).tolist()
    assert got == [rng.sign_bit_int(seed, param_index, offset + i, 2) for i in range(count)]


@pytest.mark.parametrize("case", VECTORS_V2["cases"], ids=lambda c: f"s{c['seed']}-p{c['param_index']}")
def test_published_vectors_of_version_2(case: dict) -> None:  # type: ignore[type-arg]
    """Vectors written from the definition in pure Python (the word hashes, then their bits)."""
    seed, p = int(case["seed"]), case["param_index"]
    assert VECTORS_V2["version"] == 2 and 2 in rng.VERSIONS
    assert rng.sign_bits(seed, p, 64, version=2).tolist() == case["sign_bits_0_64"]
    assert rng.sign_bits(seed, p, 64, offset=2**32 - 64, version=2).tolist() == case["sign_bits_last_64"]
    signs = rng.sign_bits(seed, p, 1 << 20, version=2).to(torch.uint8).numpy()
    assert hashlib.sha256(np.packbits(signs).tobytes()).hexdigest() == case["sign_bits_2_20_sha256"]
    assert int(rng.rademacher(seed, p, 1 << 20, version=2).sum()) == case["sign_sum_2_20"]
    # Versions 3 and 4 have version 2's signs (they differ in how an apply sums them): its vectors too.
    for version in (3, 4):
        assert rng.sign_bits(seed, p, 64, offset=2**32 - 64, version=version).tolist() == case["sign_bits_last_64"]
        signs = rng.sign_bits(seed, p, 1 << 20, version=version).to(torch.uint8).numpy()
        assert hashlib.sha256(np.packbits(signs).tobytes()).hexdigest() == case["sign_bits_2_20_sha256"]


@pytest.mark.parametrize("version", rng.VERSIONS)
def test_streams_look_independent(version: int) -> None:
    # Deterministic inputs, so these bounds either hold or never do: 6 standard deviations.
    n = 1 << 20
    bound = 6 / n**0.5
    z = rng.rademacher(7, 0, n, version=version, dtype=torch.float64)
    others = [
        rng.rademacher(8, 0, n, version=version, dtype=torch.float64),  # next seed
        rng.rademacher(7, 1, n, version=version, dtype=torch.float64),  # next parameter
        rng.rademacher(7 + (1 << 32), 0, n, version=version, dtype=torch.float64),  # high word of the seed
        rng.rademacher(7, 0, n, offset=1, version=version, dtype=torch.float64),  # the neighbouring element
        rng.rademacher(7, 0, n, offset=32, version=version, dtype=torch.float64),  # the next word's
    ]
    assert abs(float(z.mean())) < bound
    for other in others:
        assert abs(float((z * other).mean())) < bound


def test_out_of_range_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="seed"):
        rng.key(2**64, 0)
    with pytest.raises(ValueError, match="seed"):
        rng.key(-1, 0)
    with pytest.raises(ValueError, match="element indices"):
        rng.bits(0, 0, 2, offset=2**32 - 1)


def test_keys_at_once_are_the_definitions_keys() -> None:
    """rng.param_keys (torch integer ops, on any device) against key() for seeds at the edges."""
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15, 12345]
    halves = rng.seed_halves(seeds)
    for p in range(5):
        pairs = rng.param_keys(halves, p)
        assert pairs.shape == (2, len(seeds))
        assert [tuple(pair) for pair in pairs.T.tolist()] == [rng.key(seed, p) for seed in seeds]
    assert rng.param_keys(rng.seed_halves([]), 3).shape == (2, 0)
    with pytest.raises(ValueError, match="seeds"):
        rng.seed_halves([2**64])
    with pytest.raises(ValueError, match="parameter indices"):
        rng.param_keys(halves, 2**32)
    # many parameters' keys at once: each one's as alone, up to the last index there is
    for first in (0, 7, 2**32 - 3):
        many = rng.params_keys(halves, first, 3)
        assert many.shape == (3, 2, len(seeds))
        assert all(torch.equal(many[j], rng.param_keys(halves, first + j)) for j in range(3))
    assert rng.params_keys(halves, 5, 0).shape == (0, 2, len(seeds))
    for first, count in ((2**32 - 2, 3), (-1, 2)):
        with pytest.raises(ValueError, match="parameter indices"):
            rng.params_keys(halves, first, count)
        with pytest.raises(ValueError, match="parameter indices"):
            rng.params_keys_host(seeds, first, count)
    # the host's NumPy derivation: the same values, whatever the seeds and indices
    for first in (0, 7, 2**32 - 3):
        host = rng.params_keys_host(seeds, first, 3)
        assert host.dtype == np.uint32 and host.shape == (3, 2, len(seeds))
        assert np.array_equal(host.astype(np.int64), rng.params_keys(halves, first, 3).numpy())
    assert rng.params_keys_host([], 0, 4).shape == (4, 2, 0) and rng.params_keys_host(seeds, 3, 0).shape == (0, 2, 8)
    with pytest.raises(ValueError, match="seeds"):
        rng.params_keys_host([2**64], 0, 1)


@given(st.lists(st.integers(0, 2**64 - 1), max_size=6), st.integers(0, 2**32 - 4))
def test_host_keys_are_the_definitions_keys_for_any_seed(seeds: list[int], first: int) -> None:
    host = rng.params_keys_host(seeds, first, 3)
    assert [[tuple(pair) for pair in host[j].T.tolist()] for j in range(3)] == [
        [rng.key(seed, first + j) for seed in seeds] for j in range(3)
    ]
