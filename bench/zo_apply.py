"""Throughput of applying K zeroth-order updates: the one-pass apply against K separate passes.

For K = 1, 8, 64 updates on a flat float32 parameter buffer, prints GB/s of parameters
(numel × 4 bytes / time) for:
- ``reference``: kernels/zo_apply.apply_reference (one pass per chunk, z made on the fly);
- ``naive``: K passes, θ −= c_k·z_k, each z_k materialized (what one would write first);
- on a GPU also ``fused``: the Triton kernel, and its HBM traffic (read + write of θ) as
  a fraction of a device-to-device copy measured in the same run (the card's practical
  bandwidth); the issue's target is ≥ 60% of HBM bandwidth.

    python bench/zo_apply.py [--mparams 16] [--device cpu|cuda] [--repeats 3]
"""

import argparse
import json
import time
from collections.abc import Callable

import torch

from kernels import rng, zo_apply


def timed(fn: Callable[[], None], device: str, repeats: int) -> float:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mparams", type=float, default=16.0, help="parameters, in millions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ks", default="1,8,64")
    args = parser.parse_args()
    numel = int(args.mparams * 1e6)
    theta = torch.zeros(numel, device=args.device)
    nbytes = numel * 4
    out: dict[str, object] = {"bench": "zo_apply", **vars(args), "threads": torch.get_num_threads(), "results": []}
    if args.device == "cuda":
        copy_s = timed(lambda: theta.clone(), args.device, args.repeats)
        out["copy_gb_per_s"] = round(2 * nbytes / copy_s / 1e9, 1)  # read + write
    for k in (int(x) for x in args.ks.split(",")):
        seeds = list(range(1, k + 1))
        coeffs = zo_apply.coefficients(1e-6, [1.0] * k)

        def naive(seeds: list[int] = seeds, coeffs: torch.Tensor = coeffs) -> None:
            for seed, c in zip(seeds, coeffs.tolist(), strict=True):
                theta.sub_(rng.rademacher(seed, 0, numel, device=args.device), alpha=c)

        row: dict[str, object] = {"k": k}
        for name, fn in (
            ("reference", lambda s=seeds, c=coeffs: zo_apply.apply_reference([theta], s, c)),
            ("naive", naive),
            *(
                (("fused", lambda s=seeds, c=coeffs: zo_apply.apply_triton([theta], s, c)),)
                if args.device == "cuda"
                else ()
            ),
        ):
            seconds = timed(fn, args.device, args.repeats)
            row[f"{name}_gb_per_s"] = round(nbytes / seconds / 1e9, 3)
        row["reference_vs_naive"] = round(float(row["reference_gb_per_s"]) / float(row["naive_gb_per_s"]), 3)  # type: ignore[arg-type]
        if "fused_gb_per_s" in row and "copy_gb_per_s" in out:
            fused_traffic = 2 * float(row["fused_gb_per_s"])  # type: ignore[arg-type]
            row["fused_fraction_of_copy_bandwidth"] = round(fused_traffic / float(out["copy_gb_per_s"]), 3)  # type: ignore[arg-type]
        out["results"].append(row)  # type: ignore[attr-defined]
        print(json.dumps(row), flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
