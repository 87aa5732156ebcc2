"""The protocol's perturbation generator: counter-based, integer-only, the same bits everywhere.

Every peer of a zeroth-order run must rebuild z(s) exactly, on any CPU or GPU, so the
generator uses nothing but 32-bit unsigned integer arithmetic (wrap-around multiply, xor,
shifts) — no floating point and no library RNG (``torch.randn`` differs across CPU types,
and between CPU and GPU).

Definition (version 1; tests/vectors/rng_v1.json holds test vectors):

    mix(x)      = lowbias32: x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B;
                  x ^= x >> 16                        (all mod 2**32)
    key(s, p)   = ka = mix(mix(mix(p ^ 0x9E3779B9) ^ s_hi) ^ s_lo),  kb = mix(ka ^ 0x85EBCA6B)
                  for seed s = s_hi·2**32 + s_lo (0 ≤ s < 2**64) and parameter index p
    bits(s,p,i) = mix(mix(i ^ ka) + kb)               for element index i (0 ≤ i < 2**32)
    z(s,p,i)    = +1 if the top bit of bits(s,p,i) is 0, else −1   (Rademacher)

Parameter index p numbers the model's parameters in ``model.parameters()`` order; element
index i is the position in the flattened (C-order) parameter.

Version 2 (tests/vectors/rng_v2.json; a run's ``zo.signs`` setting picks the version) takes
32 signs from each 32-bit word, so one hash makes 32 signs instead of one:

    z₂(s,p,i)   = +1 if bit (i mod 32) of bits(s,p,⌊i/32⌋) is 0, else −1

with ``bits`` and ``key`` as above (bit 0 is the least significant).

Version 3 has version 2's signs (the same z, the same vectors); it differs only in how an
apply sums a round's updates: in chunks of 8 (kernels/zo_apply.py), which lets a GPU look
each chunk's sum up in a table of 256 instead of adding 8 times. Version 4 is version 3 with
chunks of 4 (tables of 16, which a GPU warp holds in registers).

Implementations: ``mix_int``/``bits_int`` (pure Python, the definition itself), the torch
reference below (int64 tensors; the 32-bit multiply is split in 16-bit halves so no
intermediate exceeds 2**63), and the Triton kernel in kernels/zo_apply.py (uint32).
"""

import functools
from collections.abc import Sequence

import numpy as np
import torch

VERSION = 1
VERSIONS = (1, 2, 3, 4)
SIGNS_PER_WORD = 32
M32 = 0xFFFFFFFF
C1 = 0x7FEB352D
C2 = 0x846CA68B
PARAM_SALT = 0x9E3779B9
KEY_SALT = 0x85EBCA6B
MAX_ELEMENTS = 1 << 32


def mix_int(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * C1) & M32
    x ^= x >> 15
    x = (x * C2) & M32
    x ^= x >> 16
    return x


def key(seed: int, param_index: int) -> tuple[int, int]:
    """The per-(seed, parameter) key pair (ka, kb)."""
    if not 0 <= seed < 1 << 64 or not 0 <= param_index <= M32:
        raise ValueError(f"seed must be in [0, 2**64) and param_index in [0, 2**32), got {seed}, {param_index}")
    ka = mix_int(mix_int(mix_int(param_index ^ PARAM_SALT) ^ (seed >> 32)) ^ (seed & M32))
    return ka, mix_int(ka ^ KEY_SALT)


def bits_int(seed: int, param_index: int, index: int) -> int:
    """The definition, one element at a time (slow; for checking other implementations)."""
    ka, kb = key(seed, param_index)
    return mix_int((mix_int(index ^ ka) + kb) & M32)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x · c) mod 2**32 without overflowing int64: x = hi·2**16 + lo.
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, C1)
    x = x ^ (x >> 15)
    x = _mul32(x, C2)
    return x ^ (x >> 16)


def hash_index(index: torch.Tensor, ka: int | torch.Tensor, kb: int | torch.Tensor) -> torch.Tensor:
    """bits(s, p, i) of a tensor of indices i, from the key pair of (s, p)."""
    return _mix((_mix(index ^ ka) + kb) & M32)


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on ``device``. To a GPU through page-locked memory without a wait:
    a plain ``.to("cuda")`` from pageable memory waits for the stream to drain, so a call of
    a few such uploads and a kernel ran the GPU idle between calls (zo_apply at K = 1: 0.38
    of copy bandwidth on an H200 with three of them, 0.88 before they came)."""
    if torch.device(device).type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def seed_halves(seeds: Sequence[int], *, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(seeds), 2] int64: (s_hi, s_lo) of each seed (checked), uploaded in one copy."""
    if not all(0 <= seed < 1 << 64 for seed in seeds):
        raise ValueError("seeds must be in [0, 2**64)")
    return upload(torch.tensor([[seed >> 32, seed & M32] for seed in seeds], dtype=torch.int64).reshape(-1, 2), device)


def param_keys(halves: torch.Tensor, param_index: int) -> torch.Tensor:
    """``key(s, p)`` of every seed (``seed_halves``) for parameter p, with torch's integer
    ops on the halves' device: [2 (ka, kb), len(seeds)], int64 holding uint32 values."""
    return params_keys(halves, param_index, 1)[0]


