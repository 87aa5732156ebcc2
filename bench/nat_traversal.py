"""How many node pairs end up direct behind NATs, and how soon (needs root: network namespaces).

Runs ``swarmtrain simulate --topology nat`` (node/simulate/netbed.py: a public bootstrap/relay node,
each daemon behind its own nftables NAT; endpoint-independent "cone" NATs unless
``--symmetric-nats``) and, as the baseline in the same run, ``--topology loopback`` with
the same number of nodes. Prints one JSON object:

- ``direct_pair_fraction``: daemon pairs with a direct (hole-punched) connection when the
  simulation stopped, over all daemon pairs. Target from the issue: >= 0.90 with cone NATs.
- ``first_direct_s``: per node, from its start to its first direct connection to a peer it
  had reached by relay (the min / median / max over nodes and runs).
- ``converged_s``: when every node held the same run state; ``ratio_vs_loopback`` divides
  the NAT time by the loopback time (these machines are noisy; compare ratios).

    python bench/nat_traversal.py [--nodes 8] [--repeats 3] [--symmetric-nats 0]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def simulate(topology: str, num_nodes: int, symmetric: int, workdir: Path, index: int) -> dict[str, Any]:
    report_path = workdir / f"{topology}-{index}.json"
    argv = [sys.executable, "-m", "node", "simulate", "--topology", topology, "--nodes", str(num_nodes)]
    argv += ["--algorithm", "none", "--report", str(report_path), "--timeout-s", "300"]
    if symmetric:
        argv += ["--symmetric-nats", str(symmetric)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    if not report_path.exists():  # a run that did not settle still reports; one without a report failed
        raise SystemExit(f"simulate --topology {topology} failed ({result.returncode}):\n{result.stdout[-3000:]}")
    report: dict[str, Any] = json.loads(report_path.read_text())
    report["exit_code"] = result.returncode
    return report


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--symmetric-nats", type=int, default=0)
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-nat-") as tmp:
        for i in range(args.repeats):
            nat = simulate("nat", args.nodes, args.symmetric_nats, Path(tmp), i)
            loopback = simulate("loopback", args.nodes, 0, Path(tmp), i)
            nat_converged = max(n["state_converged_s"] for n in nat["nodes"])
            loop_converged = max(n["state_converged_s"] for n in loopback["nodes"])
            runs.append(
                {
                    "direct_pair_fraction": nat["direct_pair_fraction"],
                    "pairs": nat["pairs"],
                    "first_direct_s": [n["first_direct_s"] for n in nat["nodes"] if n["first_direct_s"] is not None],
                    "converged_s": nat_converged,
                    "loopback_converged_s": loop_converged,
                    "wall_s": nat["wall_s"],
                    "stop_reason": nat["stop_reason"],
                }
            )
    fractions = [r["direct_pair_fraction"] for r in runs]
    firsts = [t for r in runs for t in r["first_direct_s"]]
    nat_s = statistics.median(r["converged_s"] for r in runs)
    loop_s = statistics.median(r["loopback_converged_s"] for r in runs)
    print(
        json.dumps(
            {
                "bench": "nat_traversal",
                "nodes": args.nodes,
                "symmetric_nats": args.symmetric_nats,
                "repeats": args.repeats,
                "direct_pair_fraction": {"per_run": fractions, "min": min(fractions)},
                "first_direct_s": spread(firsts),
                "converged_s": round(nat_s, 3),
                "loopback_converged_s": round(loop_s, 3),
                "ratio_vs_loopback": round(nat_s / loop_s, 3) if loop_s > 0 else None,
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
