"""Applying K updates in one pass: the canonical arithmetic, chunking, and the GPU kernel."""

import itertools

import numpy as np
import pytest
import torch

from kernels import rng, zo_apply

SEEDS = [3, 99, 2**63 + 5, 12345]
GS = [0.5, -1.25, 3.0, -0.001]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # torch.equal(0.0, -0.0) is True


def params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in [(17, 5), (300,), (4, 4, 4)]]


@pytest.mark.parametrize("version", rng.VERSIONS)
def test_the_update_is_theta_minus_the_sum_of_lr_g_z(version: int) -> None:
    theta = params()
    coeffs = zo_apply.coefficients(1e-2, GS)
    expected = [
        t.double()
        - sum(
            float(c) * rng.rademacher(s, p, t.numel(), version=version, dtype=torch.float64).view_as(t)
            for s, c in zip(SEEDS, coeffs, strict=True)
        )
        for p, t in enumerate(theta)
    ]
    zo_apply.apply_reference(theta, SEEDS, coeffs, version=version)
    for got, want in zip(theta, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("version", "chunk"), [(1, 7), (2, 7), (2, 64), (3, 7), (4, 7)])
def test_chunking_does_not_change_a_bit(monkeypatch: pytest.MonkeyPatch, version: int, chunk: int) -> None:
    whole, chunked = params(), params()
    coeffs = zo_apply.coefficients(0.1, GS)
    zo_apply.apply_reference(whole, SEEDS, coeffs, version=version)
    monkeypatch.setattr(zo_apply, "CHUNK", chunk)
    zo_apply.apply_reference(chunked, SEEDS, coeffs, version=version)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))


def test_the_generators_differ_and_an_unknown_one_is_refused() -> None:
    one, two = params(), params()
    coeffs = zo_apply.coefficients(0.1, GS)
    zo_apply.apply(one, SEEDS, coeffs, version=1)
    zo_apply.apply(two, SEEDS, coeffs, version=2)
    assert not torch.equal(one[1], two[1])
    with pytest.raises(ValueError, match="generator version"):
        zo_apply.apply(params(), SEEDS, coeffs, version=5)


def _by_the_definition(
    theta: torch.Tensor, p: int, seeds: list[int], coeffs: torch.Tensor, ends: list[int], size: int
) -> torch.Tensor:
    """Versions 3 and 4 element by element, in NumPy float32 scalars, signs from the
    pure-Python generator: per group, chunks of ``size`` updates each summed from +0.0, the
    parts summed from +0.0, θ − acc."""
    out = theta.numpy().copy()
    c = coeffs.numpy()
    for e in range(out.size):
        for begin, end in itertools.pairwise([0, *ends]):
            acc = np.float32(0.0)
            for first in range(begin, end, size):
                part = np.float32(0.0)
                for k in range(first, min(first + size, end)):
                    part = np.float32(part + (-c[k] if rng.sign_bit_int(seeds[k], p, e, 2) else c[k]))
                acc = np.float32(acc + part)
            out[e] = np.float32(out[e] - acc)
    return torch.from_numpy(out)


@pytest.mark.parametrize(("version", "size"), sorted(zo_apply.CHUNK_UPDATES.items()))
def test_versions_3_and_4_sum_each_group_in_chunks(version: int, size: int) -> None:
    """Versions 3 and 4 (chunks of 8 and 4), bit for bit, against their definition written
    out. The first group's chunks round otherwise than one running sum: 1.0 (and ``size`` − 1
    updates of 0.0) in chunk 0, then 8 of 2**-25 in the next chunk(s). Summed one by one
    after ±1.0, each 2**-25 is at most half an ulp and goes (a tie rounds to 1.0, even); a
    chunk's part is their exact sum k·2**-25, and for many k (|k| ≥ 4 always, k = ±2 on one
    side of 1.0) ±1.0 + part is another float."""
    gen = torch.Generator().manual_seed(3)
    lead = size + 8  # chunk 0, then 8 small updates (one chunk of 8 or two of 4)
    seeds = [int(s) for s in torch.randint(0, 2**62, (lead + 12,), generator=gen)]
    coeffs = torch.tensor(
        [1.0, *([0.0] * (size - 1)), *([2.0**-25] * 8), *(torch.randn(12, generator=gen) * 1e-3).tolist()]
    )
    ends = [lead, lead + 12]
    theta = torch.randn(2000, generator=gen)
    chunked = [theta.clone()]
    zo_apply.apply_reference(chunked, seeds, coeffs, version=version, ends=ends)
    assert same_bits(chunked[0], _by_the_definition(theta, 0, seeds, coeffs, ends, size))
    first_chunked, first_two = [theta.clone()], [theta.clone()]
    zo_apply.apply_reference(first_chunked, seeds[:lead], coeffs[:lead], version=version)
    zo_apply.apply_reference(first_two, seeds[:lead], coeffs[:lead], version=2)
    differ = (first_chunked[0].view(torch.int32) != first_two[0].view(torch.int32)).sum().item()
    assert differ > 300  # the chunks are part of the rule (θ − acc rounds some apart back)


