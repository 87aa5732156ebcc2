"""NoLoCo, worker side: after H inner steps, the outer step with one random partner's φ and
Δ (training/noloco.py has the arithmetic and the partner bounds), or alone.

The daemon (node/algorithms/noloco/__init__.py) puts the partner's payload in the inbox and says
``outer_go`` with ``peer`` true; a payload the checks refuse is reported back
(``rejected``) so the daemon can penalize its sender, and the round goes on without it.
"""

from typing import Any, BinaryIO

import torch

from training.algorithms.rounds import Outer, run_rounds
from training.trainer import Trainer
from training.worker_config import WorkerConfig


def outer(
    trainer: Trainer, command: dict[str, Any], inbox: torch.Tensor, collected: dict[str, list[torch.Tensor]]
) -> Outer:
    # The inbox itself: the outer step's parse copies it to the model's device at once (the
    # daemon writes it again only after our outer_done), straight from page-locked memory on
    # a GPU. A clone here was a second copy of the payload into pageable memory first.
    used = trainer.apply_noloco(inbox if command.get("peer") is True else None)
    return Outer(used_peer=used, rejected=trainer.last_rejection, drifted=trainer.last_rejection_drifted)


def run(config: WorkerConfig, trainer: Trainer, commands: BinaryIO, replies: BinaryIO) -> None:
    run_rounds(config, trainer, commands, replies, outer, overlapped=True)
