"""How SPES's published expert versions travel (issue 16): as the worker holds them
(float32), or in blockwise int8 where the run compresses its payloads, 3.9× fewer bytes.
numpy only: the daemon encodes and decodes them, and it imports no torch.

An owner signs, hashes and serves the *encoded* bytes of each version
(node/algorithms/spes/experts.py); a receiver checks them against the signed hash, decodes
them into the worker's slot, and the worker bounds the values as before
(training/spes.py ``check_version``).

Layout ``int8``, version 1 (little-endian), for an expert of n float32 values (its flat
layout, training/spes.py):

    codes   n int8: value ≈ code × its block's scale
    scales  ⌈n / 256⌉ float32: per block of 256 values, max |value| / 127 (0 for a zero block)

Encoding rounds value / scale half to even and clips to ±127: each value comes back within
half a step (scale / 2) of the owner's. What a holder runs its frozen copy with is that
dequantized version; each version is quantized afresh from the owner's float32 weights, so
the errors do not add up from round to round; the owner trains on its own weights, and a
new owner after a hand-over starts from the copy it held. A decoder refuses (ValueError)
another size, and a scale that is non-finite, negative, or so large that a code times it
would overflow float32 (an owner whose weights went non-finite publishes such scales: it is
refused and penalized, as its NaNs are in float32).

Why not sparse (sparseloco's scheme for Δ): a version is the weights, not an update; a
sparse difference against the version a receiver holds needs that exact version at both
ends (a chain of versions, CHOCO-SGD's public copies: arXiv 1902.00340). Not built yet.
"""

from typing import Protocol

import numpy as np

BLOCK = 256
MAX_SCALE = float(np.finfo(np.float32).max) / 128
"""Above this, 127 × scale (rounded to float32) may overflow."""


class ExpertVersions(Protocol):
    name: str
    block: int | None
    """Values travel rounded to 1/127 of their block's largest magnitude, per block of this
    many (None: exactly): a worker widens its bound on a version's distance by that much
    (training/spes.py ``rounding_slack``)."""

    def nbytes(self, numel: int) -> int:
        """Wire bytes of a version of an expert of ``numel`` float32 values."""
        ...

    def encode(self, data: bytes) -> bytes:
        """The worker's float32 bytes of one expert → what is published."""
        ...

    def decode(self, wire: bytes, numel: int) -> bytes:
        """Published bytes (a stranger's) → float32 bytes for the worker; ``ValueError`` if
        they do not fit. Finite whenever accepted (int8) or as sent (float32: the worker checks)."""
        ...


class Float32:
    name = "float32"
    block: int | None = None

    def nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, data: bytes) -> bytes:
        return data

    def decode(self, wire: bytes, numel: int) -> bytes:
        if len(wire) != self.nbytes(numel):
            raise ValueError(f"a float32 version of {numel} values is {self.nbytes(numel)} bytes, got {len(wire)}")
        return wire


class Int8:
    name = "int8"
    block: int | None = BLOCK

    def nbytes(self, numel: int) -> int:
        return numel + 4 * -(-numel // BLOCK)

    def encode(self, data: bytes) -> bytes:
        values = np.frombuffer(data, dtype="<f4")
        numel = len(values)
        blocks = np.pad(values, (0, (-numel) % BLOCK)).reshape(-1, BLOCK)
        with np.errstate(all="ignore"):  # non-finite weights: their scales say so (see above)
            scales = (np.abs(blocks).max(axis=1) / np.float32(127)).astype("<f4")
            safe = np.where(scales > 0, scales, np.float32(1))
            quotients = np.nan_to_num(blocks / safe[:, None], nan=0.0, posinf=127.0, neginf=-127.0)
        codes = np.clip(np.rint(quotients), -127, 127).astype(np.int8).reshape(-1)[:numel]
        return bytes(codes.tobytes() + scales.tobytes())

    def decode(self, wire: bytes, numel: int) -> bytes:
        if len(wire) != self.nbytes(numel):
            raise ValueError(f"an int8 version of {numel} values is {self.nbytes(numel)} bytes, got {len(wire)}")
        codes = np.frombuffer(wire, dtype=np.int8, count=numel)
        scales = np.frombuffer(wire[numel:], dtype="<f4")
        if not (np.isfinite(scales).all() and (scales >= 0).all() and (scales <= MAX_SCALE).all()):
            raise ValueError("an int8 version's scales must be finite, non-negative and in range")
        blocks = np.pad(codes, (0, (-numel) % BLOCK)).reshape(-1, BLOCK).astype(np.float32)
        return bytes((blocks * scales[:, None]).reshape(-1)[:numel].astype("<f4").tobytes())


VERSIONS: dict[str, ExpertVersions] = {"float32": Float32(), "int8": Int8()}
