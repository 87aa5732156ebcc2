"""No compression: φ then Δ as little-endian float32, 4 bytes a value."""

from typing import Any

import torch


class Float32:
    name = "none"
    lossy = False

    def nbytes(self, numels: list[int]) -> int:
        return 4 * sum(numels)

    def encode(
        self, flat: torch.Tensor, numels: list[int], *, round_index: int = 0, state: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return flat.to(torch.float32).cpu().view(torch.uint8), None

    def decode(self, wire: torch.Tensor, numels: list[int], *, fill: torch.Tensor | None = None) -> torch.Tensor:
        return wire.view(torch.float32)


ENCODING = Float32()
