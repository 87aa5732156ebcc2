"""Blockwise int8 (training/quantize.py): the int8 codes of every piece, then the float32
block scales of every piece, n + 4·Σ⌈n_k / 256⌉ bytes (≈ 3.9× fewer than float32).

Blocks are cut per piece k (each parameter's φ, then each one's Δ), so a LayerNorm weight
near 1 never sets the step of an embedding near 0.02.
"""

from typing import Any

import torch

from training.quantize import BLOCK, dequantize, quantize


def _blocks(numels: list[int]) -> list[int]:
    return [-(-n // BLOCK) for n in numels]


class Int8Blocks:
    name = "int8"
    lossy = True

    def nbytes(self, numels: list[int]) -> int:
        return sum(numels) + 4 * sum(_blocks(numels))

    def encode(
        self, flat: torch.Tensor, numels: list[int], *, round_index: int = 0, state: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pieces = [quantize(part) for part in torch.split(flat.to(torch.float32), numels)]
        codes = torch.cat([c for c, _ in pieces])
        scales = torch.cat([s for _, s in pieces])
        seen = torch.cat([dequantize(c, s) for c, s in pieces])
        return torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)]).cpu(), seen

    def decode(self, wire: torch.Tensor, numels: list[int], *, fill: torch.Tensor | None = None) -> torch.Tensor:
        total = sum(numels)
        codes = torch.split(wire[:total].view(torch.int8), numels)
        scales = torch.split(wire[total:].clone().view(torch.float32), _blocks(numels))  # clone: aligned
        return torch.cat([dequantize(c, s) for c, s in zip(codes, scales, strict=True)])


ENCODING = Int8Blocks()
