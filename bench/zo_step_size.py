"""ZO step size against model size: the validation loss after the updates a small run makes.

One process plays a run of ``--nodes`` ZO authors for ``--rounds`` rounds of ``--steps``
updates each, exactly as the workers do (training/algorithms/zo.py: every author's g by
SPSA at the round's weights, one byte each, then the whole round applied as one group),
for each step size in ``--lrs``, from the same genesis weights and the same batches. It
prints one JSON object: per lr the validation loss after each round and ``ratio``, the
final validation loss over the genesis one (< 1: the loss fell).

    python bench/zo_step_size.py --model tiny --lrs 3e-3,3e-4,1e-4,3e-5

Why it exists (issue 13): ZO's step size 3e-3 was chosen on ``micro`` (0.12 M parameters);
on ``tiny`` (3.3 M) the same step diverged. An SPSA update moves every coordinate by
lr·|g|, and |g| grows with the square root of the parameter count.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training import corpus, data, zo
from training.models import GPT, preset
from training.settings import ZoConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lrs", default="3e-3,3e-4,1e-4,3e-5")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="updates per author per round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eps", type=float, default=ZoConfig().eps)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = preset(args.model)
    tokens = data.encode(corpus.read_corpus(None))
    shards = [
        data.make_shard(tokens, context_len=config.context_len, node_index=i, num_nodes=args.nodes)
        for i in range(args.nodes)
    ]
    torch.manual_seed(0)
    model = GPT(config).eval()
    params = list(model.parameters())
    genesis = [p.detach().clone() for p in params]

    @torch.no_grad()
    def val_loss() -> float:
        batches = shards[0].val_batches(batch_size=args.batch_size, num_rows=8 * args.batch_size)
        return sum(float(model.loss(x, y)) for x, y in batches) / len(batches)

    start = val_loss()
    out: dict[str, object] = {
        "model": args.model,
        "num_params": model.num_params(),
        "nodes": args.nodes,
        "rounds": args.rounds,
        "steps": args.steps,
        "genesis_val_loss": round(start, 4),
        "runs": [],
    }
    for lr in [float(v) for v in args.lrs.split(",")]:
        zo_config = ZoConfig(eps=args.eps, lr=lr)
        with torch.no_grad():
            for param, value in zip(params, genesis, strict=True):
                param.copy_(value)
        curve = []
        clipped = 0
        started = time.perf_counter()
        for round_index in range(args.rounds):
            updates = []
            for node, shard in enumerate(shards):
                for k in range(args.steps):
                    step = round_index * args.steps + k
                    x, y = shard.batch(batch_size=args.batch_size, seed=node, step=step)
                    seed = zo.step_seed(1, node, step)
                    g = zo.spsa(params, lambda x=x, y=y: float(model.loss(x, y)), seed, args.eps, signs=zo_config.signs)
                    code = zo.encode_g(g, zo_config.g_max) if g == g else 0
                    clipped += (code & 0x7F) == zo.LEVELS
                    updates.append((seed, code))
            zo.apply_updates(params, [updates], zo_config)
            loss = val_loss()
            curve.append(round(loss, 4) if loss == loss else None)
            if loss != loss or loss > 3 * start:
                break  # diverged: the rest would only cost time
        final = curve[-1]
        runs = out["runs"]
        assert isinstance(runs, list)
        runs.append(
            {
                "lr": lr,
                "lr_times_params": round(lr * model.num_params(), 1),
                "val_loss": curve,
                "ratio": None if final is None else round(final / start, 4),
                "saturated_g": clipped,
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
