"""Replaying a ZO log: updates applied per second to a model's weights, two ways, same bits.

A log of ``--rounds`` rounds of ``--per-round`` updates (a round is one summed group:
training/zo.py), applied to the weights of ``--model`` (its real parameter list: many
tensors, as the worker holds them) on ``--device``, through ``zo.apply_updates`` as the
worker calls it:

- ``per_round``: one call per round (the worker until 2026-11-27: each round applied as it
  came, one pass over the weights a round);
- ``grouped``: whole rounds batched up to ``REPLAY_BATCH_UPDATES`` updates a call (the
  worker now: training/algorithms/zo.py ``Pending``; one pass over the weights for all of
  them, kernels/zo_apply.py's groups).

Both end with the same bits (checked: the weights' SHA-256 must match, else it exits 1).
Prints JSON: updates/s of each, and ``grouped_over_per_round``. Each way first runs once
on another log of the same size (Triton's compile is not timed).
Issue 14's target: a replay of ≥ 20k updates/s on gpt-125m (on the H100).

    python bench/zo_replay.py [--model micro] [--device cpu|cuda] [--rounds 64] [--per-round 4] [--signs 1]
"""

import argparse
import json
import sys
import time

import torch

from training import zo
from training.algorithms.zo import REPLAY_BATCH_UPDATES
from training.models import GPT, preset
from training.settings import ZoConfig


def log(rounds: int, per_round: int, first_seed: int) -> list[list[tuple[int, int]]]:
    """Rounds of (seed, g code): seeds as peers derive them, codes spread over the byte."""
    return [
        [(zo.step_seed(7, peer, first_seed + r), (37 * (r * per_round + peer)) % 256) for peer in range(per_round)]
        for r in range(rounds)
    ]


def batches(groups: list[list[tuple[int, int]]]) -> list[list[list[tuple[int, int]]]]:
    """Whole rounds, up to REPLAY_BATCH_UPDATES updates a batch (as the worker's Pending)."""
    out: list[list[list[tuple[int, int]]]] = [[]]
    count = 0
    for group in groups:
        out[-1].append(group)
        count += len(group)
        if count >= REPLAY_BATCH_UPDATES:
            out.append([])
            count = 0
    return [batch for batch in out if batch]


def timed(fn: object, device: str) -> float:
    assert callable(fn)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="micro")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=64)
    parser.add_argument("--per-round", type=int, default=4, help="updates a round (the run's members × steps)")
    parser.add_argument("--signs", type=int, default=1, help="the generator version (zo.signs)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(preset(args.model)).to(args.device)
    params = [p.detach() for p in model.parameters()]
    config = ZoConfig(lr=zo.step_size(ZoConfig(), sum(p.numel() for p in params)), signs=args.signs)
    genesis = [p.clone() for p in params]
    warm = log(args.rounds, args.per_round, 10**6)
    groups = log(args.rounds, args.per_round, 0)
    out: dict[str, object] = {"bench": "zo_replay", **vars(args), "params": sum(p.numel() for p in params)}
    out["tensors"], out["batch_updates"] = len(params), REPLAY_BATCH_UPDATES
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    else:
        out["threads"] = torch.get_num_threads()

    def per_round(rounds: list[list[tuple[int, int]]]) -> None:
        for group in rounds:
            zo.apply_updates(params, [group], config)

    def grouped(rounds: list[list[tuple[int, int]]]) -> None:
        for batch in batches(rounds):
            zo.apply_updates(params, batch, config)

    hashes = {}
    for name, way in (("per_round", per_round), ("grouped", grouped)):
        zo.copy_into(params, genesis)
        way(warm)
        zo.copy_into(params, genesis)
        seconds = timed(lambda way=way: way(groups), args.device)
        out[f"{name}_s"] = round(seconds, 4)
        out[f"{name}_updates_per_s"] = round(args.rounds * args.per_round / seconds, 1)
        hashes[name] = zo.param_hash(params)
    out["grouped_over_per_round"] = round(out["per_round_s"] / out["grouped_s"], 3)  # type: ignore[operator]
    out["same_bits"] = hashes["per_round"] == hashes["grouped"]
    print(json.dumps(out, indent=2))
    if not out["same_bits"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
