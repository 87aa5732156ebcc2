"""training/finite.py: one pass, the same verdict as ``torch.isfinite(t).all()``."""

import pytest
import torch

from training.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
@pytest.mark.parametrize("where", [0, 4_999, 10_000 - 1])
def test_the_verdict_is_isfinite_alls_wherever_the_bad_value_is(
    dtype: torch.dtype, bad: float | None, where: int
) -> None:
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(where)).to(dtype)
    if bad is not None:
        t[where] = bad
    assert all_finite(t) == bool(torch.isfinite(t).all()) == (bad is None)
    assert all_finite(t.view(100, 100)) == (bad is None)


def test_empty_integer_and_huge_but_finite_tensors_are_finite() -> None:
    assert all_finite(torch.zeros(0)) and all_finite(torch.arange(5))
    assert all_finite(torch.tensor([torch.finfo(torch.float32).max, torch.finfo(torch.float32).min]))
    assert not all_finite(torch.tensor([float("nan")] * 3))
