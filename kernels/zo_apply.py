"""Apply K zeroth-order updates in one pass: θ_p ← θ_p − Σ_k c_k·z(s_k, p, ·), c_k = lr·g_k.

Every peer must end with the same bits, so the arithmetic is fixed (version 1):

- c_k is float32(lr) × float32(g_k), rounded to float32 (``coefficients``), computed once
  and handed to every implementation;
- per element, acc starts at +0.0 (float32) and adds ±c_k for k = 0, 1, …, K−1 in the
  log's canonical order (c_k·z is exact: z = ±1, so fused multiply-add changes nothing);
- then θ ← θ − acc, once, in float32.

``apply_reference`` does that with torch on any device (chunked, so its temporaries stay
small); ``apply_triton`` is the fused GPU kernel: one read and one write of θ whatever K
is, z generated in registers (kernels/rng.py's definition in uint32). Tests compare the two
bit for bit where a GPU is present.
"""

from collections.abc import Callable, Sequence

import torch

from kernels import rng

CHUNK = 1 << 20
# Above this many (element × update) pairs in one call, the CPU path generates z with a
# torch.compile'd kernel (≈ 5× faster here; integer ops only, so the bits are the same)
# that takes seconds to compile once per process: worth it for replays, not for tiny calls.
COMPILE_ABOVE = 1 << 28

try:  # Triton comes with CUDA builds of torch; the CPU wheel has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def coefficients(lr: float, gs: Sequence[float]) -> torch.Tensor:
    """c_k = float32(lr) · float32(g_k), in float32: the one recipe every peer uses."""
    return torch.tensor(list(gs), dtype=torch.float32) * torch.tensor(lr, dtype=torch.float32)


def _check(params: Sequence[torch.Tensor], seeds: Sequence[int], coeffs: torch.Tensor) -> None:
    if coeffs.dtype != torch.float32 or coeffs.shape != (len(seeds),):
        raise ValueError(f"need {len(seeds)} float32 coefficients, got {coeffs.dtype} × {tuple(coeffs.shape)}")
    for p, param in enumerate(params):
        if param.dtype != torch.float32 or not param.is_contiguous():
            raise ValueError(f"parameter {p} must be contiguous float32 (the canonical weights), got {param.dtype}")
        if param.numel() > rng.MAX_ELEMENTS:
            raise ValueError(f"parameter {p} has more than 2**32 elements")


def _negative(index: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """z(s, p, i) < 0 for a range of element indices i (kernels/rng.py's definition, version 1)."""
    return (rng.hash_index(index, ka, kb) >> 31).bool()


def _negative_v2(index: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """The same for version 2: one hash per 32 elements (``index`` starts at a multiple of 32)."""
    words = rng.hash_index(index[:: rng.SIGNS_PER_WORD] >> 5, ka, kb)
    return rng.words_to_sign_bits(words, 0, index.numel()).bool()


NegativeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_PLAIN: dict[int, NegativeFn] = {1: _negative, 2: _negative_v2}
_compiled: dict[int, NegativeFn] = {}


def _negative_fn(work: int, version: int) -> NegativeFn:
    if version not in _PLAIN:
        raise ValueError(f"unknown generator version {version} (known: {rng.VERSIONS})")
    # Version 2 is not compiled: here its plain form ran 1.4x faster than the compiled one
    # (bench/zo_apply.py --mparams 4: 0.86 against 0.62 GB/s at K = 1).
    if work <= COMPILE_ABOVE or version == 2:
        return _PLAIN[version]
    if version not in _compiled:
        _compiled[version] = torch.compile(_PLAIN[version], dynamic=True)
    return _compiled[version]


@torch.no_grad()
def apply_reference(
    params: Sequence[torch.Tensor], seeds: Sequence[int], coeffs: torch.Tensor, *, version: int = 1
) -> None:
    """In place, on the parameters' device, in the canonical order; z of generator ``version``."""
    _check(params, seeds, coeffs)
    values = coeffs.tolist()
    negative_fn = _negative_fn(sum(p.numel() for p in params) * len(seeds), version)
    # Version 2's chunks start at a word (its 32 signs come from one hash).
    chunk = CHUNK if version == 1 else max(rng.SIGNS_PER_WORD, CHUNK - CHUNK % rng.SIGNS_PER_WORD)
    for p, param in enumerate(params):
        flat = param.view(-1)
        keys = [rng.key(seed, p) for seed in seeds]
        for start in range(0, flat.numel(), chunk):
            count = min(chunk, flat.numel() - start)
            index = torch.arange(start, start + count, dtype=torch.int64, device=param.device)
            acc = torch.zeros(count, dtype=torch.float32, device=param.device)
            for (ka, kb), c in zip(keys, values, strict=True):
                negative = negative_fn(index, torch.tensor(ka), torch.tensor(kb))
                acc += torch.where(negative, -c, c)
            flat[start : start + count] -= acc


def _keys(seeds: Sequence[int], param_index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [rng.key(seed, param_index) for seed in seeds]
    # uint32 bit patterns stored as int32 (torch's uint32 support is thin); the kernel bitcasts.
    ka = torch.tensor([a - (1 << 32) if a >= 1 << 31 else a for a, _ in pairs], dtype=torch.int32, device=device)
    kb = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for _, b in pairs], dtype=torch.int32, device=device)
    return ka, kb


if triton is not None:

    @triton.jit
    def _mix(x):  # type: ignore[no-untyped-def]
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit  # type: ignore[untyped-decorator]
    def _apply_kernel(theta_ptr, n, ka_ptr, kb_ptr, coeff_ptr, num_updates, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        index = offsets.to(tl.uint32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(num_updates):
            ka = tl.load(ka_ptr + k).to(tl.uint32, bitcast=True)
            kb = tl.load(kb_ptr + k).to(tl.uint32, bitcast=True)
            c = tl.load(coeff_ptr + k)
            h = _mix(_mix(index ^ ka) + kb)
            acc += tl.where((h >> 31) != 0, -c, c)
        theta = tl.load(theta_ptr + offsets, mask=mask)
        tl.store(theta_ptr + offsets, theta - acc, mask=mask)


@torch.no_grad()
def apply_triton(
    params: Sequence[torch.Tensor], seeds: Sequence[int], coeffs: torch.Tensor, *, block: int = 1024
) -> None:
    """The fused kernel: CUDA parameters only; same bits as ``apply_reference``."""
    if triton is None:
        raise RuntimeError("Triton is not installed (CUDA builds of torch bring it)")
    _check(params, seeds, coeffs)
    if not seeds:
        return
    for p, param in enumerate(params):
        if param.device.type != "cuda":
            raise ValueError(f"parameter {p} is on {param.device}, the kernel needs CUDA")
        ka, kb = _keys(seeds, p, param.device)
        grid = (triton.cdiv(param.numel(), block),)
        _apply_kernel[grid](param, param.numel(), ka, kb, coeffs.to(param.device), len(seeds), BLOCK=block)


def apply(params: Sequence[torch.Tensor], seeds: Sequence[int], coeffs: torch.Tensor, *, version: int = 1) -> None:
    """The fused kernel on CUDA when Triton is there, the reference otherwise (same bits).
    Generator version 2 takes the reference on every device until a kernel of it has been
    checked bit for bit on a GPU (torch's integer ops give the same bits there)."""
    if version == 1 and triton is not None and params and all(p.device.type == "cuda" for p in params):
        apply_triton(params, seeds, coeffs)
    else:
        apply_reference(params, seeds, coeffs, version=version)
