"""Throughput of applying K zeroth-order updates: the one-pass apply against K separate passes.

For K = 1, 8, 64 updates on a flat float32 parameter buffer, prints GB/s of parameters
(numel × 4 bytes / time) for:
- ``reference``: kernels/zo_apply.apply_reference (one pass per chunk, z made on the fly);
- ``cpu`` and ``cpu_v2`` (CPU): kernels/zo_apply.apply_cpu, the same bits in NumPy's uint32
  arithmetic on cache-sized chunks (what ``apply`` takes on a CPU), generator versions 1, 2;
- ``naive``: K passes, θ −= c_k·z_k, each z_k materialized (what one would write first);
- ``reference_v2``: the reference with generator version 2 (32 signs per hash,
  ``zo.signs = 2``), and its ratio to version 1's;
  these are best of ``--repeats`` wall-clock runs; on a GPU only for K ≤ ``--reference-max-k``
  (at 256M parameters and K = 64 they took most of a minute) and not at all with
  ``--fused-only``;
- on a GPU, one row per ``--blocks`` size, ``fused`` and ``fused_v2`` to ``fused_v4``: the
  Triton kernels of generator versions 1 to 4 (median of triton.testing.do_bench, which warms up and
  flushes L2 between runs), and their HBM traffic (read + write of θ) as a fraction of a
  device-to-device copy of the same buffer into a preallocated one, timed the same way
  (the card's practical bandwidth); the issue's target is ≥ 60% of HBM bandwidth;
  ``fused_device_keys`` and ``fused_v2_device_keys`` the same calls with every key derived
  by the device's tensor ops (``zo_apply.HOST_KEYS`` = 0: a replay's large calls, and every
  call before 2026-11-27), and ``host_keys_over_device_keys`` the ratio;
  ``fused_v2_strided`` and ``fused_v4_strided`` with the word tiles loaded one by one
  (``zo_apply.COALESCED_TILES`` = False, before 2026-11-28), and ``coalesced_over_strided``.

    python bench/zo_apply.py [--mparams 16] [--device cpu|cuda] [--repeats 3] [--ks 1,8,64]
        [--blocks 1024,4096] [--fused-only] [--reference-max-k 8]
"""

import argparse
import json
import time
from collections.abc import Callable

import torch

from kernels import rng, zo_apply


