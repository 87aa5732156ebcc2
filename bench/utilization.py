"""Compute utilization of the workers, ``compute_s / train_wall_s``, at H = 50 (NoLoCo).

``compute_s`` is the time a worker spent in inner steps (and exporting its payload);
``train_wall_s`` runs from its start-up ("ready") to its last outer step, so the rest is
waiting for a partner, evaluation, outer steps and messages. Runs ``swarmtrain simulate``
once (bench/algorithms.py's runner) and prints one JSON object; the issue's target is
≥ 0.90 on every node.

    python bench/utilization.py [--nodes 4] [--rounds 4] [--inner-steps 50] [--model tiny]
"""

import json
import tempfile
from pathlib import Path

from algorithms import run, simulation_parser


def main() -> None:
    args = simulation_parser(__doc__, rounds=4, inner_steps=50, model="tiny").parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-util-") as tmp:
        result = run("noloco", args, Path(tmp))
    out = {"bench": "utilization", **vars(args), **result}
    if result.get("ok"):
        utilization = [float(u) for u in result["utilization"]]  # type: ignore[attr-defined]
        out.update(utilization_min=min(utilization), target=0.9, target_met=min(utilization) >= 0.9)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
