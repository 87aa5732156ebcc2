"""SPES, worker side: NoLoCo's round on the shared weights, owned experts out, peers' versions in.

Before the first round the worker creates a shared block of ``num_experts`` slots of
``expert_nbytes`` each (float32, training/spes.py's flat layout) and names it in
``ready``; the daemon (node/algorithms/spes/) answers ``setup`` with the experts to train.
Each round, on top of the φ/Δ round loop (training/algorithms/rounds.py):
- with the payload, the owned experts go to their slots (``SpesTrainer.outer_payload``);
  the daemon publishes them as this round's versions once it has ``round_done``;
- ``outer_go`` carries ``owned`` (the leases from now on) and ``swap`` ([expert, round]
  pairs: slots the daemon filled with a peer's newer version). The worker takes each
  swapped version that passes ``check_version`` (before the shared step: the bound is
  measured against this round's own update), does NoLoCo's outer step on the shared
  weights, switches to the new owned set, and merges owned experts early in the run.
  Versions refused go back in ``outer_done`` (``rejected_experts``) so the daemon can
  penalize their owner.
Versions are not taken at ``setup``: there is no update of our own yet to bound them by;
the first outer step takes them (the bound grows with the rounds between two versions).
"""

from functools import partial
from multiprocessing import shared_memory
from typing import Any, BinaryIO

import torch

from training import ipc
from training.algorithms.rounds import Opening, Outer, run_rounds
from training.data import Shard
from training.models import GPT
from training.settings import RunSettings
from training.spes import SpesTrainer
from training.trainer import Trainer
from training.worker_config import WorkerConfig


def make_trainer(model: GPT, shard: Shard, run: RunSettings, **common: Any) -> Trainer:
    return SpesTrainer(model, shard, spes=run.spes, rounds=run.rounds, **common)


def _owned(command: dict[str, Any], num_experts: int) -> frozenset[int]:
    raw = command.get("owned")
    if not (isinstance(raw, list) and all(type(e) is int and 0 <= e < num_experts for e in raw)):
        raise ipc.IpcError(f"owned must list experts in [0, {num_experts}), got {str(raw)[:80]}")
    return frozenset(raw)


def _swaps(command: dict[str, Any], num_experts: int) -> list[tuple[int, int]]:
    raw = command.get("swap", [])
    if not isinstance(raw, list) or len(raw) > num_experts:
        raise ipc.IpcError("swap must be a list of at most one [expert, round] per expert")
    swaps = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)):
            raise ipc.IpcError("a swap is [expert, round]")
        if not (0 <= item[0] < num_experts and item[1] >= 0):
            raise ipc.IpcError(f"swap {item} out of range")
        swaps.append((item[0], item[1]))
    return swaps


def outer(
    trainer: Trainer,
    command: dict[str, Any],
    inbox: torch.Tensor,
    collected: dict[str, list[torch.Tensor]],
    *,
    slots: torch.Tensor,
) -> Outer:
    assert isinstance(trainer, SpesTrainer)
    num_experts = trainer.table.num_experts
    round_index = trainer.round
    rejected = []
    for expert, version_round in _swaps(command, num_experts):
        refusal = trainer.swap_in(expert, slots[expert].clone(), version_round)
        if refusal is not None:
            rejected.append([expert, version_round, refusal[:200]])
    used = trainer.apply_noloco(inbox if command.get("peer") is True else None)  # as NoLoCo's: no clone
    trainer.set_owned(_owned(command, num_experts))
    trainer.merge_owned(round_index)
    return Outer(
        used_peer=used,
        rejected=trainer.last_rejection,
        drifted=trainer.last_rejection_drifted,
        extra={"rejected_experts": rejected},
    )


def run(config: WorkerConfig, trainer: Trainer, commands: BinaryIO, replies: BinaryIO) -> None:
    assert isinstance(trainer, SpesTrainer)
    table = trainer.table
    block = shared_memory.SharedMemory(create=True, size=table.num_experts * table.nbytes)
    slots = torch.frombuffer(block.buf, dtype=torch.float32, count=table.num_experts * table.numel)
    trainer.slots = slots.view(table.num_experts, table.numel)

    def opening() -> Opening:
        fields = {
            "experts": block.name,
            "num_experts": table.num_experts,
            "expert_nbytes": table.nbytes,
            "held_rounds": list(trainer.held_rounds),
        }
        return Opening(fields, lambda command: trainer.set_owned(_owned(command, table.num_experts)))

    try:
        run_rounds(config, trainer, commands, replies, partial(outer, slots=trainer.slots), opening)
    finally:
        # No view of the block may outlive it (close() fails while one is exported).
        trainer.slots = None
        del slots
        block.close()
        block.unlink()
