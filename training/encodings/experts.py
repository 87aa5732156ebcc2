"""How SPES's published expert versions travel (issue 16): as the worker holds them
(float32, ``--compression none``), in blockwise int8 (``int8``: 3.9× fewer bytes), or as
int8 keyframes and sparse deltas between them (``sparseloco``). numpy only: the daemon
encodes and decodes them, and it imports no torch.

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

Layout ``sparse``, version 1 (``Sparse``; CHOCO-SGD's public copies, arXiv 1902.00340): a
version is the weights, not an update, so a sparse difference needs the exact version it
is against at both ends. The owner keeps, per owned expert, a public copy x̂ (float32) that
every holder of the same version has bit for bit (``Chain``). A version is one of:

    keyframe  kind    uint8 1
              int8    n + 4·⌈n / 256⌉ bytes: the ``int8`` layout above, of the owner's weights x
    delta     kind    uint8 2
              depth   uint8: versions since the keyframe, 1..CHAIN − 1
              base    32 bytes: the sha256 of the version it applies to (its whole wire bytes)
              sparse  top-k per chunk of (x − x̂) in 2-bit values: training/encodings/topk.py
                      (chunks of 4096, 1024 kept each, a bitmap, 2-bit codes, 2 float32 a chunk)

A keyframe sets x̂ to its dequantized values; a delta adds its values to x̂ at the positions
it names, in float32 (one IEEE add a value: the same bits on every machine; the owner runs
the decoder's code on its own delta). Error feedback is implicit: what was not sent stays
in x − x̂ and goes in a later delta. The first version of a chain, every CHAIN-th, the
first after a hand-over (a new owner starts its own chain) and one of non-finite weights
are keyframes. Both sizes follow from n (a delta of n = 1 M values is 0.19 of a keyframe).
The base's sha256 is inside the delta's bytes, which the signed head's sha256 covers: each
version back to the keyframe is its signer's word, transitively, and the head format is
unchanged. ``decode_chain`` refuses (ValueError) a chain that is not a keyframe (or a delta
onto a given base) followed by deltas each naming the one before with a depth one more, or
longer than CHAIN; a delta's magnitudes that are non-finite, negative or above MAX_MAGNITUDE;
a chunk with another count of kept values, a bit past the end; and any value taken past
float32's range.

Why CHAIN = 8: bytes per version average (1 + 7 × 0.19) / 8 = 0.29 of int8's (16: 0.24;
4: 0.39), while a version may trail its owner's weights by up to CHAIN − 1 rounds of
updates, which the worker's bound allows for (training/spes.py ``chain_lag_slack``): a
longer chain loosens that bound further for fewer bytes saved.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from training.encodings import topk

BLOCK = 256
MAX_SCALE = float(np.finfo(np.float32).max) / 128
"""Above this, 127 × scale (rounded to float32) may overflow."""


@dataclass(frozen=True, slots=True)
class Chain:
    """An owner's public copy of one expert it owns: what every holder of its newest
    version rebuilds, bit for bit."""

    public: np.ndarray
    """x̂: float32, the expert as holders have it."""
    sha256: bytes
    """Of the newest version's wire bytes (what the next delta names)."""
    depth: int
    """Deltas since the keyframe (0: the newest version is the keyframe)."""


