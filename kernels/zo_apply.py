"""Apply K zeroth-order updates in one pass: θ_p ← θ_p − Σ_k c_k·z(s_k, p, ·), c_k = lr·g_k.

Every peer must end with the same bits, so the arithmetic is fixed (both generator versions):

- c_k is float32(lr) × float32(g_k), rounded to float32 (``coefficients``), computed once
  and handed to every implementation;
- per element, acc starts at +0.0 (float32) and adds ±c_k for k = 0, 1, …, K−1 in the
  log's canonical order (c_k·z is exact: z = ±1, so fused multiply-add changes nothing);
- then θ ← θ − acc, once, in float32.

A NaN's bits (sign, payload) are not part of the rule: coefficients are finite (the run's
lr and g_max are bounded), so a NaN in θ means sums overflowed to ±inf and met, a run gone
wrong, where NumPy, torch and GPUs each return their own NaN.

Versions 3 and 4 (version 2's signs) sum each group in *chunks* of 8 or 4 updates
(``CHUNK_UPDATES``); for version 3:
per element, each chunk's part starts at +0.0 and adds its ±c_k in order, and acc starts at
+0.0 and adds the chunks' parts in order. A chunk's part depends only on its 8 signs, so a
GPU looks it up in the chunk's table of 256 sums (``chunk_tables``) instead of adding 8
times; a group of at most 8 updates (a ZO step's perturbation, a round of few updates)
gets version 2's bits, since +0.0 + part is part (a part that starts at +0.0 is never
−0.0). Rounds of many updates (nodes × H) are where it differs, and where it pays.
Version 4 is the same with chunks of 4: tables of 16, which a warp holds one entry a lane
and looks up with a shuffle (no memory access), where version 3's tables of 256 are
gathered from L1; a group of at most 4 updates gets version 2's bits.

That is one *group* (one round of the log: the worker sums a round's updates together).
A call may carry many groups (``ends``: where each ends): per element, each group's acc in
turn, θ ← θ − acc after each, so the bits are those of one call per group, while θ is read
and written once for all of them (a replay's rounds, thousands of updates a pass).

``apply_reference`` does that with torch on any device (chunked, so its temporaries stay
small): the definition the others are tested against. ``apply_cpu`` (what ``apply`` takes
on a CPU) does it in NumPy's uint32 arithmetic, in place on cache-sized chunks, with the
reference's bits: torch has no unsigned 32-bit multiply, so the reference splits each in
16-bit halves on int64 (a hash of 1 M indices: 24 ms in torch, 1.5 ms in NumPy, one
thread). ``apply_triton`` runs the fused GPU kernels: one read and one write of θ whatever K
is, z generated in registers (kernels/rng.py's definitions in uint32), the keys of every
(seed, parameter) derived on the device (``rng.params_keys``, many parameters at once: no
Python loop per update), the seeds uploaded once a call. Version 1's kernel makes one hash per element and update;
version 2's one per word of 32 elements, in the one thread that holds the word.

What is checked where:

- tests/test_zo_apply.py, on any machine: the reference's arithmetic, chunking, order and
  groups (one call with groups = one call per group, bit for bit); ``apply_cpu`` against
  the reference bit for bit (special coefficients and weights, chunks of 32 to 65,536);
- the same file on a CUDA machine with Triton: both kernels against the CPU reference bit
  for bit (compared as int32, so −0.0 ≠ +0.0), K = 1, 3, 8, 64, sizes off a multiple of 32
  and of the block, several parameters and block sizes, coefficients ±0, subnormal, and
  large enough that sums overflow to ±inf, in one group and in three (one empty); and
  that ``apply`` takes the kernels on CUDA;
- Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, the CUDA check bypassed in a
  script outside the repository; Triton 3.9 on this CPU machine): both kernels gave the
  reference's bits for K = 1, 3, 8, 64, blocks 32 to 4096, up to 100,003 elements; since
  groups (2026-11-27), for groups [1], [3], [8], [64], [2, 0, 5, 1], [0] and 16 × [4], blocks
  32, 1024 and 4096, sizes 1 to 3,079 and special values; version 2's second kernel
  (2026-11-27) the same, with Triton 3.9's interpreter. It runs the kernels with NumPy, so
  it says nothing of the GPU's float rounding or denormals. Both kernels also compile for
  sm_90 here (``triton.compile`` with a ``GPUTarget``, Triton's own ptxas: no GPU needed);
- on an H200 (2026-11-26, `scripts/gpu_checks`): the CUDA tests above passed, both kernels
  bit for bit (before groups and the keys on the device: the next device session reruns them).

Speed there (bench/zo_apply.py --mparams 256, fraction of a device copy's bandwidth, H200,
2026-11-26): version 1 0.88 / 0.26 / 0.036 at K = 1 / 8 / 64, integer-bound past K = 1.
Version 2's first kernel ran at 0.85 / 0.24 / 0.031: no faster, because Triton laid its
[words, 32] tile out with a word's 32 lanes across a warp's 32 threads, each thread making
the hash of every word it touched (one hash per element, as version 1). Its kernel now
holds θ as [4, words] tiles, which Triton lays out with a word's lanes in one thread:
counted in the compiled code for sm_90 (no GPU: ``triton.compile`` for a ``GPUTarget``
and the cuobjdump Triton ships), the inner loop takes 4.1 instructions per element and
update (131 for a thread's 32 elements: 32 adds, the shifts and and-xors, one hash)
against version 1's 21.3 (170 for 8 elements) and the first version 2 kernel's 23.3 (186
for 8), and no layout conversion inside the loop. What that buys on a GPU is not measured
yet (the loads and stores are 16 bytes per thread at a 128-byte stride: L1 and L2 merge
them, but K = 1 may lose some of its bandwidth). Measured on an H200 (2026-11-27, the whole
call timed): version 1 / version 2 at K = 1 0.986 / 0.470, K = 8 0.275 / 0.462, K = 64
0.036 / 0.212 of copy bandwidth, with a small call's keys derived on the host
(``HOST_KEYS``); with the device's key ops K = 1 was 0.353 / 0.333 in the same run.
Version 3's kernel (1.69 instructions per element and update, counted the same way) gave
the reference's bits on an H100 (tests/test_zo_apply.py, 2026-11-28) and ran K = 64 at
0.379 of copy bandwidth against version 2's 0.300 there, K = 1 and 8 as version 2 (0.57):
its table lookups are gathers over a table's 8 cache lines (docs/zo.md). Those 0.57 were
the word tiles' loads and stores, a thread's 16 bytes at a 128-byte stride (each
instruction touching 32 cache lines); versions 2 to 4 now load and store θ as whole [BLOCK]
vectors, which Triton rearranges once, outside the loop, through shared memory and warp
shuffles (``COALESCED_TILES``). On an H100 (2026-11-28,
block 1024): K = 1 and 8 at 0.99 for versions 2 to 4; K = 64 version 2 0.277 (0.300
before), version 3 0.289, version 4 (1.75 instructions an element-update, no gathers)
**0.511** (0.434 with the old tiles); all bit for bit in the CUDA tests, both tile paths.
"""

