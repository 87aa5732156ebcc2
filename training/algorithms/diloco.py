"""DiLoCo, worker side: the outer step averages every live node's Δ (ours included).

The daemon (node/algorithms/diloco.py) sends ``accumulate`` once per peer payload it put
in the inbox (the shared round loop checks and keeps each Δ), then ``outer_go`` with our
own key; the Δs are summed in key (peer id) order, so every node sums the same way.
"""

from typing import Any, BinaryIO

import torch

from training.algorithms.rounds import Outer, run_rounds
from training.trainer import Trainer
from training.worker_config import WorkerConfig


def outer(
    trainer: Trainer, command: dict[str, Any], inbox: torch.Tensor, collected: dict[str, list[torch.Tensor]]
) -> Outer:
    deltas = {**collected, str(command.get("key")): trainer.own_delta()}
    trainer.apply_diloco([deltas[key] for key in sorted(deltas)])
    return Outer(used_peer=len(deltas) > 1)


def run(config: WorkerConfig, trainer: Trainer, commands: BinaryIO, replies: BinaryIO) -> None:
    run_rounds(config, trainer, commands, replies, outer, overlapped=True)
