"""The payload encodings: one registry, each encoding's size and round trip."""

import re
from pathlib import Path

import pytest
import torch

from training import encodings, settings
from training.quantize import BLOCK

ROOT = Path(__file__).resolve().parent.parent
# Pieces like a model's: a LayerNorm weight near 1, an embedding near 0.02, odd sizes.
NUMELS = [3, BLOCK, BLOCK + 1, 1000]


def payload() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    scales = (1.0, 0.02, 5.0, 1e-4)
    pieces = [torch.randn(n, generator=generator) * scale for n, scale in zip(NUMELS, scales, strict=True)]
    pieces[0] += 1.0
    return torch.cat(pieces)


def test_the_settings_take_their_names_from_the_registry() -> None:
    assert settings.COMPRESSIONS == encodings.NAMES
    with pytest.raises(ValueError, match="compression must be one of"):
        encodings.encoding("zip")


@pytest.mark.parametrize("name", encodings.NAMES)
def test_each_encoding_is_the_size_it_says_and_decodes_what_it_says_the_partner_sees(name: str) -> None:
    encoding = encodings.encoding(name)
    assert encoding.name == name
    flat = payload()
    wire, seen = encoding.encode(flat, NUMELS)
    assert wire.dtype == torch.uint8 and wire.numel() == encoding.nbytes(NUMELS)
    # Decoded with our own payload as sent to fill in from (sparseloco leaves most of φ out).
    decoded = encoding.decode(wire.clone(), NUMELS, fill=flat if seen is None else seen)
    assert torch.equal(decoded, flat if seen is None else seen)  # both sides average the same numbers
    assert encoding.lossy == (seen is not None)
    if name == "int8":
        # Rounding to nearest: at most half a step per value, a step being its block's max / 127.
        for piece, got in zip(torch.split(flat, NUMELS), torch.split(seen, NUMELS), strict=True):
            padded = torch.nn.functional.pad(piece, (0, (-len(piece)) % BLOCK)).view(-1, BLOCK)
            half_step = (padded.abs().amax(dim=1) / 127 / 2).repeat_interleave(BLOCK)[: len(piece)]
            assert bool(((got - piece).abs() <= half_step * (1 + 1e-6)).all())


def test_no_code_outside_the_registry_branches_on_the_compression_name() -> None:
    branch = re.compile(r"compression\s*(==|!=|in\s*[(\[{])|==\s*compression")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in ("node", "training", "protocol", "kernels")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert found == []