def test_versions_3_and_4_calls_are_bounded_alike_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels index their tables in int32, so a call's updates are bounded, and every
    implementation refuses the same calls (a GPU peer must not refuse what a CPU peer
    applies); the worker's largest call fits under the bound."""
    from training.algorithms.zo import MAX_UPDATES_PER_ROUND, REPLAY_BATCH_UPDATES

    assert REPLAY_BATCH_UPDATES + MAX_UPDATES_PER_ROUND <= zo_apply.MAX_CHUNKED_UPDATES
    assert zo_apply.MAX_CHUNKED_UPDATES * max(1 << size for size in zo_apply.CHUNK_UPDATES.values()) < 2**31
    monkeypatch.setattr(zo_apply, "MAX_CHUNKED_UPDATES", 4)
    coeffs = zo_apply.coefficients(1e-3, [1.0] * 5)
    for apply in (zo_apply.apply_reference, zo_apply.apply_cpu):
        for version in zo_apply.CHUNK_UPDATES:
            with pytest.raises(ValueError, match="at most 4 updates"):
                apply(params(), [1, 2, 3, 4, 5], coeffs, version=version)
        apply(params(), [1, 2, 3, 4, 5], coeffs, version=2)  # the others have no such bound


def test_a_host_that_flushes_subnormals_is_refused() -> None:
    """Fast-math libraries can make the whole process flush subnormals to zero; its sums
    would then differ from peers' without a word."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals (nothing to guard against)")
    try:
        for apply, version in itertools.product((zo_apply.apply_reference, zo_apply.apply_cpu), (3, 4)):
            with pytest.raises(RuntimeError, match="subnormals"):
                apply(params(), SEEDS, zo_apply.coefficients(1e-3, GS), version=version)
        with pytest.raises(RuntimeError, match="subnormals"):
            zo_apply.chunk_tables(np.ones(3, dtype=np.float32), [0, 3])
    finally:
        torch.set_flush_denormal(False)
    zo_apply.apply_cpu(params(), SEEDS, zo_apply.coefficients(1e-3, GS), version=3)


@pytest.mark.parametrize(("version", "sizes"), [(3, [8, 1, 0, 5, 3]), (4, [4, 1, 0, 3, 2])])
def test_versions_3_and_4_are_version_2_for_groups_of_one_chunk(version: int, sizes: list[int]) -> None:
    """A ZO step's round of a few updates: the same bits under both (+0.0 + part is part)."""
    gen = torch.Generator().manual_seed(8)
    seeds = [int(s) for s in torch.randint(0, 2**62, (sum(sizes),), generator=gen)]
    coeffs = torch.tensor((SPECIAL_COEFFS + (torch.randn(17, generator=gen) * 1e-3).tolist())[: sum(sizes)])
    ends = list(itertools.accumulate(sizes))
    two, chunked = params(), params()
    zo_apply.apply_reference(two, seeds, coeffs, version=2, ends=ends)
    zo_apply.apply_cpu(chunked, seeds, coeffs, version=version, ends=ends)
    assert all(same_bits(a, b) for a, b in zip(two, chunked, strict=True))


