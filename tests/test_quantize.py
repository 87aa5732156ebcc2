"""Blockwise int8 quantization: error bound, shapes, bad input, and pair symmetry."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from training.quantize import BLOCK, dequantize, quantize, roundtrip


@given(st.integers(min_value=1, max_value=3 * BLOCK + 7), st.integers(min_value=0, max_value=2**31 - 1))
def test_error_is_at_most_half_a_step_per_block(n: int, seed: int) -> None:
    flat = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10
    codes, scales = quantize(flat)
    assert codes.dtype == torch.int8 and codes.shape == (n,) and scales.shape == (-(-n // BLOCK),)
    error = (dequantize(codes, scales) - flat).abs()
    bound = scales.repeat_interleave(BLOCK)[:n] / 2 + 1e-6
    assert bool((error <= bound).all())


def test_zero_blocks_and_exact_values_survive() -> None:
    flat = torch.zeros(2 * BLOCK)
    flat[BLOCK] = 127.0  # the block's maximum maps to exactly 127 · scale
    restored = roundtrip(flat)
    assert torch.equal(restored[:BLOCK], torch.zeros(BLOCK))
    assert restored[BLOCK].item() == 127.0


def test_both_sides_of_a_pair_average_the_same_numbers() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    # Each side averages its own roundtripped payload with the dequantized one it received.
    mean_at_a = (roundtrip(a) + dequantize(*quantize(b))) / 2
    mean_at_b = (dequantize(*quantize(a)) + roundtrip(b)) / 2
    assert torch.equal(mean_at_a, mean_at_b)


@pytest.mark.parametrize(
    ("flat", "message"),
    [
        (torch.tensor([1.0, float("nan")]), "NaN"),
        (torch.tensor([1.0, float("inf")]), "NaN or Inf"),
        (torch.zeros(3, dtype=torch.float64), "float32"),
        (torch.zeros(2, 2), "flat"),
    ],
)
def test_bad_input_is_refused(flat: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(flat)


def test_mismatched_or_poisoned_pieces_are_refused() -> None:
    codes, scales = quantize(torch.randn(BLOCK + 1))
    with pytest.raises(ValueError, match="scales"):
        dequantize(codes, scales[:1])
    with pytest.raises(ValueError, match="finite"):
        dequantize(codes, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="int8"):
        dequantize(codes.to(torch.int16), scales)
