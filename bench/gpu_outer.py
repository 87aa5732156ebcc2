"""The GPU side of a NoLoCo round, piece by piece, against a pinned copy and the inner steps.

One Trainer as the worker builds it (training/trainer.py), its outbox and inbox shared
memory page-locked as the worker's are (training/pinned.py). Each round, timed with the
training stream synchronized around each piece (only it: the checkpoint's copy out on a
stream of its own goes on under the next round's inner steps, as in the worker, and
slows them if it does):
- ``inner``: H inner steps (the round's work, ``--steps``, 50 as the issue's H);
- ``export``: φ and Δ into the outbox (``Trainer.export_into``, as the worker makes it);
- ``import``: a partner's payload (our own, as a stand-in) from the inbox, parsed and
  checked (``parse_payload``), timed alone: the outer step does it again, and the stall
  counts it once, there;
- ``outer``: the outer step on it, as the worker takes it (training/algorithms/noloco.py
  ``outer`` on the inbox: the parse included; until 2026-11-27 the worker cloned the inbox
  first, a copy this bench did not make);
- ``checkpoint``: what saving the state costs the training path: the copy into the
  background writer's buffers, or nothing in a round that finds the last write still going
  (training/saver.py skips those; ``checkpoints_written`` of the rounds were written): its
  mean over the rounds goes into the stall (a median would hide the written rounds' copy
  whenever most rounds skip);
  ``checkpoint_sync`` (once, at the end): the whole save (hash, atomic write) as it was on
  the training path before;
- ``pinned_copy``: the reference, the payload's bytes from the device into a pinned buffer
  (until 2026-11-27 from the host copy ``outer_payload`` had made: a host memcpy, not this).
``--profile FILE``: one more round's outer step (the worker's, parse included) under torch's profiler,
its busiest ops (device time on a GPU, else CPU time) written to FILE as a table.
Printed: one JSON object with the median of each piece over ``--rounds`` and the ratios
``export_over_pinned_copy``, ``checkpoint_over_sync`` and ``stall_fraction`` = (export +
outer + checkpoint's mean) / (inner + those): the share of a round the inner loop waits (≤ 0.05
wanted at H = 50). Until 2026-11-26 the stall counted ``import`` too, the parse twice.

    python bench/gpu_outer.py                 # gpt-125m on cuda, micro on a CPU
    python bench/gpu_outer.py --steps 50 --rounds 5 --checkpoint-dir /tmp
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from multiprocessing import shared_memory
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_inner import add_setup_args, setup
from training import checkpoint
from training.algorithms import noloco
from training.pinned import page_locked
from training.saver import BackgroundSaver
from training.trainer import Trainer


def timed(device: torch.device, work: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter() - started


def one_round(
    trainer: Trainer,
    out_view: torch.Tensor,
    in_view: torch.Tensor,
    pinned: torch.Tensor,
    saver: BackgroundSaver,
    device: torch.device,
    written: list[bool],
) -> dict[str, float]:
    took = {"inner": timed(device, trainer.inner_steps)}
    took["export"] = timed(device, lambda: trainer.export_into(out_view))  # as the worker does
    in_view.copy_(out_view)
    took["import"] = timed(device, lambda: trainer.parse_payload(in_view))
    # The reference before the checkpoint: its copy out (a stream of its own) would share the bus.
    flat = trainer._exact_flat().view(torch.uint8)  # the payload's bytes where they are made
    took["pinned_copy"] = timed(device, partial(pinned.copy_, flat, non_blocking=True))
    del flat  # the worker holds no such copy through its outer step and checkpoint
    took["outer"] = timed(device, lambda: noloco.outer(trainer, {"peer": True}, in_view, {}))
    state, meta = trainer.state()
    took["checkpoint"] = timed(device, lambda: written.append(saver.save(trainer.round, state, meta)))
    return took


def profile_outer(
    trainer: Trainer, out_view: torch.Tensor, in_view: torch.Tensor, device: torch.device, path: Path
) -> None:
    """One round's outer step (as the worker takes it) under torch's profiler: its busiest ops."""
    from torch.profiler import ProfilerActivity, profile

    trainer.inner_steps()
    trainer.export_into(out_view)
    in_view.copy_(out_view)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        noloco.outer(trainer, {"peer": True}, in_view, {})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30)
    path.write_text(table + "\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setup_args(parser, steps=50, rounds=3)
    parser.add_argument("--checkpoint-dir", type=Path, help="where the checkpoint goes (default: a temp dir)")
    parser.add_argument("--profile", type=Path, help="write a profile of one round's outer path here")
    args = parser.parse_args()
    bench = setup(args)
    device, name = bench.device, bench.name
    trainer = bench.worker_trainer()
    nbytes = trainer.payload_nbytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times: dict[str, list[float]] = {k: [] for k in ("inner", "export", "import", "outer", "checkpoint", "pinned_copy")}
    outbox = shared_memory.SharedMemory(create=True, size=nbytes)
    inbox = shared_memory.SharedMemory(create=True, size=nbytes)
    with tempfile.TemporaryDirectory() as scratch:
        path = (args.checkpoint_dir or Path(scratch)) / "gpu_outer.ckpt"
        try:
            with page_locked(outbox, device) as locked, page_locked(inbox, device):
                out_view = torch.frombuffer(outbox.buf, dtype=torch.uint8, count=nbytes)
                in_view = torch.frombuffer(inbox.buf, dtype=torch.uint8, count=nbytes)
                saver = BackgroundSaver(path, lambda _round, _error: None)
                written: list[bool] = []
                for round_index in range(args.rounds + 1):  # the first compiles: not counted
                    took = one_round(trainer, out_view, in_view, pinned, saver, device, written)
                    if round_index:
                        for key, value in took.items():
                            times[key].append(value)
                saver.close()
                if args.profile is not None:
                    profile_outer(trainer, out_view, in_view, device, args.profile)
                state, meta = trainer.state()
                checkpoint_sync = timed(device, lambda: checkpoint.save(path, state, meta))
                del out_view, in_view
        finally:
            for block in (outbox, inbox):
                block.close()
                block.unlink()
    medians = {key: statistics.median(values) for key, values in times.items()}
    checkpoint_mean = statistics.fmean(times["checkpoint"])
    stall = medians["export"] + medians["outer"] + checkpoint_mean
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "model": name,
                "params": sum(p.numel() for p in trainer.model.parameters()),
                "payload_bytes": nbytes,
                "page_locked": locked,
                "steps_per_round": args.steps,
                "rounds": args.rounds,
                **{f"{key}_s": round(value, 5) for key, value in medians.items()},
                "checkpoint_mean_s": round(checkpoint_mean, 5),
                "checkpoint_sync_s": round(checkpoint_sync, 5),
                "checkpoints_written": f"{sum(written[1:])} of {len(written) - 1}",
                "checkpoint_over_sync": round(checkpoint_mean / checkpoint_sync, 4),
                "export_over_pinned_copy": round(medians["export"] / medians["pinned_copy"], 3),
                "stall_fraction": round(stall / (medians["inner"] + stall), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
