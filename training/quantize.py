"""Blockwise int8 quantization of outer payloads: 4× fewer bytes on the wire.

A flat float32 payload is cut into blocks of ``BLOCK`` values; each block keeps one float32
scale (its largest magnitude / 127) and one int8 per value, rounded to nearest. Error per
value is at most half a step: scale / 2 = max|block| / 254.

For NoLoCo both sides of a pair must average the *same* numbers, so a node that sends a
quantized payload also uses the dequantized version of its own payload in its outer step
(``roundtrip``); then mean(φ_i, φ_j) is identical on both sides and the γ term still
preserves the pair's mean exactly.
"""

import torch

from training.finite import all_finite

BLOCK = 256


def quantize(flat: torch.Tensor, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (n,) → (int8 (n,), float32 scales (ceil(n / block),)). Rejects non-finite input."""
    if flat.dtype != torch.float32 or flat.dim() != 1:
        raise ValueError(f"expected a flat float32 tensor, got {flat.dtype} × {tuple(flat.shape)}")
    if not all_finite(flat):
        raise ValueError("cannot quantize NaN or Inf")
    padded = torch.nn.functional.pad(flat, (0, (-len(flat)) % block)).view(-1, block)
    scales = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[: len(flat)], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, block: int = BLOCK) -> torch.Tensor:
    """The inverse of ``quantize`` (up to rounding); checks that the pieces fit together."""
    if codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.dim() != 1 or scales.dim() != 1:
        raise ValueError("expected int8 codes and float32 scales, both flat")
    if len(scales) != -(-len(codes) // block):
        raise ValueError(f"{len(codes)} codes need {-(-len(codes) // block)} scales, got {len(scales)}")
    # Exactly finite, on any device (a GPU's ``all_finite`` is a 1-norm, which refuses
    # finite scales whose sum overflows: the host's path would take those; scales are few).
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise ValueError("scales must be finite and non-negative")
    padded = torch.nn.functional.pad(codes, (0, (-len(codes)) % block)).view(-1, block).to(torch.float32)
    return (padded * scales[:, None]).view(-1)[: len(codes)]


def roundtrip(flat: torch.Tensor, *, block: int = BLOCK) -> torch.Tensor:
    """What the partner will see: use it for our own side of the average too."""
    return dequantize(*quantize(flat, block=block), block=block)