import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from kernels import rng

CHUNK = 1 << 20
CHUNK_UPDATES = {3: 8, 4: 4}
"""Versions 3 and 4: the updates a chunk of a group sums on its own (a byte or a nibble of
signs per element)."""
MAX_CHUNKED_UPDATES = 1 << 22
"""Versions 3 and 4's kernels index their tables in int32: at most 2**22 updates a call, so
at most 2**22 chunks (groups of one update each) of 256 entries, under 2**31. The worker's largest
call is a pending batch just under ``REPLAY_BATCH_UPDATES`` plus one round of
``MAX_UPDATES_PER_ROUND`` (training/algorithms/zo.py; tests/test_zo_apply.py checks it fits)."""
# The CPU path's chunk: its ~20 passes an update stay in the L2 cache.
CPU_CHUNK = 1 << 16

try:  # Triton comes with CUDA builds of torch; the CPU wheel has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def coefficients(lr: float, gs: Sequence[float]) -> torch.Tensor:
    """c_k = float32(lr) · float32(g_k), in float32: the one recipe every peer uses."""
    return torch.tensor(list(gs), dtype=torch.float32) * torch.tensor(lr, dtype=torch.float32)


def _check(
    params: Sequence[torch.Tensor], seeds: Sequence[int], coeffs: torch.Tensor, version: int, ends: Sequence[int] | None
) -> list[int]:
    """Every implementation's inputs checked alike; the groups' edges (``bounds``)."""
    if version not in rng.VERSIONS:
        raise ValueError(f"unknown generator version {version} (known: {rng.VERSIONS})")
    if version in CHUNK_UPDATES and len(seeds) > MAX_CHUNKED_UPDATES:  # every implementation refuses alike
        raise ValueError(f"version {version} takes at most {MAX_CHUNKED_UPDATES} updates a call, got {len(seeds)}")
    if coeffs.dtype != torch.float32 or coeffs.shape != (len(seeds),):
        raise ValueError(f"need {len(seeds)} float32 coefficients, got {coeffs.dtype} × {tuple(coeffs.shape)}")
    for p, param in enumerate(params):
        if param.dtype != torch.float32 or not param.is_contiguous():
            raise ValueError(f"parameter {p} must be contiguous float32 (the canonical weights), got {param.dtype}")
        if param.numel() > rng.MAX_ELEMENTS:
            raise ValueError(f"parameter {p} has more than 2**32 elements")
    return bounds(ends, len(seeds))


