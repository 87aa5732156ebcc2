"""Payload encodings against float32 on the same run: bytes, loss and time, as ratios in one run.

Runs ``swarmtrain simulate`` (real daemons and workers, loopback) once per variant and
seed, the same run settings each time, every node's uploads capped at ``--link-mbps`` (a
home link; 0: no cap). A variant is an encoding, overlapped rounds as the run settings'
default (``outer.overlap``), or an encoding with ``+barrier`` (``--set outer.overlap=0``:
the worker waits at every round's end). Printed: one JSON object with, per variant, the
mean over seeds of the nodes' mean final validation loss, payload bytes sent per node per
round, the wall time of training, the median utilization and the share of training time
the workers waited for syncs (``sync_wait_share``: sync_wait_s / train_wall_s, the mean
over nodes; issue 16: ≤ 0.05), and the shares of it in validation (``eval_share``) and in
outer steps (``outer_share``: a partner payload's decoding and check, the step, the
checkpoint's staging); and for each its ratios to ``none`` measured in this run:

    bytes_ratio    payload bytes sent per node per round / none's
    wire_bytes_ratio  every byte sent on TCP (protocol/net/traffic.py), per node per round,
                   / none's (issue 16: ≤ 0.03)
    loss_ratio     final loss / none's (≤ 1.02)
    wall_ratio     training wall time / none's

    python bench/bandwidth.py                           # tiny, 30 rounds, 100 Mbit/s
    python bench/bandwidth.py --quick                   # micro, 6 rounds: a CI-sized check
    python bench/bandwidth.py --encodings none,sparseloco --seeds 1,2,3 --link-mbps 0
    python bench/bandwidth.py --encodings none,none+barrier,sparseloco,sparseloco+barrier
    python bench/bandwidth.py --model gpt-125m --device cuda --rounds 4 --inner-steps 20 \
        --link-mbps 0 --encodings none,sparseloco   # on one GPU (scripts/gpu_checks "bandwidth")
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.simulation import simulate as run_simulate


def simulate(variant: str, seed: int, args: argparse.Namespace, report: Path) -> dict[str, Any]:
    encoding, _, mode = variant.partition("+")
    if mode not in ("", "barrier"):
        raise SystemExit(f"unknown variant {variant!r}: an encoding, or an encoding+barrier")
    flags = [
        *["--nodes", str(args.nodes), "--model", args.model, "--rounds", str(args.rounds)],
        *["--compression", encoding, "--set", f"seed={seed}", "--link-mbps", f"{args.link_mbps:g}"],
        *(["--set", "outer.overlap=0"] if mode == "barrier" else []),
        *(["--device", args.device] if args.device else []),
        *(["--inner-steps", str(args.inner_steps)] if args.inner_steps else []),
    ]
    data = run_simulate(flags, report, timeout_s=args.timeout_s)
    nodes = [n for n in data["nodes"] if n.get("full_val_loss") is not None]
    return {
        "final_loss": statistics.mean(n["full_val_loss"] for n in nodes),  # the whole validation split
        "bytes_per_round": statistics.mean(n["bytes_sent"] / max(1, n["rounds"]) for n in nodes),
        "wire_bytes_per_round": statistics.mean(n["wire_bytes_sent"] / max(1, n["rounds"]) for n in nodes),
        "train_wall_s": statistics.mean(n["train_wall_s"] for n in nodes),
        "utilization": statistics.median(n["utilization"] for n in nodes),
        "sync_wait_share": statistics.mean(n["sync_wait_s"] / n["train_wall_s"] for n in nodes),
        "eval_share": statistics.mean(n["eval_s"] / n["train_wall_s"] for n in nodes),
        "outer_share": statistics.mean(n["outer_s"] / n["train_wall_s"] for n in nodes),
        "rounds_with_partner": [n["rounds_with_partner"] for n in nodes],
        "payloads_refused": [n.get("payloads_refused") for n in nodes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encodings", default="none,int8,sparseloco")
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--link-mbps", type=float, default=100.0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--device", help="simulate's --device (default: its own, auto)")
    parser.add_argument("--inner-steps", type=int, help="simulate's --inner-steps (default: its own, 10)")
    parser.add_argument("--quick", action="store_true", help="micro model, 6 rounds (overrides --model, --rounds)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.rounds = "micro", 6
    encodings = args.encodings.split(",")
    if "none" not in encodings:
        encodings.insert(0, "none")  # every ratio is against it, measured in this run
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-bandwidth-") as tmp:
        for seed in seeds:
            for encoding in encodings:
                path = Path(tmp) / f"{encoding}-{seed}.json"
                runs.setdefault(encoding, []).append(simulate(encoding, seed, args, path))

    def mean(encoding: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs[encoding])

    out: dict[str, Any] = {"bench": "bandwidth", **vars(args), "runs": runs}
    for encoding in encodings:
        out[encoding] = {
            key: mean(encoding, key)
            for key in (
                *("final_loss", "bytes_per_round", "wire_bytes_per_round", "train_wall_s"),
                *("utilization", "sync_wait_share", "eval_share", "outer_share"),
            )
        }
        out[encoding].update(
            bytes_ratio=mean(encoding, "bytes_per_round") / mean("none", "bytes_per_round"),
            wire_bytes_ratio=mean(encoding, "wire_bytes_per_round") / mean("none", "wire_bytes_per_round"),
            loss_ratio=mean(encoding, "final_loss") / mean("none", "final_loss"),
            wall_ratio=mean(encoding, "train_wall_s") / mean("none", "train_wall_s"),
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