def params_keys(halves: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """``param_keys`` of parameters first .. first + count − 1 in one set of tensor ops:
    [count, 2 (ka, kb), len(seeds)]. On a GPU each op is a launch, so keys a parameter at a
    time cost ~0.7 ms per parameter (gpt-125m's 148: 109 ms a call on an H200, 2026-11-27)."""
    if count < 0 or first < 0 or first + count - 1 > M32:
        raise ValueError(f"parameter indices must lie in [0, 2**32), got [{first}, {first + count})")
    salts = [mix_int(p ^ PARAM_SALT) for p in range(first, first + count)]
    salted = upload(torch.tensor(salts, dtype=torch.int64), halves.device).reshape(-1, 1)
    ka = _mix(_mix(salted ^ halves[:, 0]) ^ halves[:, 1])
    return torch.stack([ka, _mix(ka ^ KEY_SALT)], dim=1)


_C1, _C2 = np.uint32(C1), np.uint32(C2)


def mix_inplace(x: np.ndarray, spare: np.ndarray) -> None:
    """``mix`` on a uint32 array, in place (NumPy's uint32 multiply wraps mod 2**32);
    ``spare``: a uint32 array of x's shape for the shifts."""
    np.right_shift(x, 16, out=spare)
    x ^= spare
    x *= _C1
    np.right_shift(x, 15, out=spare)
    x ^= spare
    x *= _C2
    np.right_shift(x, 16, out=spare)
    x ^= spare


def params_keys_host(seeds: Sequence[int], first: int, count: int) -> np.ndarray:
    """``params_keys`` on the host, in NumPy's uint32 arithmetic: [count, 2 (ka, kb),
    len(seeds)] uint32, the same values. For a call with few keys (a ZO step's K = 1 to
    64 over gpt-125m's 148 parameters) this is ~20 µs of NumPy and one upload, where the
    device's ~60 small tensor ops are as many launches the GPU waits on (kernels/zo_apply.py)."""
    if count < 0 or first < 0 or first + count - 1 > M32:
        raise ValueError(f"parameter indices must lie in [0, 2**32), got [{first}, {first + count})")
    if not all(0 <= seed < 1 << 64 for seed in seeds):
        raise ValueError("seeds must be in [0, 2**64)")
    high = np.array([seed >> 32 for seed in seeds], dtype=np.uint32)
    low = np.array([seed & M32 for seed in seeds], dtype=np.uint32)
    ka = _salts(first, count)[:, None] ^ high[None, :]
    spare = np.empty_like(ka)
    mix_inplace(ka, spare)
    ka ^= low[None, :]
    mix_inplace(ka, spare)
    kb = ka ^ np.uint32(KEY_SALT)
    mix_inplace(kb, spare)
    keys: np.ndarray = np.stack([ka, kb], axis=1)
    return keys


@functools.lru_cache(maxsize=16)
def _salts(first: int, count: int) -> np.ndarray:
    """mix(p ^ PARAM_SALT) of parameters first .. first + count − 1 (the same model's every
    call: kept), read-only."""
    salts = np.array([mix_int(p ^ PARAM_SALT) for p in range(first, first + count)], dtype=np.uint32)
    salts.flags.writeable = False
    return salts


def bits(
    seed: int, param_index: int, count: int, *, offset: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """bits(s, p, i) for i in [offset, offset + count), as int64 holding uint32 values."""
    if offset < 0 or count < 0 or offset + count > MAX_ELEMENTS:
        raise ValueError(f"element indices must lie in [0, 2**32), got [{offset}, {offset + count})")
    ka, kb = key(seed, param_index)
    index = torch.arange(offset, offset + count, dtype=torch.int64, device=device)
    return hash_index(index, ka, kb)


def sign_bit_int(seed: int, param_index: int, index: int, version: int) -> int:
    """1 where z(s, p, i) = −1, by the definition of ``version`` (slow; for checking)."""
    if version == 1:
        return bits_int(seed, param_index, index) >> 31
    return (bits_int(seed, param_index, index // SIGNS_PER_WORD) >> (index % SIGNS_PER_WORD)) & 1


_SHIFTS = torch.arange(SIGNS_PER_WORD, dtype=torch.int64)


def words_to_sign_bits(words: torch.Tensor, skip: int, count: int) -> torch.Tensor:
    """Version 2: the sign bits (int64, 1 = −1) of consecutive words, 32 per word from bit 0
    up, from the ``skip``-th bit of the first word, ``count`` of them."""
    expanded = (words.unsqueeze(1) >> _SHIFTS.to(words.device)) & 1
    return expanded.view(-1)[skip : skip + count]


def sign_bits(
    seed: int, param_index: int, count: int, *, offset: int = 0, version: int = 1, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """1 where z(s, p, i) = −1, for i in [offset, offset + count), as int64."""
    if version == 1:
        return bits(seed, param_index, count, offset=offset, device=device) >> 31
    if version not in VERSIONS:  # 2 to 4: 32 signs a word
        raise ValueError(f"unknown generator version {version} (known: {VERSIONS})")
    if offset < 0 or count < 0 or offset + count > MAX_ELEMENTS:
        raise ValueError(f"element indices must lie in [0, 2**32), got [{offset}, {offset + count})")
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    first, last = offset // SIGNS_PER_WORD, (offset + count - 1) // SIGNS_PER_WORD
    words = bits(seed, param_index, last - first + 1, offset=first, device=device)
    return words_to_sign_bits(words, offset - first * SIGNS_PER_WORD, count)


def rademacher(
    seed: int,
    param_index: int,
    count: int,
    *,
    offset: int = 0,
    version: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """z(s, p, i) ∈ {+1, −1} for i in [offset, offset + count)."""
    negative = sign_bits(seed, param_index, count, offset=offset, version=version, device=device)
    return (1 - 2 * negative).to(dtype)
