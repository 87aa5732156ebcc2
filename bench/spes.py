"""SPES against its baselines on the same data, steps and seeds: one JSON object of ratios.

Runs ``swarmtrain simulate`` (real daemons and workers, loopback) for each variant and seed:

    spes          sparse expert sync on tiny-moe: each node trains only its leased experts
    spes_nomerge  the same with expert merging off (spes.merge_alpha = 0)
    spes_noprefer the same without the routing preference for owned experts (spes.prefer_owned = 0)
    spes_kill     the same, the last node SIGKILLed --kill-after-s into training
    spes_int8     the same with --compression int8 (shared weights' payloads and expert
                  versions in int8: training/encodings/experts.py)
    spes_sparse   the same with --compression sparseloco (shared weights' payloads in
                  sparseloco; expert versions as int8 keyframes and sparse deltas)
    moe_noloco    the same MoE fully synced: every node trains every expert (NoLoCo)
    dense_noloco  the dense tiny model (same active parameters per token), NoLoCo

and with ``--nodes-wide`` (default 8) one seed of spes and moe_noloco, for bytes at more nodes.
Printed: per variant the mean over seeds of each node's final validation loss, gradient and
optimizer-state bytes, bytes sent per round, tokens/s of compute, expert balance; and the
issue's ratios (each a ratio of two variants measured in this run):

    memory_ratio            (grad + optimizer state) spes / moe_noloco, before any kill (≤ 0.35)
    memory_ratio_after_kill the same for the survivors of spes_kill at its end
    loss_vs_moe, loss_vs_dense   final loss spes / moe_noloco (≤ 1.05), / dense_noloco (≤ 1.02)
    merge_on_vs_off         final loss spes / spes_nomerge (≤ 1: merging no worse)
    prefer_on_vs_off        final loss spes / spes_noprefer (the owned experts' routing preference)
    bytes_ratio             bytes sent per node per round spes / moe_noloco at --nodes (≤ 0.5),
                            and at --nodes-wide
    kill_loss_ratio         final loss spes_kill survivors / spes (within 2%)
    relet_rounds            per kill: the rounds between the killed node's last round and the
                            claim that gave each of its experts a live owner again (≤ 3)
    min_expert_load         the least-loaded expert's share of the mean load at the end (≥ 0.25)
    tokens_per_s_ratio      spes / dense_noloco compute throughput (≥ 0.8)
    int8_bytes_ratio, int8_loss_ratio   spes_int8 / spes: bytes sent per node per round, final loss
    sparse_vs_int8_bytes, sparse_vs_int8_expert_bytes, sparse_vs_int8_loss   spes_sparse /
                            spes_int8: bytes per node per round (all; expert versions only), final loss

    python bench/spes.py [--nodes 4] [--seeds 1,2,3] [--rounds 10] [--inner-steps 10]
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

VARIANTS: dict[str, list[str]] = {
    "spes": ["--algorithm", "spes", "--model", "tiny-moe"],
    "spes_nomerge": ["--algorithm", "spes", "--model", "tiny-moe", "--set", "spes.merge_alpha=0"],
    "spes_noprefer": ["--algorithm", "spes", "--model", "tiny-moe", "--set", "spes.prefer_owned=0"],
    "spes_kill": ["--algorithm", "spes", "--model", "tiny-moe"],
    "spes_int8": ["--algorithm", "spes", "--model", "tiny-moe", "--compression", "int8"],
    "spes_sparse": ["--algorithm", "spes", "--model", "tiny-moe", "--compression", "sparseloco"],
    "moe_noloco": ["--algorithm", "noloco", "--model", "tiny-moe"],
    "dense_noloco": ["--algorithm", "noloco", "--model", "tiny"],
}


def simulate(flags: list[str], report_path: Path, args: argparse.Namespace, *, nodes: int, seed: int) -> dict[str, Any]:
    return run_simulate(
        [
            *["--nodes", str(nodes), *flags],
            *["--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps), "--set", f"seed={seed}"],
        ],
        report_path,
        timeout_s=args.timeout_s,
    )


def _memory(node: dict[str, Any]) -> int:
    memory = node.get("memory") or {}
    return int(memory.get("grad_bytes", 0)) + int(memory.get("optimizer_state_bytes", 0))


def _memory_before_kill(node: dict[str, Any]) -> int:
    """Gradient + optimizer bytes at the first round (the leases are even then)."""
    curve = node.get("memory_curve") or []
    return int(curve[0][2] + curve[0][3]) if curve else _memory(node)


def summarize(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    nodes = [n for n in report["nodes"] if not n.get("killed")]
    tokens_per_round = args.inner_steps * 8 * 128  # batch_size 8, context 128 (tiny presets)
    loads = [n["expert_load"] for n in nodes if n.get("expert_load")]
    out: dict[str, Any] = {
        "final_loss": statistics.mean(n["full_val_loss"] for n in nodes),  # the whole validation split
        "memory_bytes": statistics.mean(_memory_before_kill(n) for n in nodes),
        "memory_bytes_end": statistics.mean(_memory(n) for n in nodes),
        "bytes_per_round": statistics.mean(
            n["bytes_sent"] / max(1, n["rounds"] - (n.get("start_round") or 0)) for n in nodes
        ),
        "expert_bytes_per_round": statistics.mean(
            (n.get("expert_bytes_sent") or 0) / max(1, n["rounds"] - (n.get("start_round") or 0)) for n in nodes
        ),
        "versions_refused": sum(n.get("expert_versions_refused") or 0 for n in nodes),
        "tokens_per_s": statistics.mean(
            tokens_per_round * n["rounds"] / n["compute_s"] for n in nodes if n["compute_s"]
        ),
        "wall_s": report["wall_s"],
    }
    if loads:
        mean_load = [statistics.mean(column) for column in zip(*loads, strict=True)]
        out["min_expert_load"] = min(mean_load) / statistics.mean(mean_load)
    killed = [n for n in report["nodes"] if n.get("killed")]
    if killed:
        victim = killed[0]
        last = victim.get("rounds") or 0
        relets = [r for r in report.get("releases", []) if r["from"] == victim["peer_id"] and r["round"] >= last]
        out["relet_rounds"] = [r["round"] - last for r in relets]
        out["victim_experts"] = victim.get("owned_experts")
        out["experts_relet"] = sorted({r["expert"] for r in relets})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--nodes-wide", type=int, default=8, help="0: skip the wider run")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--kill-after-s", type=float, default=40.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-spes-") as tmp:
        for seed in seeds:
            for variant in variants:
                flags = list(VARIANTS[variant])
                if variant == "spes_kill":
                    flags += ["--kill-after-s", str(args.kill_after_s)]
                path = Path(tmp) / f"{variant}-{seed}.json"
                runs.setdefault(variant, []).append(
                    summarize(simulate(flags, path, args, nodes=args.nodes, seed=seed), args)
                )
        wide: dict[str, dict[str, Any]] = {}
        if args.nodes_wide:
            for variant in ("spes", "moe_noloco"):
                path = Path(tmp) / f"{variant}-wide.json"
                report = simulate(VARIANTS[variant], path, args, nodes=args.nodes_wide, seed=seeds[0])
                wide[variant] = summarize(report, args)

    def mean(variant: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs[variant])

    out: dict[str, Any] = {"bench": "spes", **vars(args), "runs": runs, "wide": wide}
    if {"spes", "moe_noloco"} <= runs.keys():
        out["memory_ratio"] = mean("spes", "memory_bytes") / mean("moe_noloco", "memory_bytes")
        out["loss_vs_moe"] = mean("spes", "final_loss") / mean("moe_noloco", "final_loss")
        out["bytes_ratio"] = mean("spes", "bytes_per_round") / mean("moe_noloco", "bytes_per_round")
    if {"spes", "dense_noloco"} <= runs.keys():
        out["loss_vs_dense"] = mean("spes", "final_loss") / mean("dense_noloco", "final_loss")
        out["tokens_per_s_ratio"] = mean("spes", "tokens_per_s") / mean("dense_noloco", "tokens_per_s")
    if {"spes", "spes_nomerge"} <= runs.keys():
        out["merge_on_vs_off"] = mean("spes", "final_loss") / mean("spes_nomerge", "final_loss")
    if {"spes", "spes_noprefer"} <= runs.keys():
        out["prefer_on_vs_off"] = mean("spes", "final_loss") / mean("spes_noprefer", "final_loss")
    if {"spes", "spes_kill"} <= runs.keys():
        out["kill_loss_ratio"] = mean("spes_kill", "final_loss") / mean("spes", "final_loss")
        out["memory_ratio_after_kill"] = (
            mean("spes_kill", "memory_bytes_end") / mean("moe_noloco", "memory_bytes") if "moe_noloco" in runs else None
        )
        out["relet_rounds"] = [r.get("relet_rounds") for r in runs["spes_kill"]]
    if {"spes", "spes_int8"} <= runs.keys():
        out["int8_bytes_ratio"] = mean("spes_int8", "bytes_per_round") / mean("spes", "bytes_per_round")
        out["int8_loss_ratio"] = mean("spes_int8", "final_loss") / mean("spes", "final_loss")
    if {"spes_int8", "spes_sparse"} <= runs.keys():
        for key, name in (
            ("bytes_per_round", "bytes"),
            ("expert_bytes_per_round", "expert_bytes"),
            ("final_loss", "loss"),
        ):
            out[f"sparse_vs_int8_{name}"] = mean("spes_sparse", key) / mean("spes_int8", key)
    if "spes" in runs:
        out["min_expert_load"] = min(r.get("min_expert_load", 0.0) for r in runs["spes"])
    if len(wide) == 2:
        out["bytes_ratio_wide"] = wide["spes"]["bytes_per_round"] / wide["moe_noloco"]["bytes_per_round"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