class ExpertVersions(Protocol):
    name: str
    block: int | None
    """Values travel rounded to 1/127 of their block's largest magnitude, per block of this
    many (None: exactly): a worker widens its bound on a version's distance by that much
    (training/spes.py ``rounding_slack``)."""
    chain: int
    """The most versions in a chain, keyframe included (1: each version stands alone); a
    version trails its owner's weights by at most the updates of ``chain − 1`` rounds."""

    def nbytes(self, numel: int) -> int:
        """Wire bytes of a keyframe (a version that stands alone) of an expert of ``numel``
        float32 values: the largest a version is."""
        ...

    def sizes(self, numel: int) -> frozenset[int]:
        """Every size a version of such an expert may have (known before any allocation)."""
        ...

    def link(self, wire: bytes, numel: int) -> tuple[int, bytes | None]:
        """A version's place in its chain: (deltas since its keyframe, the sha256 of the
        version it applies to, None for a keyframe); ``ValueError`` if its header or size
        does not fit. Reads the header only."""
        ...

    def encode_next(self, data: bytes, chain: Chain | None) -> tuple[bytes, Chain | None]:
        """The owner's float32 weights and its chain so far (None: start one) → the wire of
        its next version and the chain after it (None where versions stand alone)."""
        ...

    def decode_chain(
        self, wires: Sequence[bytes], numel: int, *, base: np.ndarray | None = None, base_depth: int = 0
    ) -> np.ndarray:
        """A chain's versions in order → the newest's float32 values. ``wires[0]`` is a
        keyframe, or (``base`` given: the public copy of the version it names, which the
        caller matched by sha256, ``base_depth`` deltas past its keyframe) a delta one
        deeper; each later one must name the one before it, one deeper again.
        ``ValueError`` if anything does not fit; the result is finite (or, float32, as sent:
        the worker checks)."""
        ...

    def encode(self, data: bytes) -> bytes:
        """The worker's float32 bytes of one expert → what is published."""
        ...

    def decode(self, wire: bytes, numel: int) -> bytes:
        """Published bytes (a stranger's) → float32 bytes for the worker; ``ValueError`` if
        they do not fit. Finite whenever accepted (int8) or as sent (float32: the worker checks)."""
        ...


class _Standalone:
    """Versions that stand alone: every one a keyframe, no header."""

    chain = 1

    def nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, data: bytes) -> bytes:
        raise NotImplementedError

    def decode(self, wire: bytes, numel: int) -> bytes:
        raise NotImplementedError

    def sizes(self, numel: int) -> frozenset[int]:
        return frozenset({self.nbytes(numel)})

    def link(self, wire: bytes, numel: int) -> tuple[int, bytes | None]:
        if len(wire) != self.nbytes(numel):
            raise ValueError(f"a version of {numel} values is {self.nbytes(numel)} bytes, got {len(wire)}")
        return 0, None

    def encode_next(self, data: bytes, chain: Chain | None) -> tuple[bytes, Chain | None]:
        return self.encode(data), None

    def decode_chain(
        self, wires: Sequence[bytes], numel: int, *, base: np.ndarray | None = None, base_depth: int = 0
    ) -> np.ndarray:
        if len(wires) != 1 or base is not None:
            raise ValueError("these versions stand alone: a chain of one")
        return np.frombuffer(self.decode(wires[0], numel), dtype="<f4")


class Float32(_Standalone):
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


class Int8(_Standalone):
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


KEYFRAME = 1
DELTA = 2
CHAIN = 8
"""Versions in a chain: a keyframe, then up to 7 deltas (see the docstring: why 8)."""
MAX_MAGNITUDE = float(np.finfo(np.float32).max) / 4
"""A delta's magnitudes above this are refused (an owner's weights went non-finite, or a
forgery): far above any weight, and x̂ + a value stays finite when |x̂| is below it too."""
_DELTA_HEADER = 2 + 32


