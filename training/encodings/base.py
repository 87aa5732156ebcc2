"""What an outer payload encoding offers (training/trainer.py uses nothing else)."""

from typing import Protocol

import torch


class Encoding(Protocol):
    name: str
    lossy: bool
    """The partner sees other values than ours: both sides then use what was sent (``encode``'s
    second result) in place of their own φ and Δ, so a pair averages the same numbers."""

    def nbytes(self, numels: list[int]) -> int:
        """Wire bytes of a payload of float32 pieces of these sizes."""
        ...

    def encode(self, flat: torch.Tensor, numels: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 (Σ numels,) → (uint8 wire bytes of ``nbytes``, what the partner will decode:
        None when it is ``flat`` exactly)."""
        ...

    def decode(self, wire: torch.Tensor, numels: list[int]) -> torch.Tensor:
        """uint8 wire bytes (``nbytes`` long, checked by the caller) → float32 (Σ numels,);
        ``ValueError`` if the pieces do not fit together. May hold NaN or Inf: the caller checks."""
        ...
