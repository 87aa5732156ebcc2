"""The "local" baseline, worker side: H inner steps a round and no outer step (φ follows θ).

Every node trains alone; it is what NoLoCo's partner averaging is measured against.
"""

from typing import Any, BinaryIO

import torch

from training.algorithms.rounds import Outer, run_rounds
from training.trainer import Trainer
from training.worker_config import WorkerConfig


def outer(
    trainer: Trainer, command: dict[str, Any], inbox: torch.Tensor, collected: dict[str, list[torch.Tensor]]
) -> Outer:
    trainer.apply_local()
    return Outer(used_peer=False)


def run(config: WorkerConfig, trainer: Trainer, commands: BinaryIO, replies: BinaryIO) -> None:
    # φ' is θ as the round ended: the overlapped steps start there (not eager).
    run_rounds(config, trainer, commands, replies, outer, overlapped=True, eager=False)
