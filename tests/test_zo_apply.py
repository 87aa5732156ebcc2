"""Applying K updates in one pass: the canonical arithmetic, chunking, and the GPU kernel."""

import pytest
import torch

from kernels import rng, zo_apply

SEEDS = [3, 99, 2**63 + 5, 12345]
GS = [0.5, -1.25, 3.0, -0.001]


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


@pytest.mark.parametrize(("version", "chunk"), [(1, 7), (2, 7), (2, 64)])
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
        zo_apply.apply(params(), SEEDS, coeffs, version=3)


def test_order_is_part_of_the_rule() -> None:
    # The log's canonical order matters in floating point: peers must agree on it.
    theta = [torch.zeros(4096)]
    coeffs = zo_apply.coefficients(1.0, [1e-8, 1.0, -1.0])
    zo_apply.apply_reference(theta, [1, 2, 2], coeffs)
    zo_apply.apply_reference(reordered := [torch.zeros(4096)], [2, 2, 1], coeffs[[1, 2, 0]])
    assert not torch.equal(theta[0], reordered[0])


def test_no_updates_change_nothing_and_bad_inputs_are_refused() -> None:
    theta = params()
    before = [t.clone() for t in theta]
    zo_apply.apply_reference(theta, [], zo_apply.coefficients(1.0, []))
    assert all(torch.equal(a, b) for a, b in zip(theta, before, strict=True))
    with pytest.raises(ValueError, match="coefficients"):
        zo_apply.apply_reference(theta, [1, 2], zo_apply.coefficients(1.0, [1.0]))
    with pytest.raises(ValueError, match="float32"):
        zo_apply.apply_reference([torch.zeros(3, dtype=torch.float64)], [1], zo_apply.coefficients(1.0, [1.0]))


@pytest.mark.skipif(not torch.cuda.is_available() or zo_apply.triton is None, reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("num_updates", [1, 8, 64])
def test_the_fused_kernel_gives_the_reference_bits(num_updates: int) -> None:
    gen = torch.Generator().manual_seed(num_updates)
    theta = [torch.randn(n, generator=gen) for n in (1, 1000, 3 * 1024 + 7, 1 << 20)]
    seeds = [int(s) for s in torch.randint(0, 2**62, (num_updates,), generator=gen)]
    coeffs = zo_apply.coefficients(1e-3, torch.randn(num_updates, generator=gen).tolist())
    on_gpu = [t.cuda() for t in theta]
    zo_apply.apply_reference(theta, seeds, coeffs)
    zo_apply.apply_triton(on_gpu, seeds, coeffs)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(theta, on_gpu, strict=True))


def test_the_compiled_cpu_path_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    eager, compiled = params(), params()
    coeffs = zo_apply.coefficients(0.1, GS)
    zo_apply.apply_reference(eager, SEEDS, coeffs)
    monkeypatch.setattr(zo_apply, "COMPILE_ABOVE", 0)  # every call takes the compiled generator
    zo_apply.apply_reference(compiled, SEEDS, coeffs)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