def timed(fn: Callable[[], None], device: str, repeats: int) -> float:
    """Best of ``repeats`` wall-clock runs, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def timed_on_gpu(fn: Callable[[], object]) -> float:
    """Median of CUDA-event timings after a warm-up (triton.testing.do_bench), in seconds."""
    return float(zo_apply.triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3


def reference_row(theta: torch.Tensor, k: int, device: str, repeats: int) -> dict[str, object]:
    numel, nbytes = theta.numel(), theta.numel() * 4
    seeds = list(range(1, k + 1))
    coeffs = zo_apply.coefficients(1e-6, [1.0] * k)

    def naive() -> None:
        for seed, c in zip(seeds, coeffs.tolist(), strict=True):
            theta.sub_(rng.rademacher(seed, 0, numel, device=device), alpha=c)

    row: dict[str, object] = {"k": k}
    rates: dict[str, float] = {}
    for name, fn in (
        ("reference", lambda: zo_apply.apply_reference([theta], seeds, coeffs)),
        ("reference_v2", lambda: zo_apply.apply_reference([theta], seeds, coeffs, version=2)),
        *(
            (
                ("cpu", lambda: zo_apply.apply_cpu([theta], seeds, coeffs)),
                ("cpu_v2", lambda: zo_apply.apply_cpu([theta], seeds, coeffs, version=2)),
            )
            if device == "cpu"
            else ()
        ),
        ("naive", naive),
    ):
        rates[name] = nbytes / timed(fn, device, repeats) / 1e9
        row[f"{name}_gb_per_s"] = round(rates[name], 3)
    row["reference_vs_naive"] = round(rates["reference"] / rates["naive"], 3)
    # 32 signs per hash (zo.signs = 2) against version 1's best path on this device
    row["reference_v2_over_v1"] = round(rates["reference_v2"] / rates["reference"], 3)
    if device == "cpu":
        row["cpu_over_reference"] = round(rates["cpu"] / rates["reference"], 3)
        row["cpu_v2_over_cpu"] = round(rates["cpu_v2"] / rates["cpu"], 3)
    return row


def kernel_row(theta: torch.Tensor, k: int, block: int, copy_gb_per_s: float) -> dict[str, object]:
    nbytes = theta.numel() * 4
    seeds = list(range(1, k + 1))
    coeffs = zo_apply.coefficients(1e-6, [1.0] * k)
    row: dict[str, object] = {
        "k": k,
        "block": block,
        "num_warps": zo_apply.num_warps_for(block, 1),
        "num_warps_v2": zo_apply.num_warps_for(block, 2),
        "num_warps_v3": zo_apply.num_warps_for(block, 3),
        "num_warps_v4": zo_apply.num_warps_for(block, 4),
    }
    rates: dict[str, float] = {}
    host_keys, coalesced = zo_apply.HOST_KEYS, zo_apply.COALESCED_TILES
    for name, version, keys_limit, tiles in (
        ("fused", 1, host_keys, coalesced),
        ("fused_v2", 2, host_keys, coalesced),
        ("fused_device_keys", 1, 0, coalesced),
        ("fused_v2_device_keys", 2, 0, coalesced),
        ("fused_v3", 3, host_keys, coalesced),
        ("fused_v4", 4, host_keys, coalesced),
        ("fused_v2_strided", 2, host_keys, False),
        ("fused_v4_strided", 4, host_keys, False),
    ):
        zo_apply.HOST_KEYS = keys_limit  # 0: every key derived by the device's tensor ops (before 2026-11-27)
        zo_apply.COALESCED_TILES = tiles  # False: the word tiles loaded one by one (before 2026-11-28)
        try:
            seconds = timed_on_gpu(
                lambda v=version: zo_apply.apply_triton([theta], seeds, coeffs, version=v, block=block)
            )
        finally:
            zo_apply.HOST_KEYS, zo_apply.COALESCED_TILES = host_keys, coalesced
        rates[name] = nbytes / seconds / 1e9
        row[f"{name}_gb_per_s"] = round(rates[name], 3)
        # HBM traffic: one read and one write of θ
        row[f"{name}_fraction_of_copy_bandwidth"] = round(2 * rates[name] / copy_gb_per_s, 3)
    row["fused_v2_over_v1"] = round(rates["fused_v2"] / rates["fused"], 3)
    row["fused_v3_over_v2"] = round(rates["fused_v3"] / rates["fused_v2"], 3)
    row["fused_v4_over_v2"] = round(rates["fused_v4"] / rates["fused_v2"], 3)
    row["fused_v4_over_v3"] = round(rates["fused_v4"] / rates["fused_v3"], 3)
    row["coalesced_over_strided_v2"] = round(rates["fused_v2"] / rates["fused_v2_strided"], 3)
    row["coalesced_over_strided_v4"] = round(rates["fused_v4"] / rates["fused_v4_strided"], 3)
    row["host_keys_over_device_keys"] = round(rates["fused"] / rates["fused_device_keys"], 3)
    row["host_keys_over_device_keys_v2"] = round(rates["fused_v2"] / rates["fused_v2_device_keys"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mparams", type=float, default=16.0, help="parameters, in millions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3, help="wall-clock runs of each reference path (best)")
    parser.add_argument("--ks", default="1,8,64")
    parser.add_argument(
        "--blocks",
        default=",".join(str(b) for b in sorted(set(zo_apply.DEFAULT_BLOCK.values()))),
        help="GPU: the fused kernels' block sizes, one row each",
    )
    parser.add_argument("--fused-only", action="store_true", help="GPU: only the fused kernels and the copy")
    parser.add_argument("--reference-max-k", type=int, default=8, help="GPU: the reference paths only up to this K")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    if not on_gpu and args.fused_only:
        parser.error("--fused-only needs --device cuda (the fused kernels are Triton's)")
    if on_gpu and zo_apply.triton is None:
        parser.error("the fused kernels need Triton (CUDA builds of torch bring it)")
    ks = [int(x) for x in args.ks.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    numel = int(args.mparams * 1e6)
    # random weights, not zeros (which can hide unwritten outputs and run faster than real data)
    theta = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(args.device)
    out: dict[str, object] = {"bench": "zo_apply", **vars(args), "threads": torch.get_num_threads(), "results": []}
    copy_gb_per_s = 0.0
    if on_gpu:
        out["gpu"] = torch.cuda.get_device_name()
        target = torch.empty_like(theta)
        copy_gb_per_s = 2 * numel * 4 / timed_on_gpu(lambda: target.copy_(theta)) / 1e9  # read + write
        out["copy_gb_per_s"] = round(copy_gb_per_s, 1)
        del target
    rows: list[dict[str, object]] = []
    for k in ks:
        if not args.fused_only and (not on_gpu or k <= args.reference_max_k):
            rows.append(reference_row(theta, k, args.device, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
        for block in blocks if on_gpu else []:
            rows.append(kernel_row(theta, k, block, copy_gb_per_s))
            print(json.dumps(rows[-1]), flush=True)
    out["results"] = rows
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
