"""No compression: φ then Δ as little-endian float32, 4 bytes a value."""

import torch


class Float32:
    name = "none"
    lossy = False

    def nbytes(self, numels: list[int]) -> int:
        return 4 * sum(numels)

    def encode(self, flat: torch.Tensor, numels: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return flat.to(torch.float32).cpu().view(torch.uint8), None

    def decode(self, wire: torch.Tensor, numels: list[int]) -> torch.Tensor:
        return wire.view(torch.float32)


ENCODING = Float32()
