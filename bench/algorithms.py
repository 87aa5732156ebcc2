"""NoLoCo against its baselines (DiLoCo, local-only) at the same steps, on this machine.

Runs ``swarmtrain simulate`` once per variant with the same nodes, model, rounds and H,
and prints one JSON object: each variant's mean final validation loss over the nodes,
its bytes sent per node, time waiting for peers, and NoLoCo's loss as a ratio of DiLoCo's
(the issue's target: within 3%, i.e. ratio ≤ 1.03). Variants: noloco, diloco, local, and
noloco_int8 (NoLoCo with blockwise int8 payloads, compared with float32 NoLoCo).

    python bench/algorithms.py [--nodes 4] [--rounds 20] [--inner-steps 20] [--model micro]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("noloco", "diloco", "local", "noloco_int8")


def run(variant: str, args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    report_path = workdir / f"{variant}.json"
    algorithm, _, compression = variant.partition("_")
    command = [
        *[sys.executable, "-m", "node", "simulate", "--nodes", str(args.nodes), "--algorithm", algorithm],
        *["--compression", compression or "none"],
        *["--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps), "--model", args.model],
        *["--timeout-s", str(args.timeout_s), "--report", str(report_path)],
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s + 120, check=False)
    if result.returncode != 0:
        return {"ok": False, "exit_code": result.returncode, "tail": result.stdout[-1500:]}
    report = json.loads(report_path.read_text())
    nodes = report["nodes"]
    finals = [n["full_val_loss"] for n in nodes]  # the final models on the whole validation split
    return {
        "ok": True,
        "final_loss_mean": round(statistics.mean(finals), 4),
        "final_loss_range": [round(min(finals), 4), round(max(finals), 4)],
        "first_loss_mean": round(statistics.mean(n["loss_curve"][0][1] for n in nodes), 4),
        "bytes_sent_per_node": round(statistics.mean(n["bytes_sent"] for n in nodes)),
        "sync_wait_s_mean": round(statistics.mean(n["sync_wait_s"] for n in nodes), 3),
        "compute_s_mean": round(statistics.mean(n["compute_s"] for n in nodes), 3),
        "train_wall_s_mean": round(statistics.mean(n["train_wall_s"] for n in nodes), 3),
        "utilization": [n["utilization"] for n in nodes],
        "rounds_with_partner": [n["rounds_with_partner"] for n in nodes],
        "wall_s": report["wall_s"],
    }


def simulation_parser(doc: str | None, *, rounds: int, inner_steps: int, model: str) -> argparse.ArgumentParser:
    """The flags ``run`` reads (bench/utilization.py uses it too, with its own defaults)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--inner-steps", type=int, default=inner_steps)
    parser.add_argument("--model", default=model)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    return parser


def main() -> None:
    parser = simulation_parser(__doc__, rounds=20, inner_steps=20, model="micro")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="bench-alg-") as tmp:
        results = {variant: run(variant, args, Path(tmp)) for variant in variants}
    out: dict[str, object] = {"bench": "algorithms", **vars(args), "results": results}
    ok = {name: float(r["final_loss_mean"]) for name, r in results.items() if r.get("ok")}  # type: ignore[arg-type]
    if "noloco" in ok and "diloco" in ok:
        ratio = ok["noloco"] / ok["diloco"]
        out.update(noloco_vs_diloco_loss_ratio=round(ratio, 4), within_3_percent=ratio <= 1.03)
    if "noloco" in ok and "noloco_int8" in ok:
        out.update(int8_vs_float32_loss_ratio=round(ok["noloco_int8"] / ok["noloco"], 4))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
