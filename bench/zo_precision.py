"""ZO forwards in bf16: how far g moves from float32's, against the perturbation size ε.

SPSA's g = (L(θ + εz) − L(θ − εz)) / 2ε is a difference of two nearly equal losses, so
the forwards' rounding error is divided by 2ε: bf16 forwards (5× float32's speed on an
H100 for gpt-125m) are only usable where that error stays below what the one-byte g
already loses (training/zo.py: a relative rounding error of at most 2^(1/24) − 1 ≈ 2.9%).

For each ε of ``--eps`` and ``--seeds`` perturbations (each on its own batch of the
embedded corpus), at the genesis weights of ``--model`` (or after ``--pretrain-steps``
AdamW steps: ZO fine-tunes from a briefly trained start), it computes g with float32
forwards and with bf16 autocast forwards, and prints JSON per ε:

- ``median_abs_g``: the float32 g's scale;
- ``relative_error``: median |g_bf16 − g_fp32| / median |g_fp32|;
- ``over_byte_rounding``: that over the byte's own worst rounding (≤ 1: bf16 costs less
  than the byte already does);
- ``same_sign``: the share of perturbations whose g has the same sign both ways;
- ``same_byte``: the share that encodes to the same byte;
- ``bf16_over_fp32_time``: an SPSA step's time with bf16 forwards over float32's.

    python bench/zo_precision.py [--model tiny] [--device cpu|cuda] [--eps 1e-3,1e-2,1e-1] [--seeds 32]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training import corpus, data, zo
from training.models import GPT, preset
from training.settings import ZoConfig

BYTE_ROUNDING = 2 ** (1 / (2 * zo.STEPS_PER_OCTAVE)) - 1
"""The one-byte g's worst relative rounding (half a level: 2^(1/24) − 1)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eps", default="1e-3,1e-2,1e-1")
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=0)
    args = parser.parse_args()
    config = preset(args.model)
    tokens = data.encode(corpus.read_corpus(None))
    shard = data.make_shard(tokens, context_len=config.context_len, node_index=0, num_nodes=1)
    torch.manual_seed(0)
    model = GPT(config).to(args.device)
    if args.pretrain_steps:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(args.pretrain_steps):
            x, y = shard.batch(batch_size=args.batch_size, seed=1, step=step)
            optimizer.zero_grad()
            model.loss(x.to(args.device), y.to(args.device)).backward()
            optimizer.step()
    model.eval()
    params = list(model.parameters())
    g_max = ZoConfig().g_max
    out: dict[str, object] = {"bench": "zo_precision", **vars(args), "params": model.num_params(), "results": []}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    rows = []
    for eps in [float(v) for v in args.eps.split(",")]:
        gs: dict[str, list[float]] = {"fp32": [], "bf16": []}
        seconds = {"fp32": 0.0, "bf16": 0.0}
        for k in range(args.seeds):
            x, y = shard.batch(batch_size=args.batch_size, seed=2, step=k)
            x, y = x.to(args.device), y.to(args.device)
            for name, low in (("fp32", False), ("bf16", True)):

                def loss(low: bool = low, x: torch.Tensor = x, y: torch.Tensor = y) -> float:
                    with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=low):
                        return float(model.loss(x, y).item())

                started = time.perf_counter()
                gs[name].append(zo.spsa(params, loss, zo.step_seed(5, 0, k), eps, signs=ZoConfig().signs))
                seconds[name] += time.perf_counter() - started
        fp32, bf16 = gs["fp32"], gs["bf16"]
        scale = statistics.median(abs(g) for g in fp32)
        error = statistics.median(abs(a - b) for a, b in zip(fp32, bf16, strict=True)) / scale
        rows.append(
            {
                "eps": eps,
                "median_abs_g": round(scale, 4),
                "relative_error": round(error, 4),
                "over_byte_rounding": round(error / BYTE_ROUNDING, 3),
                "same_sign": round(sum((a > 0) == (b > 0) for a, b in zip(fp32, bf16, strict=True)) / len(fp32), 3),
                "same_byte": round(
                    sum(zo.encode_g(a, g_max) == zo.encode_g(b, g_max) for a, b in zip(fp32, bf16, strict=True))
                    / len(fp32),
                    3,
                ),
                "bf16_over_fp32_time": round(seconds["bf16"] / seconds["fp32"], 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    out["results"] = rows
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