class Sparse:
    """Keyframes (int8) and deltas (top-k of x − x̂ in 2-bit values) against the previous
    version: ``--compression sparseloco``."""

    name = "sparse"
    block: int | None = BLOCK
    chain = CHAIN

    def __init__(self) -> None:
        self._int8 = Int8()

    def nbytes(self, numel: int) -> int:
        return 1 + self._int8.nbytes(numel)

    def delta_nbytes(self, numel: int) -> int:
        return _DELTA_HEADER + topk.nbytes(topk.chunk_sizes(numel))

    def sizes(self, numel: int) -> frozenset[int]:
        return frozenset({self.nbytes(numel), self.delta_nbytes(numel)})

    def encode(self, data: bytes) -> bytes:
        """A keyframe of these float32 weights."""
        return bytes([KEYFRAME]) + self._int8.encode(data)

    def decode(self, wire: bytes, numel: int) -> bytes:
        """A keyframe's float32 values (a delta needs its base: ``decode_chain``)."""
        return self.decode_chain([wire], numel).tobytes()

    def link(self, wire: bytes, numel: int) -> tuple[int, bytes | None]:
        kind = wire[0] if wire else None
        if kind == KEYFRAME and len(wire) == self.nbytes(numel):
            return 0, None
        if kind == DELTA and len(wire) == self.delta_nbytes(numel):
            depth = wire[1]
            if not 1 <= depth < CHAIN:
                raise ValueError(f"a delta's depth must be 1..{CHAIN - 1}, got {depth}")
            return depth, bytes(wire[2:_DELTA_HEADER])
        raise ValueError(
            f"a version of {numel} values is a keyframe of {self.nbytes(numel)} bytes (kind {KEYFRAME}) "
            f"or a delta of {self.delta_nbytes(numel)} (kind {DELTA}); got kind {kind} in {len(wire)}"
        )

    def encode_next(self, data: bytes, chain: Chain | None) -> tuple[bytes, Chain]:
        values = np.frombuffer(data, dtype="<f4")
        if chain is not None and chain.depth + 1 < CHAIN and np.isfinite(values).all():
            with np.errstate(all="ignore"):
                difference = (values - chain.public).astype(np.float32)
            depth = chain.depth + 1
            wire = bytes([DELTA, depth]) + chain.sha256 + topk.encode(difference)
            try:
                # x̂ moves by the decoded delta, as every holder's does (the same code, the same bits).
                public = self._apply(chain.public, wire, len(values))
                return wire, Chain(public, hashlib.sha256(wire).digest(), depth)
            except ValueError:
                pass  # a delta no holder would take (finite weights, a difference past float32's range): a keyframe
        # A new chain (a non-finite expert goes as a keyframe, whose scales say so).
        wire = self.encode(data)
        sha256 = hashlib.sha256(wire).digest()
        try:
            public = np.frombuffer(self._int8.decode(wire[1:], len(values)), dtype="<f4")
        except ValueError:  # refused by every holder: the next version is a keyframe again
            return wire, Chain(np.zeros(len(values), dtype="<f4"), sha256, CHAIN - 1)
        return wire, Chain(public, sha256, 0)

    def _apply(self, public: np.ndarray, wire: bytes, numel: int) -> np.ndarray:
        chunks = topk.chunk_sizes(numel)
        positions, values, magnitudes = topk.decode(np.frombuffer(wire, dtype=np.uint8)[_DELTA_HEADER:], chunks)
        if not (np.isfinite(magnitudes).all() and (magnitudes >= 0).all() and (magnitudes <= MAX_MAGNITUDE).all()):
            raise ValueError("a delta's magnitudes must be finite, non-negative and in range")
        out = public.copy()
        with np.errstate(over="ignore"):
            out[positions] += values  # float32 adds, IEEE round-to-nearest: the same bits everywhere
        if not np.isfinite(out[positions]).all():
            raise ValueError("a delta takes the expert past float32's range")
        return out

    def decode_chain(
        self, wires: Sequence[bytes], numel: int, *, base: np.ndarray | None = None, base_depth: int = 0
    ) -> np.ndarray:
        if not 1 <= len(wires) <= CHAIN:
            raise ValueError(f"a chain holds 1..{CHAIN} versions, got {len(wires)}")
        links = [self.link(wire, numel) for wire in wires]
        if base is not None and (links[0][1] is None or len(base) != numel or links[0][0] != base_depth + 1):
            raise ValueError("a chain from a base starts with a delta of its size, one deeper than the base")
        public = base
        for index, (wire, (depth, named)) in enumerate(zip(wires, links, strict=True)):
            if named is None:
                if index:
                    raise ValueError("a keyframe inside a chain")
                public = np.frombuffer(self._int8.decode(wire[1:], numel), dtype="<f4")
                continue
            if index and (named != hashlib.sha256(wires[index - 1]).digest() or depth != links[index - 1][0] + 1):
                raise ValueError("a delta does not follow the version before it in its chain")
            if public is None:
                raise ValueError("a chain starts with a keyframe")
            public = self._apply(public, wire, numel)
        assert public is not None
        return public


VERSIONS: dict[str, ExpertVersions] = {"float32": Float32(), "int8": Int8(), "sparse": Sparse()}