def test_a_chunks_table_holds_its_parts_and_ignores_its_spare_slots() -> None:
    """``chunk_tables``: entry b of a chunk is its part for the signs in b, bit j for update
    j, summed as the definition sums; a short chunk's spare slots point at a real update and
    change no entry; the groups' chunk edges."""
    coeffs = np.array(SPECIAL_COEFFS[:11], dtype=np.float32)  # ±0, subnormals, ±3e38 (sums to ±inf)
    tables, chunk_edges, slots = zo_apply.chunk_tables(coeffs, [0, 3, 3, 11])
    assert chunk_edges == [0, 1, 1, 2] and tables.shape == (2, 256)
    with pytest.raises(ValueError, match="group ends"):
        zo_apply.chunk_tables(coeffs, [0, 5, 3, 11])
    assert slots.tolist() == [[0, 1, 2, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8, 9, 10]]
    _assert_parts(tables, coeffs, [(0, 3), (3, 11)])
    # chunks of 4 (version 4): 16 entries, the same sums
    tables, chunk_edges, slots = zo_apply.chunk_tables(coeffs, [0, 3, 3, 11], 4)
    assert chunk_edges == [0, 1, 1, 3] and tables.shape == (3, 16)
    assert slots.tolist() == [[0, 1, 2, 0], [3, 4, 5, 6], [7, 8, 9, 10]]
    _assert_parts(tables, coeffs, [(0, 3), (3, 7), (7, 11)])


def _assert_parts(tables: np.ndarray, coeffs: np.ndarray, chunks: list[tuple[int, int]]) -> None:
    """Entry b of chunk c is the sum, from +0.0 in order, of ±c_j (− where bit j of b is set)."""
    for c, (first, last) in enumerate(chunks):
        for b in range(tables.shape[1]):
            part = np.float32(0.0)
            with np.errstate(over="ignore"):
                for j in range(last - first):
                    part = np.float32(part + (-coeffs[first + j] if b >> j & 1 else coeffs[first + j]))
            assert tables[c, b].view(np.int32) == part.view(np.int32), (c, b)


def test_order_is_part_of_the_rule() -> None:
    # The log's canonical order matters in floating point: peers must agree on it.
    theta = [torch.zeros(4096)]
    coeffs = zo_apply.coefficients(1.0, [1e-8, 1.0, -1.0])
    zo_apply.apply_reference(theta, [1, 2, 2], coeffs)
    zo_apply.apply_reference(reordered := [torch.zeros(4096)], [2, 2, 1], coeffs[[1, 2, 0]])
    assert not torch.equal(theta[0], reordered[0])


@pytest.mark.parametrize("version", rng.VERSIONS)
def test_groups_in_one_call_give_the_bits_of_one_call_per_group(version: int) -> None:
    """A replay applies many rounds in one pass; each round is still its own sum."""
    gen = torch.Generator().manual_seed(version)
    sizes = [2, 0, 3, 1, 4]  # an empty group changes nothing
    seeds = [int(s) for s in torch.randint(0, 2**62, (sum(sizes),), generator=gen)]
    coeffs = torch.randn(sum(sizes), generator=gen) * 1e-2
    ends = list(itertools.accumulate(sizes))
    one_by_one, grouped, summed = params(), params(), params()
    for begin, end in zip([0, *ends[:-1]], ends, strict=True):
        zo_apply.apply_reference(one_by_one, seeds[begin:end], coeffs[begin:end], version=version)
    zo_apply.apply_reference(grouped, seeds, coeffs, version=version, ends=ends)
    assert all(same_bits(a, b) for a, b in zip(one_by_one, grouped, strict=True))
    zo_apply.apply_reference(summed, seeds, coeffs, version=version)  # one group: other bits
    assert not all(same_bits(a, b) for a, b in zip(one_by_one, summed, strict=True))


def test_group_ends_must_rise_to_the_number_of_updates() -> None:
    coeffs = zo_apply.coefficients(1.0, [1.0, 2.0, 3.0])
    for ends in ([], [2], [1, 4], [2, 1, 3], [-1, 3]):
        with pytest.raises(ValueError, match="group ends"):
            zo_apply.apply_reference(params(), [1, 2, 3], coeffs, ends=ends)
    assert zo_apply.bounds([0, 3, 3], 3) == [0, 0, 3, 3]
    assert zo_apply.bounds(None, 3) == [0, 3]


