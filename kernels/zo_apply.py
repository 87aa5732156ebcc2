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
"""

import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from kernels import rng

CHUNK = 1 << 20
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


_NEGATIVE = {1: _negative, 2: _negative_v2}


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
                for ka, kb, c in zip(kas[begin:end], kbs[begin:end], values[begin:end], strict=True):
                    negative = negative_fn(index, torch.tensor(ka), torch.tensor(kb))
                    acc += torch.where(negative, -c, c)
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
        segment = flat[start : start + count]
        for begin, end in itertools.pairwise(edges):
            acc.fill(0.0)
            for k in range(begin, end):
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
                acc += sign.view(np.float32)
            segment -= acc


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

DEFAULT_BLOCK = {1: 1024, 2: 4096}
"""Elements per program, by generator version: measured on an H200 (bench/zo_apply.py
--mparams 256 --fused-only --blocks 1024,4096, 2026-11-26), version 1 ran at 0.88 of copy
bandwidth at K = 1 with 1024 (0.86 with 4096). Version 2: 4096 with 4 warps (one word
of 32 elements a thread, ``num_warps_for``), not measured on a GPU in this layout."""


def num_warps_for(block: int, version: int = 1) -> int:
    """Warps per program. Version 1: 4 up to 2048 elements, 8 from 4096 (16 elements a
    thread there). Version 2: one per 1024 elements (1 to 8), so that a thread holds one
    whole word of 32 elements (its kernel makes a word's hash in each thread holding part
    of it)."""
    if version == 2:
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

    @triton.jit
    def _signed(h, shift, c):  # type: ignore[no-untyped-def]
        """±c as float32: c's sign bit xor'ed with the bit of ``h`` that ``shift`` moves to
        bit 31 (IEEE negation flips that bit and nothing else, so the bits are those of
        where(negative, −c, c), ±0 and subnormals included)."""
        return (((h << shift) & 0x80000000) ^ c).to(tl.float32, bitcast=True)

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_v2_kernel(theta_ptr, n, ka_ptr, kb_ptr, coeff_ptr, bounds_ptr, num_groups, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
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
        at = word[None, :] * 32 + quad[:, None]  # [4, WORDS]: lanes 0 to 3 of each word
        t0 = tl.load(theta_ptr + at, mask=at < n)
        t1 = tl.load(theta_ptr + at + 4, mask=at + 4 < n)
        t2 = tl.load(theta_ptr + at + 8, mask=at + 8 < n)
        t3 = tl.load(theta_ptr + at + 12, mask=at + 12 < n)
        t4 = tl.load(theta_ptr + at + 16, mask=at + 16 < n)
        t5 = tl.load(theta_ptr + at + 20, mask=at + 20 < n)
        t6 = tl.load(theta_ptr + at + 24, mask=at + 24 < n)
        t7 = tl.load(theta_ptr + at + 28, mask=at + 28 < n)
        index = word.to(tl.uint32)
        shift = (31 - quad).to(tl.uint32)[:, None]  # bit j of the word up to bit 31: 31 − j
        for g in range(num_groups):
            a0 = tl.zeros([4, WORDS], dtype=tl.float32)
            a1 = tl.zeros([4, WORDS], dtype=tl.float32)
            a2 = tl.zeros([4, WORDS], dtype=tl.float32)
            a3 = tl.zeros([4, WORDS], dtype=tl.float32)
            a4 = tl.zeros([4, WORDS], dtype=tl.float32)
            a5 = tl.zeros([4, WORDS], dtype=tl.float32)
            a6 = tl.zeros([4, WORDS], dtype=tl.float32)
            a7 = tl.zeros([4, WORDS], dtype=tl.float32)
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
            t0 = t0 - a0
            t1 = t1 - a1
            t2 = t2 - a2
            t3 = t3 - a3
            t4 = t4 - a4
            t5 = t5 - a5
            t6 = t6 - a6
            t7 = t7 - a7
        tl.store(theta_ptr + at, t0, mask=at < n)
        tl.store(theta_ptr + at + 4, t1, mask=at + 4 < n)
        tl.store(theta_ptr + at + 8, t2, mask=at + 8 < n)
        tl.store(theta_ptr + at + 12, t3, mask=at + 12 < n)
        tl.store(theta_ptr + at + 16, t4, mask=at + 16 < n)
        tl.store(theta_ptr + at + 20, t5, mask=at + 20 < n)
        tl.store(theta_ptr + at + 24, t6, mask=at + 24 < n)
        tl.store(theta_ptr + at + 28, t7, mask=at + 28 < n)


def _aligned(count: int) -> int:
    """``count`` int32s rounded up to 16 bytes (Triton specializes a kernel on pointers'
    16-byte alignment: the packed upload's sections keep it)."""
    return -(-count // 4) * 4


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
    kernel = _apply_kernel if version == 1 else _apply_v2_kernel
    warps = num_warps_for(block, version) if num_warps is None else num_warps
    device = params[0].device
    # Uploads without a wait (``rng.upload``): the launches queue behind the last call's.
    if len(params) * len(seeds) <= HOST_KEYS:  # the keys, c and the groups' edges in one upload
        keys = rng.params_keys_host(seeds, 0, len(params)).view(np.int32)
        at_edges, at_keys = _aligned(len(seeds)), _aligned(len(seeds)) + _aligned(len(edges))  # 16-byte starts
        packed = np.zeros(at_keys + keys.size, dtype=np.int32)
        packed[: len(seeds)] = coeffs.detach().cpu().numpy().view(np.int32)
        packed[at_edges : at_edges + len(edges)] = edges
        packed[at_keys:] = keys.ravel()
        uploaded = rng.upload(torch.from_numpy(packed), device)
        values, starts = uploaded[: len(seeds)].view(torch.float32), uploaded[at_edges : at_edges + len(edges)]
        chunks: Iterable[tuple[int, torch.Tensor]] = [(0, uploaded[at_keys:].view(keys.shape))]
    else:  # derived on the device, many parameters at once
        halves, values = rng.seed_halves(seeds, device=device), rng.upload(coeffs, device)
        starts = rng.upload(torch.tensor(edges, dtype=torch.int32), device)
        chunks = _key_chunks(halves, len(params))
    for first, chunk in chunks:
        for j, keys in enumerate(chunk):
            param = params[first + j]
            if param.device != values.device:
                values, starts = values.to(param.device), starts.to(param.device)
            keys = keys.to(param.device)
            grid = (triton.cdiv(param.numel(), block),)
            kernel[grid](
                param, param.numel(), keys[0], keys[1], values, starts, len(edges) - 1, BLOCK=block, num_warps=warps
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
