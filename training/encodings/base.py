"""What an outer payload encoding offers (training/trainer.py uses nothing else)."""

from typing import Any, Protocol

import torch


class Encoding(Protocol):
    name: str
    lossy: bool
    """The partner sees other values than ours: both sides then use what was sent (``encode``'s
    second result) in place of their own φ and Δ, so a pair averages the same numbers."""

    def nbytes(self, numels: list[int]) -> int:
        """Wire bytes of a payload of float32 pieces of these sizes."""
        ...

    def encode(
        self, flat: torch.Tensor, numels: list[int], *, round_index: int = 0, state: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 (Σ numels,) → (uint8 wire bytes of ``nbytes``, what the partner will decode:
        None when it is ``flat`` exactly). ``state``: the sender's own, kept between rounds
        (and in its checkpoint: its tensors), for encodings that remember: called once a
        round (the trainer keeps the round's payload). ``state["residual"]``, if set, is
        the part of Δ the payload left out (flat, Δ's size): after an outer step with a
        partner the trainer keeps it in θ (θ ← φ − residual), so it is sent later."""
        ...

    def decode(self, wire: torch.Tensor, numels: list[int], *, fill: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 wire bytes (``nbytes`` long, checked by the caller) → float32 (Σ numels,);
        ``ValueError`` if the pieces do not fit together. May hold NaN or Inf: the caller checks.
        ``fill``: our own payload as we sent it (``encode``'s second result, or ours exactly),
        for what an encoding leaves out of a payload (sparseloco: most of φ)."""
        ...