def test_no_updates_change_nothing_and_bad_inputs_are_refused() -> None:
    theta = params()
    before = [t.clone() for t in theta]
    zo_apply.apply_reference(theta, [], zo_apply.coefficients(1.0, []))
    assert all(torch.equal(a, b) for a, b in zip(theta, before, strict=True))
    with pytest.raises(ValueError, match="coefficients"):
        zo_apply.apply_reference(theta, [1, 2], zo_apply.coefficients(1.0, [1.0]))
    with pytest.raises(ValueError, match="float32"):
        zo_apply.apply_reference([torch.zeros(3, dtype=torch.float64)], [1], zo_apply.coefficients(1.0, [1.0]))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or zo_apply.triton is None, reason="needs CUDA and Triton")
# Coefficients the kernels must treat exactly as the reference: ±0 (the xor of the sign bit
# must give −0.0 for −(+0.0)), subnormals (no flush to zero), and sums that overflow to ±inf.
SPECIAL_COEFFS = [0.0, -0.0, 1e-45, -1e-45, 2.0**-140, -(2.0**-127), 1.1754942e-38, 3e38, -3e38, 1e30, -0.5, 1e-3]


@needs_gpu
@pytest.mark.parametrize("version", rng.VERSIONS)
@pytest.mark.parametrize("num_updates", [1, 3, 8, 64])
def test_the_triton_kernels_give_the_reference_bits_on_cuda(
    monkeypatch: pytest.MonkeyPatch, version: int, num_updates: int
) -> None:
    gen = torch.Generator().manual_seed(num_updates)
    pool = SPECIAL_COEFFS + (torch.randn(64, generator=gen) * 1e-3).tolist()
    # every special coefficient in some call, whatever K is
    windows = [pool[i : i + num_updates] for i in range(0, len(SPECIAL_COEFFS), num_updates)]
    for window in windows if num_updates < len(SPECIAL_COEFFS) else [pool[:num_updates]]:
        coeffs = torch.tensor(window, dtype=torch.float32)
        seeds = [int(s) for s in torch.randint(0, 2**62, (num_updates,), generator=gen)]
        # sizes off a multiple of 32 (a word) and of every block, and θ of ±0, subnormals, ±big
        theta = [torch.randn(n, generator=gen) for n in (1, 31, 33, 1000, 3 * 1024 + 7, (1 << 20) + 5)]
        theta.append(torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0, -1.0] * 5))
        expected = [t.clone() for t in theta]
        zo_apply.apply_reference(expected, seeds, coeffs, version=version)
        # keys from the host in the packed upload (a step's few), then from the device's ops (a replay's many)
        for block, host_keys, coalesced in (
            (None, True, True),
            (4096, True, True),
            (1024, True, True),
            (32, True, True),
            (None, False, True),
            (None, True, False),  # the tiles loaded one by one (bench/zo_apply.py's comparison)
        ):
            monkeypatch.setattr(zo_apply, "HOST_KEYS", 1 << 16 if host_keys else 0)
            monkeypatch.setattr(zo_apply, "COALESCED_TILES", coalesced)
            on_gpu = [t.cuda() for t in theta]
            zo_apply.apply_triton(on_gpu, seeds, coeffs, version=version, block=block)
            assert all(same_bits(a, b.cpu()) for a, b in zip(expected, on_gpu, strict=True)), (
                window,
                block,
                host_keys,
                coalesced,
            )
        # the same updates as groups (a replay's rounds in one launch): the bits of one call a group
        ends = [len(seeds) // 3, len(seeds) // 3, len(seeds)]  # the middle group empty
        monkeypatch.setattr(zo_apply, "COALESCED_TILES", True)
        grouped = [t.clone() for t in theta]
        zo_apply.apply_reference(grouped, seeds, coeffs, version=version, ends=ends)
        for host_keys in (True, False):
            monkeypatch.setattr(zo_apply, "HOST_KEYS", 1 << 16 if host_keys else 0)
            on_gpu = [t.cuda() for t in theta]
            zo_apply.apply_triton(on_gpu, seeds, coeffs, version=version, ends=ends)
            assert all(same_bits(a, b.cpu()) for a, b in zip(grouped, on_gpu, strict=True)), (window, ends, host_keys)


@needs_gpu
@pytest.mark.parametrize("version", rng.VERSIONS)
def test_apply_takes_the_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    theta = [t.cuda() for t in params()]
    expected = [t.clone() for t in theta]
    coeffs = zo_apply.coefficients(0.1, GS)
    zo_apply.apply_reference(expected, SEEDS, coeffs, version=version)

    def no_reference(*args: object, **kwargs: object) -> None:
        raise AssertionError("apply took the reference on CUDA")

    monkeypatch.setattr(zo_apply, "apply_reference", no_reference)
    zo_apply.apply(theta, SEEDS, coeffs, version=version)
    assert all(same_bits(a, b) for a, b in zip(expected, theta, strict=True))


@pytest.mark.parametrize("version", rng.VERSIONS)
@pytest.mark.parametrize("chunk", [32, 64, 1 << 16])
def test_the_numpy_cpu_path_gives_the_reference_bits(monkeypatch: pytest.MonkeyPatch, version: int, chunk: int) -> None:
    """apply_cpu (NumPy uint32, what ``apply`` takes on a CPU) against the torch reference,
    bit for bit: special coefficients and weights, sizes off a word and a chunk, groups."""
    monkeypatch.setattr(zo_apply, "CPU_CHUNK", chunk)
    gen = torch.Generator().manual_seed(chunk + version)
    for sizes in ([1], [3], [12], [2, 0, 5, 1], [0], [17, 8]):
        coeffs = torch.tensor((SPECIAL_COEFFS + (torch.randn(16, generator=gen) * 1e-3).tolist())[: sum(sizes)])
        seeds = [int(s) for s in torch.randint(0, 2**62, (sum(sizes),), generator=gen)]
        seeds[:1] = [2**64 - 1] * len(seeds[:1])  # the largest seed, where there is one
        theta = [torch.randn(n, generator=gen) for n in (1, 31, 33, 1000, 3 * 1024 + 7, 70_001)]
        theta.append(torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0, -1.0] * 5))
        expected, got = [t.clone() for t in theta], [t.clone() for t in theta]
        ends = list(itertools.accumulate(sizes))
        zo_apply.apply_reference(expected, seeds, coeffs, version=version, ends=ends)
        zo_apply.apply_cpu(got, seeds, coeffs, version=version, ends=ends)
        assert all(same_bits(a, b) for a, b in zip(expected, got, strict=True)), sizes


