"""Seed-based zeroth-order training: SPSA with shared randomness, and one-byte scalars.

A step (../shared/DESIGN.md): draw a seed s; L± = L(θ ± ε·z(s)); g = (L+ − L−) / 2ε. The
update θ ← θ − lr·g·z(s) is then fully described by (s, g): peers exchange those few
bytes and every peer applies every update (kernels/zo_apply.py) in one agreed order.

- z(s) comes from kernels/rng.py: the same bits on every machine.
- The canonical weights are never the perturb/restore round trip (θ + ε z − 2ε z + ε z is
  not θ in floating point): the perturbed weights are computed from a kept copy, and the
  copy is put back exactly afterwards.
- g travels as one byte (``encode_g``): a sign bit and a 7-bit log-scale magnitude,
  |g| = g_max · 2^((q − 127)/12) for q = 1…127 (q = 0: zero), so the relative error is at
  most 2^(1/24) − 1 ≈ 2.9% and |g| never exceeds g_max (a larger g saturates, like
  clipping). Every peer decodes through the same float32 table, built with decimal
  arithmetic (no platform libm), so decoded values are bit-identical everywhere.
"""

import decimal
import hashlib
import itertools
import operator
from collections.abc import Callable, Sequence

import torch

from kernels import zo_apply
from training.settings import ZoConfig

LEVELS = 127
STEPS_PER_OCTAVE = 12


def _table() -> torch.Tensor:
    context = decimal.Context(prec=50)
    values = [0.0] + [
        float(context.power(decimal.Decimal(2), decimal.Decimal(q - LEVELS) / STEPS_PER_OCTAVE))
        for q in range(1, LEVELS + 1)
    ]
    return torch.tensor(values, dtype=torch.float32)


MAGNITUDES = _table()
"""MAGNITUDES[q] = float32(2^((q − 127)/12)); MAGNITUDES[0] = 0."""
# Nearest level in log space: the geometric midpoints between neighbouring levels.
_MIDPOINTS = torch.sqrt(MAGNITUDES[1:-1].double() * MAGNITUDES[2:].double()).float()


def encode_g(g: float, g_max: float) -> int:
    """g → one byte: bit 7 the sign, bits 0–6 the nearest log-scale level (0: zero)."""
    if g != g or g in (float("inf"), float("-inf")):
        raise ValueError(f"cannot encode g = {g}")
    magnitude = torch.tensor(abs(g) / g_max, dtype=torch.float32)
    if float(magnitude) < float(MAGNITUDES[1]) / 2 ** (1 / (2 * STEPS_PER_OCTAVE)):
        return 0
    level = 1 + int(torch.searchsorted(_MIDPOINTS, magnitude.reshape(1)).item())
    return (0x80 if g < 0 else 0) | min(level, LEVELS)


def decode_g(code: int, g_max: float) -> float:
    """One byte → g, as a float32 value (float32(g_max) × MAGNITUDES[q], with the sign)."""
    if not 0 <= code <= 0xFF:
        raise ValueError(f"a g code is one byte, got {code}")
    value = torch.tensor(g_max, dtype=torch.float32) * MAGNITUDES[code & 0x7F]
    return -float(value) if code & 0x80 else float(value)


# The default step size times the parameter count. An SPSA update moves every coordinate
# by lr·|g|, and |g| grows with the model; measured with bench/zo_step_size.py (4 authors,
# 10 rounds of 10 updates, the embedded corpus; validation loss after / before): micro
# (120,576 parameters) 0.75 at lr·d = 362 and diverging at 965; tiny (3,257,856) 0.86 at
# 98, 0.82 at 326, 0.77 at 977 and diverging at 9,774 (lr 3e-3, the old default). 360 is
# the largest product measured stable on both.
LR_TIMES_PARAMS = 360.0


def step_size(config: ZoConfig, num_params: int) -> float:
    """The run's step size: ``config.lr``, or when that is 0, LR_TIMES_PARAMS / num_params
    (the same float on every node: one division of the same two numbers)."""
    return config.lr if config.lr > 0 else LR_TIMES_PARAMS / num_params


Loss = Callable[[], float]


@torch.no_grad()
def spsa(params: Sequence[torch.Tensor], loss: Loss, seed: int, eps: float, *, signs: int) -> float:
    """g = (L(θ + εz) − L(θ − εz)) / 2ε, z of generator ``signs``; the parameters end
    exactly as they began."""
    kept = [p.detach().clone() for p in params]
    try:
        zo_apply.apply(params, [seed], zo_apply.coefficients(-eps, [1.0]), version=signs)  # θ + εz
        plus = loss()
        copy_into(params, kept)
        zo_apply.apply(params, [seed], zo_apply.coefficients(eps, [1.0]), version=signs)  # θ − εz
        minus = loss()
    finally:
        copy_into(params, kept)
    return (plus - minus) / (2 * eps)


@torch.no_grad()
def copy_into(params: Sequence[torch.Tensor], kept: Sequence[torch.Tensor]) -> None:
    """Each of ``params`` takes the values of its twin in ``kept`` (same shapes, in order)."""
    for param, saved in zip(params, kept, strict=True):
        param.copy_(saved)


def step_seed(run_seed: int, peer_index: int, step: int) -> int:
    """A 64-bit seed per (peer, step): distinct streams without coordination."""
    return (run_seed * 0x9E3779B97F4A7C15 + peer_index * 0xBF58476D1CE4E5B9 + step) % (1 << 64)


def param_hash(params: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the weights (float32, C order, parameters in order): equal means bit-identical."""
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def coefficients(codes: Sequence[int], config: ZoConfig) -> torch.Tensor:
    """c_k = float32(lr) · decode_g(code_k) for many codes at once (the same float32
    products, bit for bit: tests/test_zo.py checks every code)."""
    if not config.lr > 0:
        raise ValueError("ZO updates need the resolved step size (step_size), got lr = 0")
    table = torch.tensor([operator.index(code) for code in codes], dtype=torch.int64)  # integers only
    if table.numel() and not (int(table.min()) >= 0 and int(table.max()) <= 0xFF):
        raise ValueError("a g code is one byte")
    magnitudes = torch.tensor(config.g_max, dtype=torch.float32) * MAGNITUDES[table & 0x7F]
    gs = torch.where(table & 0x80 != 0, -magnitudes, magnitudes)
    return gs * torch.tensor(config.lr, dtype=torch.float32)


@torch.no_grad()
def apply_updates(
    params: Sequence[torch.Tensor], groups: Sequence[Sequence[tuple[int, int]]], config: ZoConfig
) -> None:
    """Apply round groups of (seed, g code) updates in the given (canonical) order: per
    group θ ← θ − Σ lr·g·z, one sum a group, made as ``config.signs`` says (version 3: in
    chunks of 8; kernels/zo_apply.py) (``config.lr`` resolved: ``step_size``). Many groups
    go in one pass over the weights, with the bits of one call per group."""
    updates = [update for group in groups for update in group]
    coeffs = coefficients([code for _, code in updates], config)
    if not groups:
        return
    ends = list(itertools.accumulate(len(group) for group in groups))
    zo_apply.apply(params, [seed for seed, _ in updates], coeffs, version=config.signs, ends=ends)
