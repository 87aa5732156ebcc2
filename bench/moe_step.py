"""Inner-step time of a SPES worker's model against its baselines, one process, same run.

A training step (forward, backward, AdamW on the trainable parameters) on random tokens,
for:
- ``dense``: the dense ``tiny`` model (the same active parameters per token as tiny-moe);
- ``spes``: ``tiny-moe`` owning ``--owned`` of its 8 experts per block (the others
  frozen), on the grouped path that computes weight gradients for the owned experts only
  (training/moe.py ``_OwnedFirst``);
- ``spes_autograd``: the same on autograd's grouped matmul, which computes every expert's
  weight gradient and drops the frozen ones' (what ran before);
- ``moe_all``: tiny-moe training every expert (the fully synced MoE).

Variants run interleaved, ``--rounds`` times ``--steps`` steps each, and the median
step of each is reported, with each variant's resident-set growth over its steps
(glibc's heap: allocations of varying size fragmented it before, docs/training.md).
Printed: one JSON object with ms per step and the ratios ``dense_over_spes`` (the issue's
tokens/s ratio spes/dense at equal tokens) and ``spes_over_autograd`` (< 1: faster).

    python bench/moe_step.py [--threads 1] [--steps 20] [--rounds 5] [--owned 2] [--batch 8]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.models import GPT, preset
from training.moe import MoE


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Variant:
    def __init__(self, name: str, model: str, owned: int | None, *, autograd: bool = False) -> None:
        torch.manual_seed(0)
        self.name = name
        self.model = GPT(preset(model))
        self.autograd = autograd
        if owned is not None:
            for module in self.model.modules():
                if isinstance(module, MoE):
                    for e, expert in enumerate(module.experts):
                        expert.requires_grad_(e < owned)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        self.times: list[float] = []
        self.rss_growth_mb = 0.0

    def run(self, steps: int, tokens: torch.Tensor) -> None:
        moes = [m for m in self.model.modules() if isinstance(m, MoE)]
        saved = [m._owned_first for m in moes]
        if self.autograd:
            for m in moes:
                m._owned_first = lambda _tokens: None  # type: ignore[method-assign]
        try:
            before = _rss_mb()
            for _ in range(steps):
                started = time.perf_counter()
                loss = self.model.loss(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.times.append(time.perf_counter() - started)
            self.rss_growth_mb += _rss_mb() - before
        finally:
            for m, method in zip(moes, saved, strict=True):
                m._owned_first = method  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--owned", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = preset("tiny")
    tokens = torch.randint(
        0, config.vocab_size, (args.batch, config.context_len + 1), generator=torch.Generator().manual_seed(1)
    )
    variants = [
        Variant("dense", "tiny", None),
        Variant("spes", "tiny-moe", args.owned),
        Variant("spes_autograd", "tiny-moe", args.owned, autograd=True),
        Variant("moe_all", "tiny-moe", None),
    ]
    for variant in variants:  # warm-up (first allocations, thread pools)
        variant.run(2, tokens)
        variant.times.clear()
        variant.rss_growth_mb = 0.0
    for _ in range(args.rounds):
        for variant in variants:
            variant.run(args.steps, tokens)
    ms = {v.name: statistics.median(v.times) * 1000 for v in variants}
    result: dict[str, Any] = {
        "threads": args.threads,
        "owned_experts": args.owned,
        "tokens_per_step": args.batch * config.context_len,
        "ms_per_step": {k: round(v, 2) for k, v in ms.items()},
        "rss_growth_mb": {v.name: round(v.rss_growth_mb, 1) for v in variants},
        "dense_over_spes": round(ms["dense"] / ms["spes"], 3),
        "dense_over_spes_autograd": round(ms["dense"] / ms["spes_autograd"], 3),
        "spes_over_autograd": round(ms["spes"] / ms["spes_autograd"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