def test_apply_takes_the_numpy_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    theta, expected = params(), params()
    coeffs = zo_apply.coefficients(0.1, GS)
    zo_apply.apply_reference(expected, SEEDS, coeffs)

    def no_reference(*args: object, **kwargs: object) -> None:
        raise AssertionError("apply took the torch reference on a CPU")

    monkeypatch.setattr(zo_apply, "apply_reference", no_reference)
    zo_apply.apply(theta, SEEDS, coeffs)
    assert all(same_bits(a, b) for a, b in zip(expected, theta, strict=True))
    with pytest.raises(ValueError, match="generator version"):
        zo_apply.apply_cpu(theta, SEEDS, coeffs, version=5)


def test_no_updates_leave_even_a_signalling_nan_as_it_is() -> None:
    """θ − 0 would quiet a signalling NaN in the reference; the NumPy path and the kernels
    return before touching θ: every implementation leaves it bit for bit (a second reader's)."""
    signalling = torch.tensor([0x7F800001, 0x3F800000], dtype=torch.int32).view(torch.float32)
    for apply in (zo_apply.apply_reference, zo_apply.apply_cpu):
        theta = [signalling.clone()]
        apply(theta, [], zo_apply.coefficients(1.0, []))
        assert same_bits(theta[0], signalling), apply.__name__


def test_group_ends_and_g_codes_must_be_integers() -> None:
    from training import zo
    from training.settings import ZoConfig

    with pytest.raises(TypeError):
        zo_apply.bounds([1.5, 3], 3)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        zo.coefficients([1.5], ZoConfig(lr=1e-3))  # type: ignore[list-item]