def _negative(index: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """z(s, p, i) < 0 for a range of element indices i (kernels/rng.py's definition, version 1)."""
    return (rng.hash_index(index, ka, kb) >> 31).bool()


def _negative_v2(index: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """The same for version 2: one hash per 32 elements (``index`` starts at a multiple of 32)."""
    words = rng.hash_index(index[:: rng.SIGNS_PER_WORD] >> 5, ka, kb)
    return rng.words_to_sign_bits(words, 0, index.numel()).bool()


_NEGATIVE = {1: _negative, 2: _negative_v2, 3: _negative_v2, 4: _negative_v2}


def spans(begin: int, end: int, version: int) -> list[tuple[int, int]]:
    """The updates [begin, end) of one group as the runs summed on their own: the whole
    group (versions 1 and 2) or chunks of ``CHUNK_UPDATES[version]`` (versions 3 and 4)."""
    if version not in CHUNK_UPDATES:
        return [(begin, end)]
    size = CHUNK_UPDATES[version]
    return [(first, min(first + size, end)) for first in range(begin, end, size)]


def bounds(ends: Sequence[int] | None, count: int) -> list[int]:
    """[0, end of group 0, end of group 1, …]: ``ends`` checked (non-decreasing, the last
    one ``count``); None is one group of all ``count`` updates."""
    ends = [count] if ends is None else [operator.index(end) for end in ends]  # integers only
    edges = [0, *ends]
    if not ends or ends[-1] != count or any(b < a for a, b in itertools.pairwise(edges)):
        raise ValueError(f"group ends must rise to the {count} updates, got {ends[:8]}")
    return edges


@torch.no_grad()
def apply_reference(
    params: Sequence[torch.Tensor],
    seeds: Sequence[int],
    coeffs: torch.Tensor,
    *,
    version: int = 1,
    ends: Sequence[int] | None = None,
) -> None:
    """In place, on the parameters' device, in the canonical order; z of generator
    ``version``. ``ends``: where each summed group ends (cumulative); the bits are those of
    one call per group, in order (θ ← θ − acc after each group)."""
    edges = _check(params, seeds, coeffs, version, ends)
    if not seeds:
        return  # θ − 0 would quiet a signalling NaN: every implementation leaves θ as it is
    if any(param.device.type == "cpu" for param in params):
        _check_host_floats()
    values = coeffs.tolist()
    negative_fn = _NEGATIVE[version]
    # Version 2's chunks start at a word (its 32 signs come from one hash).
    chunk = CHUNK if version == 1 else max(rng.SIGNS_PER_WORD, CHUNK - CHUNK % rng.SIGNS_PER_WORD)
    halves = rng.seed_halves(seeds)
    for p, param in enumerate(params):
        kas, kbs = rng.param_keys(halves, p).tolist()  # one parameter's keys at a time: O(K) memory
        flat = param.view(-1)
        for start in range(0, flat.numel(), chunk):
            count = min(chunk, flat.numel() - start)
            index = torch.arange(start, start + count, dtype=torch.int64, device=param.device)
            segment = flat[start : start + count]
            for begin, end in itertools.pairwise(edges):
                acc = torch.zeros(count, dtype=torch.float32, device=param.device)
                for first, last in spans(begin, end, version):
                    part = acc if version not in CHUNK_UPDATES else torch.zeros_like(acc)
                    for ka, kb, c in zip(kas[first:last], kbs[first:last], values[first:last], strict=True):
                        negative = negative_fn(index, torch.tensor(ka), torch.tensor(kb))
                        part += torch.where(negative, -c, c)
                    if part is not acc:
                        acc += part
                segment -= acc


_SIGN = np.uint32(0x80000000)


@torch.no_grad()
def apply_cpu(
    params: Sequence[torch.Tensor],
    seeds: Sequence[int],
    coeffs: torch.Tensor,
    *,
    version: int = 1,
    ends: Sequence[int] | None = None,
) -> None:
    """``apply_reference`` for CPU tensors, in NumPy's uint32 arithmetic: the same bits
    (tests/test_zo_apply.py), ~10× faster. Per update, in place on a cache-sized chunk: the
    hash, then ±c as c with its sign bit xor'ed with the hash's (IEEE negation flips that
    bit only: ``where(negative, −c, c)`` bit for bit, ±0 and subnormals included), added
    to acc in float32; version 2 takes 32 sign bits from each word (bit j for element
    32w + j: the word's bytes in little-endian order, unpacked least significant first).
    It writes the tensors' memory through NumPy, which autograd's version counters do not
    see: for weights outside any graph kept for a backward (the ZO worker's)."""
    edges = _check(params, seeds, coeffs, version, ends)
    for p, param in enumerate(params):
        if param.device.type != "cpu":
            raise ValueError(f"parameter {p} is on {param.device}; the NumPy path takes CPU tensors")
    if not seeds:
        return
    _check_host_floats()
    sign_bits = coeffs.detach().cpu().numpy().view(np.uint32)
    halves = rng.seed_halves(seeds)
    words_per = 1 if version == 1 else rng.SIGNS_PER_WORD
    with np.errstate(over="ignore", invalid="ignore"):  # ±inf and NaN follow IEEE, as in torch: no warnings
        for first, chunk in _key_chunks(halves, len(params)):
            for j, (kas, kbs) in enumerate(chunk.numpy().view(np.uint32)):
                _apply_cpu_one(params[first + j], kas, kbs, sign_bits, edges, version, words_per)


def _apply_cpu_one(
    param: torch.Tensor,
    kas: np.ndarray,
    kbs: np.ndarray,
    sign_bits: np.ndarray,
    edges: list[int],
    version: int,
    words_per: int,
) -> None:
    """One CPU parameter in place (``apply_cpu``)."""
    flat = param.detach().view(-1).numpy()  # the tensor's memory
    for start in range(0, flat.size, CPU_CHUNK):  # CPU_CHUNK is a multiple of 32: chunks start at a word
        count = min(CPU_CHUNK, flat.size - start)
        index = np.arange(start // words_per, -(-(start + count) // words_per), dtype=np.uint32)
        h, spare = np.empty_like(index), np.empty_like(index)
        sign = np.empty(count, dtype=np.uint32)
        acc = np.empty(count, dtype=np.float32)
        chunk_part = np.empty(count, dtype=np.float32) if version in CHUNK_UPDATES else acc
        segment = flat[start : start + count]
        for begin, end in itertools.pairwise(edges):
            acc.fill(0.0)
            for first, last in spans(begin, end, version):
                if chunk_part is not acc:  # versions 1 and 2 add into acc itself (one span)
                    chunk_part.fill(0.0)
                for k in range(first, last):
                    np.bitwise_xor(index, kas[k], out=h)
                    rng.mix_inplace(h, spare)
                    h += kbs[k]
                    rng.mix_inplace(h, spare)
                    if version == 1:
                        np.bitwise_and(h, _SIGN, out=sign)
                    else:
                        bits = np.unpackbits(h.astype("<u4", copy=False).view(np.uint8), bitorder="little")
                        np.left_shift(bits[:count], 31, out=sign, dtype=np.uint32)
                    sign ^= sign_bits[k]
                    chunk_part += sign.view(np.float32)
                if chunk_part is not acc:
                    acc += chunk_part
            segment -= acc


def chunk_tables(
    coeffs: np.ndarray, edges: Sequence[int], size: int = CHUNK_UPDATES[3]
) -> tuple[np.ndarray, list[int], np.ndarray]:
    """Chunks of ``size`` updates for a GPU (versions 3 and 4: 8 and 4): (tables,
    chunk_edges, slots). ``tables[c, b]`` is chunk c's part for the signs in b (2**size
    entries; bit j set: update j of the chunk is −c_j), summed
    as the definition does (+0.0, then ±c_j in order, float32); group g's chunks are
    ``chunk_edges[g]`` to ``chunk_edges[g + 1]``; ``slots[c, j]`` is the update whose key
    chunk c's j-th hash takes. A short chunk's spare slots repeat its first update with
    c = +0.0, which no sum sees (x + ±0.0 = x for every part, none of them −0.0). The host's
    float32 sums must be IEEE's, as the CPU path's always were (``_check_host_floats``).
    Costs 510 adds and 1 KiB a chunk of 8 (4 MiB of tables for 4096 rounds of one update:
    version 3 is for rounds of many updates), 30 adds and 64 bytes a chunk of 4."""
    edges_array = np.asarray(bounds(edges[1:], len(coeffs)), dtype=np.int64)
    per_group = -(-np.diff(edges_array) // size)
    chunk_edges = np.concatenate([[0], np.cumsum(per_group)])
    group = np.repeat(np.arange(per_group.size), per_group)
    first = edges_array[group] + size * (np.arange(group.size) - chunk_edges[group])
    last = np.minimum(first + size, edges_array[group + 1])
    slots = first[:, None] + np.arange(size)[None, :]
    real = slots < last[:, None]
    slots = np.where(real, slots, first[:, None])
    values = np.where(real, np.asarray(coeffs, dtype=np.float32)[slots], np.float32(0.0))
    _check_host_floats()
    # Doubling: the sums over updates 0 .. j for bytes below 2**(j + 1) are those over
    # 0 .. j − 1 (bytes below 2**j) plus c_j (bit j clear) or minus it (bit j set), in the
    # definition's order: 510 adds a chunk of 8, not 8 × 256.
    tables = np.zeros((group.size, 1 << size), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # ±inf and NaN follow IEEE, as the sums do
        for j in range(size):
            width, c = 1 << j, values[:, j, None]
            np.subtract(tables[:, :width], c, out=tables[:, width : 2 * width])
            tables[:, :width] += c
    return tables, chunk_edges.tolist(), slots


_SMALLEST = np.array([2.0**-149], dtype=np.float32)
_SMALLEST_TORCH = torch.tensor([2.0**-149], dtype=torch.float32)


def _check_host_floats() -> None:
    """Refuse to sum where the host flushes subnormals to zero (a library built with fast
    math can set that for the whole process): peers would part ways silently, since a
    subnormal c or sum is as much part of the rule as any other."""
    if (_SMALLEST + _SMALLEST)[0] == 0 or (_SMALLEST_TORCH + _SMALLEST_TORCH).item() == 0:
        raise RuntimeError("this process flushes float32 subnormals to zero: ZO sums would differ from peers'")


KEYS_AT_ONCE = 1 << 20
"""Key pairs derived in one set of tensor ops (``_key_chunks``): parameters × updates, at
most this many (or one parameter), so a pass's keys take O(KEYS_AT_ONCE + K) memory."""


def _key_chunks(halves: torch.Tensor, count: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Parameters 0 .. count − 1's key pairs on the halves' device, a chunk of parameters at
    a time: (first index, [parameters, ka | kb, update] int32)."""
    per = max(1, KEYS_AT_ONCE // max(1, halves.shape[0]))
    for first in range(0, count, per):
        pairs = rng.params_keys(halves, first, min(per, count - first))
        # uint32 bit patterns stored as int32 (torch's uint32 support is thin); the kernels bitcast.
        yield first, torch.where(pairs >= 1 << 31, pairs - (1 << 32), pairs).to(torch.int32).contiguous()


HOST_KEYS = 1 << 16
"""At most this many key pairs (parameters × updates) a call are derived on the host
(``rng.params_keys_host``) and uploaded with c and the groups' edges in one copy: a ZO
step's (K = 1 to 64, gpt-125m's 148 parameters) in ~0.1 ms of NumPy, where the device's
~60 tensor ops are as many launches for the GPU to wait on between two calls (K = 1 at
0.38 of copy bandwidth on an H200 with them, 2026-11-27). A replay's thousands of
updates a call keep the device's derivation (NumPy's would take milliseconds there)."""


COALESCED_TILES = True
"""Versions 2 to 4: θ loaded and stored as whole [BLOCK] vectors and rearranged into the
word tiles by Triton (``_load_word_tiles``); False: tile by tile (before 2026-11-28),
kept for bench/zo_apply.py's comparison."""

DEFAULT_BLOCK = {1: 1024, 2: 4096, 3: 4096, 4: 1024}  # 2, 3: 1024 to 4096 within 4% on an H100
"""Elements per program, by generator version: measured on an H200 (bench/zo_apply.py
--mparams 256 --fused-only --blocks 1024,4096, 2026-11-26), version 1 ran at 0.88 of copy
bandwidth at K = 1 with 1024 (0.86 with 4096). Versions 2 to 4: one word of 32 elements a
thread (``num_warps_for``). Version 4 at K = 64 on an H100 (2026-11-28, coalesced tiles):
0.511 of copy bandwidth with 1024 (one warp a program), 0.494 with 2048, 0.472 with 4096."""


def num_warps_for(block: int, version: int = 1) -> int:
    """Warps per program. Version 1: 4 up to 2048 elements, 8 from 4096 (16 elements a
    thread there). Version 2: one per 1024 elements (1 to 8), so that a thread holds one
    whole word of 32 elements (its kernel makes a word's hash in each thread holding part
    of it)."""
    if version != 1:
        return min(8, max(1, block // 1024))
    return min(8, max(4, block // 512))


if triton is not None:

    @triton.jit
    def _mix(x):  # type: ignore[no-untyped-def]
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_kernel(theta_ptr, n, ka_ptr, kb_ptr, coeff_ptr, bounds_ptr, num_groups, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Version 1: one hash per element and update. Group g is updates
        [bounds[g], bounds[g + 1]); θ stays in registers from group to group."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        theta = tl.load(theta_ptr + offsets, mask=mask)  # in flight while the hashes are made
        index = offsets.to(tl.uint32)
        for g in range(num_groups):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k in range(tl.load(bounds_ptr + g), tl.load(bounds_ptr + g + 1)):
                ka = tl.load(ka_ptr + k).to(tl.uint32, bitcast=True)
                kb = tl.load(kb_ptr + k).to(tl.uint32, bitcast=True)
                c = tl.load(coeff_ptr + k)
                h = _mix(_mix(index ^ ka) + kb)
                acc += tl.where((h >> 31) != 0, -c, c)
            theta = theta - acc
        tl.store(theta_ptr + offsets, theta, mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _load_word_tiles(theta_ptr, n, BLOCK: tl.constexpr, COALESCED: tl.constexpr):  # type: ignore[no-untyped-def]
        """A program's θ as eight [4, words] tiles (tile q: lanes 4q to 4q + 3 of each word).
        COALESCED: loaded as one [BLOCK] vector (a warp loads 512 contiguous bytes an
        instruction) and rearranged into the tiles, which Triton does once, through shared
        memory and warp shuffles (how much of each depends on the block); else tile by
        tile, a thread loading its word's 16 bytes at a 128-byte stride (each instruction
        touches 32 cache lines)."""
        WORDS: tl.constexpr = BLOCK // 32
        if COALESCED:
            flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            whole = tl.load(theta_ptr + flat, mask=flat < n)
            # Element 32w + 16a + 8b + 4c + m at [m, w, a, b, c]; tile q = 4a + 2b + c.
            x = tl.permute(tl.reshape(whole, [WORDS, 2, 2, 2, 4]), (4, 0, 1, 2, 3))
            c0, c1 = tl.split(x)
            c0b0, c0b1 = tl.split(c0)
            c1b0, c1b1 = tl.split(c1)
            t0, t4 = tl.split(c0b0)
            t2, t6 = tl.split(c0b1)
            t1, t5 = tl.split(c1b0)
            t3, t7 = tl.split(c1b1)
            return t0, t1, t2, t3, t4, t5, t6, t7
        else:
            word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
            at = word[None, :] * 32 + tl.arange(0, 4)[:, None]  # [4, WORDS]: lanes 0 to 3 of each word
            return (
                tl.load(theta_ptr + at, mask=at < n),
                tl.load(theta_ptr + at + 4, mask=at + 4 < n),
                tl.load(theta_ptr + at + 8, mask=at + 8 < n),
                tl.load(theta_ptr + at + 12, mask=at + 12 < n),
                tl.load(theta_ptr + at + 16, mask=at + 16 < n),
                tl.load(theta_ptr + at + 20, mask=at + 20 < n),
                tl.load(theta_ptr + at + 24, mask=at + 24 < n),
                tl.load(theta_ptr + at + 28, mask=at + 28 < n),
            )

    @triton.jit  # type: ignore[untyped-decorator]
    def _store_word_tiles(theta_ptr, n, BLOCK: tl.constexpr, COALESCED: tl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7):  # type: ignore[no-untyped-def]
        """``_load_word_tiles`` backwards."""
        WORDS: tl.constexpr = BLOCK // 32
        if COALESCED:
            flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            c0 = tl.join(tl.join(t0, t4), tl.join(t2, t6))
            c1 = tl.join(tl.join(t1, t5), tl.join(t3, t7))
            tl.store(theta_ptr + flat, tl.reshape(tl.permute(tl.join(c0, c1), (1, 2, 3, 4, 0)), [BLOCK]), mask=flat < n)
        else:
            word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
            at = word[None, :] * 32 + tl.arange(0, 4)[:, None]
            tl.store(theta_ptr + at, t0, mask=at < n)
            tl.store(theta_ptr + at + 4, t1, mask=at + 4 < n)
            tl.store(theta_ptr + at + 8, t2, mask=at + 8 < n)
            tl.store(theta_ptr + at + 12, t3, mask=at + 12 < n)
            tl.store(theta_ptr + at + 16, t4, mask=at + 16 < n)
            tl.store(theta_ptr + at + 20, t5, mask=at + 20 < n)
            tl.store(theta_ptr + at + 24, t6, mask=at + 24 < n)
            tl.store(theta_ptr + at + 28, t7, mask=at + 28 < n)

    @triton.jit  # type: ignore[untyped-decorator]
    def _zero_tiles(WORDS: tl.constexpr):  # type: ignore[no-untyped-def]
        """Eight [4, WORDS] float32 tiles of +0.0: a group's sums, one a word tile."""
        z = tl.zeros([4, WORDS], dtype=tl.float32)
        return z, z, z, z, z, z, z, z

    @triton.jit
    def _minus_tiles(t0, t1, t2, t3, t4, t5, t6, t7, a0, a1, a2, a3, a4, a5, a6, a7):  # type: ignore[no-untyped-def]
        """θ ← θ − acc for each of the eight word tiles (once a group)."""
        return t0 - a0, t1 - a1, t2 - a2, t3 - a3, t4 - a4, t5 - a5, t6 - a6, t7 - a7

    @triton.jit
    def _signed(h, shift, c):  # type: ignore[no-untyped-def]
        """±c as float32: c's sign bit xor'ed with the bit of ``h`` that ``shift`` moves to
        bit 31 (IEEE negation flips that bit and nothing else, so the bits are those of
        where(negative, −c, c), ±0 and subnormals included)."""
        return (((h << shift) & 0x80000000) ^ c).to(tl.float32, bitcast=True)

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_v2_kernel(  # type: ignore[no-untyped-def]
        theta_ptr,
        n,
        ka_ptr,
        kb_ptr,
        coeff_ptr,
        bounds_ptr,
        num_groups,
        BLOCK: tl.constexpr,
        COALESCED: tl.constexpr = True,
    ):
        """Version 2: one hash per word of 32 elements, made by the one thread that holds
        the word's 32 elements. θ is held as eight [4, words] tiles (tile q: lanes 4q to
        4q + 3 of each word), words along the tiles' last dimension: Triton lays such a
        tile out with a word's 4 lanes in one thread and the words across threads, so the
        hash, made on the [words] vector, is made once per word and thread (with 1024
        elements per warp, one word per thread). A [words, 32] tile (the first version of
        this kernel) was laid out with a word's lanes across a warp's 32 threads, each
        making the word's hash: one hash per element, as version 1. Per element and
        update (sm_90 SASS, block 4096, 4 warps): 4.1 instructions (a shift, an and-xor,
        an add, 1/32 of the hash) against version 1's 21."""
        WORDS: tl.constexpr = BLOCK // 32
        word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
        quad = tl.arange(0, 4)
        t0, t1, t2, t3, t4, t5, t6, t7 = _load_word_tiles(theta_ptr, n, BLOCK, COALESCED)
        index = word.to(tl.uint32)
        shift = (31 - quad).to(tl.uint32)[:, None]  # bit j of the word up to bit 31: 31 − j
        for g in range(num_groups):
            a0, a1, a2, a3, a4, a5, a6, a7 = _zero_tiles(WORDS)
            for k in range(tl.load(bounds_ptr + g), tl.load(bounds_ptr + g + 1)):
                ka = tl.load(ka_ptr + k).to(tl.uint32, bitcast=True)
                kb = tl.load(kb_ptr + k).to(tl.uint32, bitcast=True)
                c = tl.load(coeff_ptr + k).to(tl.uint32, bitcast=True)
                h = _mix(_mix(index ^ ka) + kb)[None, :]
                a0 += _signed(h, shift, c)
                a1 += _signed(h, shift - 4, c)
                a2 += _signed(h, shift - 8, c)
                a3 += _signed(h, shift - 12, c)
                a4 += _signed(h, shift - 16, c)
                a5 += _signed(h, shift - 20, c)
                a6 += _signed(h, shift - 24, c)
                a7 += _signed(h, shift - 28, c)
            t0, t1, t2, t3, t4, t5, t6, t7 = _minus_tiles(
                t0, t1, t2, t3, t4, t5, t6, t7, a0, a1, a2, a3, a4, a5, a6, a7
            )
        _store_word_tiles(theta_ptr, n, BLOCK, COALESCED, t0, t1, t2, t3, t4, t5, t6, t7)

    @triton.jit  # type: ignore[untyped-decorator]
    def _cross(a, b, d: tl.constexpr, m: tl.constexpr):  # type: ignore[no-untyped-def]
        """Two words of 8 swap bits: a's bits at the positions m << d for b's at m (a delta
        swap: one step of the transpose that turns 8 updates' words into bytes of signs)."""
        x = ((a >> d) ^ b) & m
        return a ^ (x << d), b ^ x

    @triton.jit
    def _word(index, ka_ptr, kb_ptr, k):  # type: ignore[no-untyped-def]
        """Update k's signs for the words ``index``: bits(s, p, w) of kernels/rng.py."""
        ka = tl.load(ka_ptr + k).to(tl.uint32, bitcast=True)
        kb = tl.load(kb_ptr + k).to(tl.uint32, bitcast=True)
        return _mix(_mix(index ^ ka) + kb)

    @triton.jit
    def _part(table, word, shift):  # type: ignore[no-untyped-def]
        """A [4, words] tile's chunk parts: byte ``shift`` / 8 of each word, looked up."""
        return tl.load(table + ((word[None, :] >> shift) & 0xFF))

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_v3_kernel(  # type: ignore[no-untyped-def]
        theta_ptr,
        n,
        ka_ptr,
        kb_ptr,
        table_ptr,
        chunks_ptr,
        num_groups,
        BLOCK: tl.constexpr,
        COALESCED: tl.constexpr = True,
    ):
        """Version 3: θ in version 2's layout (a word of 32 elements in one thread, as eight
        [4, words] tiles); per chunk of 8 updates, the 8 hash words (update j's word holds
        bit e for element e) are transposed by five delta swaps so that element 4q + m's 8
        signs are byte m of word W(q) (bit j: update j), and that byte picks the chunk's
        part from its table of 256 (``chunk_tables``): one load and one add per element and
        chunk instead of 8 shifts, and-xors and adds. ``ka``/``kb`` are the chunks' slots
        (``slots``), 8 a chunk; group g is chunks [chunks[g], chunks[g + 1])."""
        WORDS: tl.constexpr = BLOCK // 32
        word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
        quad = tl.arange(0, 4)
        t0, t1, t2, t3, t4, t5, t6, t7 = _load_word_tiles(theta_ptr, n, BLOCK, COALESCED)
        index = word.to(tl.uint32)
        shift = (8 * quad).to(tl.uint32)[:, None]  # row m of a tile: byte m
        for g in range(num_groups):
            a0, a1, a2, a3, a4, a5, a6, a7 = _zero_tiles(WORDS)
            for c in range(tl.load(chunks_ptr + g), tl.load(chunks_ptr + g + 1)):
                k = c * 8
                h0 = _word(index, ka_ptr, kb_ptr, k)
                h1 = _word(index, ka_ptr, kb_ptr, k + 1)
                h2 = _word(index, ka_ptr, kb_ptr, k + 2)
                h3 = _word(index, ka_ptr, kb_ptr, k + 3)
                h4 = _word(index, ka_ptr, kb_ptr, k + 4)
                h5 = _word(index, ka_ptr, kb_ptr, k + 5)
                h6 = _word(index, ka_ptr, kb_ptr, k + 6)
                h7 = _word(index, ka_ptr, kb_ptr, k + 7)
                # Word index bits (j2 j1 j0), bit index (e4 e3 e2 e1 e0) → word (e2 e4 e3),
                # bit (e1 e0 j2 j1 j0): five swaps of a word-index bit with a bit-index bit.
                h0, h4 = _cross(h0, h4, 4, 0x0F0F0F0F)  # j2 ↔ e2
                h1, h5 = _cross(h1, h5, 4, 0x0F0F0F0F)
                h2, h6 = _cross(h2, h6, 4, 0x0F0F0F0F)
                h3, h7 = _cross(h3, h7, 4, 0x0F0F0F0F)
                h0, h2 = _cross(h0, h2, 2, 0x33333333)  # j1 ↔ e1
                h1, h3 = _cross(h1, h3, 2, 0x33333333)
                h4, h6 = _cross(h4, h6, 2, 0x33333333)
                h5, h7 = _cross(h5, h7, 2, 0x33333333)
                h0, h2 = _cross(h0, h2, 16, 0x0000FFFF)  # (e1 there now) ↔ e4
                h1, h3 = _cross(h1, h3, 16, 0x0000FFFF)
                h4, h6 = _cross(h4, h6, 16, 0x0000FFFF)
                h5, h7 = _cross(h5, h7, 16, 0x0000FFFF)
                h0, h1 = _cross(h0, h1, 1, 0x55555555)  # j0 ↔ e0
                h2, h3 = _cross(h2, h3, 1, 0x55555555)
                h4, h5 = _cross(h4, h5, 1, 0x55555555)
                h6, h7 = _cross(h6, h7, 1, 0x55555555)
                h0, h1 = _cross(h0, h1, 8, 0x00FF00FF)  # (e0 there now) ↔ e3
                h2, h3 = _cross(h2, h3, 8, 0x00FF00FF)
                h4, h5 = _cross(h4, h5, 8, 0x00FF00FF)
                h6, h7 = _cross(h6, h7, 8, 0x00FF00FF)
                table = table_ptr + c * 256  # int32: apply_triton bounds the tables
                a0 += _part(table, h0, shift)  # tile q reads word W(q) = 4·q0 + 2·q2 + q1
                a1 += _part(table, h4, shift)
                a2 += _part(table, h1, shift)
                a3 += _part(table, h5, shift)
                a4 += _part(table, h2, shift)
                a5 += _part(table, h6, shift)
                a6 += _part(table, h3, shift)
                a7 += _part(table, h7, shift)
            t0, t1, t2, t3, t4, t5, t6, t7 = _minus_tiles(
                t0, t1, t2, t3, t4, t5, t6, t7, a0, a1, a2, a3, a4, a5, a6, a7
            )
        _store_word_tiles(theta_ptr, n, BLOCK, COALESCED, t0, t1, t2, t3, t4, t5, t6, t7)

    @triton.jit
    def _lane(like):  # type: ignore[no-untyped-def]
        """This thread's lane in its warp (0 to 31), in ``like``'s shape."""
        return tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=tl.uint32, is_pure=True, pack=1)

    @triton.jit  # type: ignore[untyped-decorator]
    def _nibble_part(table, word, shift, SHUFFLE: tl.constexpr):  # type: ignore[no-untyped-def]
        """A [4, words] tile's chunk parts: the nibble of each word at bit ``shift`` (rows:
        shift, shift + 8, …), looked up. SHUFFLE: ``table`` is the chunk's entry of this
        thread's lane (lane L holds entry L mod 16) and one ``shfl.sync.idx`` fetches entry
        b from lane b; it reads only the index's low 5 bits, so bit 4 (the next nibble's
        bit 0) picks lane b + 16, which holds the same entry. To Triton the entries are
        ordinary values: a layout conversion that moved them between lanes would break this
        without a word (Triton 3.9's code for sm_90 has none for blocks 32 to 16384, and
        those blocks gave the reference's bits on an H200; the CUDA tests, blocks 32 to
        4096, would catch one). Else ``table`` points at the 16 entries in
        memory (Triton's interpreter runs no PTX)."""
        index = word[None, :] >> shift
        if SHUFFLE:
            held = tl.broadcast_to(table[None, :], index.shape)
            return tl.inline_asm_elementwise(
                "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;",
                "=r,r,r",
                [held, index],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        else:
            return tl.load(table + (index & 0xF))

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_v4_kernel(  # type: ignore[no-untyped-def]
        theta_ptr,
        n,
        ka_ptr,
        kb_ptr,
        table_ptr,
        chunks_ptr,
        num_groups,
        BLOCK: tl.constexpr,
        COALESCED: tl.constexpr = True,
        SHUFFLE: tl.constexpr = True,
    ):
        """Version 4: version 3's kernel with chunks of 4 updates, whose table of 16 entries
        a warp holds in registers (lane L: entry L mod 16) and looks up with one warp
        shuffle, not a load: version 3's lookups are gathers over a table's 8 cache lines.
        Per chunk, the 4 hash words are transposed by four delta swaps so that element
        4q + m's 4 signs are the nibble at bit 8m + 4·(q mod 2) of word q // 2 (bit j:
        update j). ``ka``/``kb``: the chunks' slots, 4 a chunk; group g is chunks
        [chunks[g], chunks[g + 1]). A warp's 32 lanes must all run each shuffle: every
        thread runs every step (loads and stores are masked, not skipped)."""
        WORDS: tl.constexpr = BLOCK // 32
        word = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
        t0, t1, t2, t3, t4, t5, t6, t7 = _load_word_tiles(theta_ptr, n, BLOCK, COALESCED)
        index = word.to(tl.uint32)
        shift = (8 * tl.arange(0, 4)).to(tl.uint32)[:, None]  # row m of a tile: bits 8m to 8m + 7
        if SHUFFLE:
            entry = _lane(index) & 15
        for g in range(num_groups):
            a0, a1, a2, a3, a4, a5, a6, a7 = _zero_tiles(WORDS)
            for c in range(tl.load(chunks_ptr + g), tl.load(chunks_ptr + g + 1)):
                k = c * 4
                h0 = _word(index, ka_ptr, kb_ptr, k)
                h1 = _word(index, ka_ptr, kb_ptr, k + 1)
                h2 = _word(index, ka_ptr, kb_ptr, k + 2)
                h3 = _word(index, ka_ptr, kb_ptr, k + 3)
                # Word index bits (j1 j0), bit index (e4 e3 e2 e1 e0) → word (e4 e3), bit
                # (e1 e0 e2 j1 j0): four swaps of a word-index bit with a bit-index bit.
                h0, h2 = _cross(h0, h2, 2, 0x33333333)  # j1 ↔ e1
                h1, h3 = _cross(h1, h3, 2, 0x33333333)
                h0, h2 = _cross(h0, h2, 16, 0x0000FFFF)  # (e1 there now) ↔ e4
                h1, h3 = _cross(h1, h3, 16, 0x0000FFFF)
                h0, h1 = _cross(h0, h1, 1, 0x55555555)  # j0 ↔ e0
                h2, h3 = _cross(h2, h3, 1, 0x55555555)
                h0, h1 = _cross(h0, h1, 8, 0x00FF00FF)  # (e0 there now) ↔ e3
                h2, h3 = _cross(h2, h3, 8, 0x00FF00FF)
                if SHUFFLE:  # noqa: SIM108 (Triton: `entry` exists only then)
                    table = tl.load(table_ptr + c * 16 + entry)  # int32: apply_triton bounds the tables
                else:
                    table = table_ptr + c * 16
                a0 += _nibble_part(table, h0, shift, SHUFFLE)  # tile q: word q // 2, nibble q mod 2
                a1 += _nibble_part(table, h0, shift + 4, SHUFFLE)
                a2 += _nibble_part(table, h1, shift, SHUFFLE)
                a3 += _nibble_part(table, h1, shift + 4, SHUFFLE)
                a4 += _nibble_part(table, h2, shift, SHUFFLE)
                a5 += _nibble_part(table, h2, shift + 4, SHUFFLE)
                a6 += _nibble_part(table, h3, shift, SHUFFLE)
                a7 += _nibble_part(table, h3, shift + 4, SHUFFLE)
            t0, t1, t2, t3, t4, t5, t6, t7 = _minus_tiles(
                t0, t1, t2, t3, t4, t5, t6, t7, a0, a1, a2, a3, a4, a5, a6, a7
            )
        _store_word_tiles(theta_ptr, n, BLOCK, COALESCED, t0, t1, t2, t3, t4, t5, t6, t7)


def _aligned(count: int) -> int:
    """``count`` int32s rounded up to 16 bytes (Triton specializes a kernel on pointers'
    16-byte alignment: the packed upload's sections keep it)."""
    return -(-count // 4) * 4


def _interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (TRITON_INTERPRET, read when the
    kernel was made), which runs no inline PTX."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def _require_cuda(params: Sequence[torch.Tensor]) -> None:
    for p, param in enumerate(params):
        if param.device.type != "cuda":
            raise ValueError(f"parameter {p} is on {param.device}, the kernel needs CUDA")


@torch.no_grad()
def apply_triton(
    params: Sequence[torch.Tensor],
    seeds: Sequence[int],
    coeffs: torch.Tensor,
    *,
    version: int = 1,
    ends: Sequence[int] | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """The fused kernel of generator ``version``: CUDA parameters only; same bits as
    ``apply_reference`` (``ends`` as there: every group in one launch per parameter).
    ``block``: elements per program (a power of two, at least 32; by default
    ``DEFAULT_BLOCK[version]``); ``num_warps``: by default ``num_warps_for(block, version)``."""
    if triton is None:
        raise RuntimeError("Triton is not installed (CUDA builds of torch bring it)")
    edges = _check(params, seeds, coeffs, version, ends)
    block = DEFAULT_BLOCK[version] if block is None else block
    if block < rng.SIGNS_PER_WORD or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least {rng.SIGNS_PER_WORD}, got {block}")
    if not seeds or not params:
        return
    _require_cuda(params)
    kernel = {1: _apply_kernel, 2: _apply_v2_kernel, 3: _apply_v3_kernel, 4: _apply_v4_kernel}[version]
    options: dict[str, bool] = {}
    if version != 1:
        options["COALESCED"] = COALESCED_TILES
    if version == 4:  # Triton's interpreter runs no inline PTX: it takes the tables from memory
        options["SHUFFLE"] = not _interpreted(kernel)
    warps = num_warps_for(block, version) if num_warps is None else num_warps
    device = params[0].device
    # What the kernel sums and where its groups end: c and the groups' edges, or (version 3)
    # the chunks' tables and the groups' chunk edges, with each chunk's 8 key slots.
    host_values = coeffs.detach().cpu().numpy()
    host_edges, take = edges, None
    if version in CHUNK_UPDATES:
        tables, host_edges, slots = chunk_tables(host_values, edges, CHUNK_UPDATES[version])
        host_values, take = tables.ravel(), slots.ravel()
    # Uploads without a wait (``rng.upload``): the launches queue behind the last call's.
    if len(params) * len(seeds) <= HOST_KEYS:  # the keys, c and the groups' edges in one upload
        keys = rng.params_keys_host(seeds, 0, len(params))
        keys = (keys if take is None else keys[:, :, take]).view(np.int32)
        # 16-byte starts
        at_edges, at_keys = _aligned(host_values.size), _aligned(host_values.size) + _aligned(len(host_edges))
        packed = np.zeros(at_keys + keys.size, dtype=np.int32)
        packed[: host_values.size] = host_values.view(np.int32)
        packed[at_edges : at_edges + len(host_edges)] = host_edges
        packed[at_keys:] = keys.ravel()
        uploaded = rng.upload(torch.from_numpy(packed), device)
        values = uploaded[: host_values.size].view(torch.float32)
        starts = uploaded[at_edges : at_edges + len(host_edges)]
        chunks: Iterable[tuple[int, torch.Tensor]] = [(0, uploaded[at_keys:].view(keys.shape))]
    else:  # derived on the device, many parameters at once
        halves, values = rng.seed_halves(seeds, device=device), rng.upload(torch.from_numpy(host_values), device)
        starts = rng.upload(torch.tensor(host_edges, dtype=torch.int32), device)
        chunks = _key_chunks(halves, len(params))
        if take is not None:
            slots_on_device = rng.upload(torch.from_numpy(take), device)
            chunks = ((first, chunk.index_select(2, slots_on_device)) for first, chunk in chunks)
    for first, chunk in chunks:
        for j, keys in enumerate(chunk):
            param = params[first + j]
            if param.device != values.device:
                values, starts = values.to(param.device), starts.to(param.device)
            keys = keys.to(param.device)
            grid = (triton.cdiv(param.numel(), block),)
            kernel[grid](
                param,
                param.numel(),
                keys[0],
                keys[1],
                values,
                starts,
                len(edges) - 1,
                BLOCK=block,
                num_warps=warps,
                **options,
            )


def apply(
    params: Sequence[torch.Tensor],
    seeds: Sequence[int],
    coeffs: torch.Tensor,
    *,
    version: int = 1,
    ends: Sequence[int] | None = None,
) -> None:
    """The fused kernel of ``version`` on CUDA when Triton is there, ``apply_cpu`` on a CPU,
    the torch reference otherwise (same bits: tests/test_zo_apply.py compares each with the
    reference bit for bit, the kernels where a GPU is present; see the module docstring for
    what has run where). ``ends``: the groups, as ``apply_reference`` takes them."""
    if version in rng.VERSIONS and triton is not None and params and all(p.device.type == "cuda" for p in params):
        apply_triton(params, seeds, coeffs, version=version, ends=ends)
    elif all(p.device.type == "cpu" for p in params):
        apply_cpu(params, seeds, coeffs, version=version, ends=ends)
    else:
        apply_reference(params, seeds, coeffs, version=version, ends=ends)
