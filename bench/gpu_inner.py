"""Inner-step speed: our worker's Trainer against a nanoGPT-style loop, same model, same run.

Both train the same model on the same batches: ``ours`` is training/trainer.py as the worker
builds it (torch.compile on CUDA, bf16 autocast, fused AdamW, pinned batches copied without
waiting, the loss read once per round); ``nanogpt`` is the recipe of nanoGPT's train.py
written out by hand (the same four things, and nothing else between steps). They run
interleaved, ``--rounds`` rounds of ``--steps`` steps each after a warm-up (compilation),
each round timed from a synchronized start to a synchronized end; the median round gives
tokens/s, and MFU = 6·N + 12·L·D·T flops per token (nanoGPT's estimate) over
``--peak-tflops`` (bf16 dense: 989 for an H100 SXM; none on a CPU).

Printed: one JSON object; ``ours_over_nanogpt`` is the issue's figure (≥ 1.0 wanted).

    python bench/gpu_inner.py                       # gpt-125m on cuda, micro on a CPU
    python bench/gpu_inner.py --device cuda --model gpt-125m --batch 16 --steps 20 --rounds 5
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training import corpus, data
from training.models import GPT, GPTConfig, preset
from training.settings import InnerConfig, OuterConfig
from training.trainer import Trainer

H100_BF16_DENSE_TFLOPS = 989.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NanoGPTLoop:
    """nanoGPT's train.py inner loop, by hand: compiled model, fused AdamW, bf16 autocast,
    pinned batches sent ahead without waiting, the loss read once per round."""

    def __init__(self, model: GPT, shard: data.Shard, inner: InnerConfig, device: torch.device) -> None:
        self.model = model.to(device)
        self.device = device
        self.shard = shard
        self.inner = inner
        cuda = device.type == "cuda"
        self.loss = torch.compile(self.model.loss) if cuda else self.model.loss
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=inner.lr, weight_decay=inner.weight_decay, fused=True if cuda else None
        )
        self.step = 0

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.shard.batch(batch_size=self.inner.batch_size, seed=0, step=self.step)
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def inner_steps(self) -> float:
        self.model.train()
        total = torch.zeros((), device=self.device)
        x, y = self._batch()
        for _ in range(self.inner.steps_per_round):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                loss = self.loss(x, y)
            self.step += 1
            x, y = self._batch()  # the next batch's copy overlaps this step's backward
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            total += loss.detach()
        return float(total.item()) / self.inner.steps_per_round


def add_setup_args(parser: argparse.ArgumentParser, *, steps: int, rounds: int) -> None:
    """The flags both GPU benches take (bench/gpu_outer.py too)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", help="preset (default gpt-125m on cuda, micro on a CPU)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=steps, help="H, inner steps per timed round")
    parser.add_argument("--rounds", type=int, default=rounds)


@dataclass(frozen=True, slots=True)
class Setup:
    device: torch.device
    name: str
    config: GPTConfig
    shard: data.Shard
    inner: InnerConfig

    def worker_trainer(self) -> Trainer:
        """A Trainer as the worker builds it (compiled on CUDA), from seed 0."""
        torch.manual_seed(0)
        return Trainer(
            GPT(self.config),
            self.shard,
            inner=self.inner,
            outer=OuterConfig(),
            seed=0,
            device=str(self.device),
            compile_model=self.device.type == "cuda",
        )


def setup(args: argparse.Namespace) -> Setup:
    device = torch.device(args.device)
    name = args.model or ("gpt-125m" if device.type == "cuda" else "micro")
    config = preset(name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokens = data.encode(corpus.embedded_corpus())
    shard = data.make_shard(tokens, context_len=config.context_len, node_index=0, num_nodes=1)
    return Setup(device, name, config, shard, InnerConfig(steps_per_round=args.steps, batch_size=args.batch, lr=3e-4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_args(parser, steps=20, rounds=5)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak (default: 989 on cuda)")
    args = parser.parse_args()
    bench = setup(args)
    device, name, config = bench.device, bench.name, bench.config
    peak = args.peak_tflops or (H100_BF16_DENSE_TFLOPS if device.type == "cuda" else None)
    ours = bench.worker_trainer()
    torch.manual_seed(0)
    reference = NanoGPTLoop(GPT(config), bench.shard, bench.inner, device)
    variants: dict[str, Any] = {"ours": ours, "nanogpt": reference}
    times: dict[str, list[float]] = {k: [] for k in variants}
    losses: dict[str, float] = {}
    for round_index in range(args.warmup_rounds + args.rounds):
        for key, variant in variants.items():
            sync(device)
            started = time.perf_counter()
            losses[key] = variant.inner_steps()
            sync(device)
            if round_index >= args.warmup_rounds:
                times[key].append(time.perf_counter() - started)
    num_params = sum(p.numel() for p in ours.model.parameters())
    flops_per_token = 6 * num_params + 12 * config.num_layers * config.embed_dim * config.context_len
    tokens_per_round = args.steps * args.batch * config.context_len
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": name,
        "params": num_params,
        "batch": args.batch,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
    }
    for key, measured in times.items():
        median = statistics.median(measured)
        tokens_per_s = tokens_per_round / median
        result[key] = {
            "round_s_median": round(median, 5),
            "round_s_all": [round(t, 5) for t in measured],
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu": None if peak is None else round(tokens_per_s * flops_per_token / (peak * 1e12), 4),
            "last_loss": round(losses[key], 4),
        }
    result["ours_over_nanogpt"] = round(result["ours"]["tokens_per_s"] / result["nanogpt"]["tokens_per_s"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
