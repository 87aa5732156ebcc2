"""training/finite.py: one pass, the same verdict as ``torch.isfinite(t).all()``."""

import pytest
import torch

from training.finite import all_finite, all_finite_each

CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the 1-norm path)")
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
@pytest.mark.parametrize("where", [0, 4_999, 10_000 - 1])
def test_the_verdict_is_isfinite_alls_wherever_the_bad_value_is(
    device: str, dtype: torch.dtype, bad: float | None, where: int
) -> None:
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(where)).to(device, dtype)
    if bad is not None:
        t[where] = bad
    assert all_finite(t) == bool(torch.isfinite(t).all()) == (bad is None)
    assert all_finite(t.view(100, 100)) == (bad is None)


def test_empty_integer_and_huge_but_finite_tensors_are_finite() -> None:
    assert all_finite(torch.zeros(0)) and all_finite(torch.arange(5))
    assert all_finite(torch.tensor([torch.finfo(torch.float32).max, torch.finfo(torch.float32).min]))
    assert not all_finite(torch.tensor([float("nan")] * 3))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_one_bad_tensor_among_many_of_mixed_dtypes_is_found(device: str) -> None:
    tensors = [
        torch.randn(1_000 + k, dtype=torch.float32 if k % 3 else torch.bfloat16, device=device) for k in range(40)
    ]
    assert all_finite_each(tensors)
    for k in (0, 17, 39):
        for bad in (float("nan"), float("-inf")):
            spoiled = [t.clone() for t in tensors]
            spoiled[k][k] = bad
            assert not all_finite_each(spoiled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the 1-norm path)")
def test_on_a_gpu_a_sum_of_magnitudes_past_float32s_range_counts_as_not_finite() -> None:
    """The documented edge of the 1-norm (training/finite.py): finite values whose absolute
    sum overflows are refused as if one were infinite; one such value alone is finite."""
    big = torch.finfo(torch.float32).max
    assert all_finite(torch.tensor([big, 0.0], device="cuda"))
    assert not all_finite(torch.tensor([big, -big], device="cuda"))
