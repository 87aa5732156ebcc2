"""The worker side of each training algorithm, one module each, named here.

An algorithm is two modules: this side (what the worker computes each round: inner and
outer steps) and the daemon's (node/algorithms/: what a round exchanges, with whom, and
when it is done). Each module here has ``run(config, trainer, commands, replies)``, the
worker's whole life in that algorithm; the φ/Δ family (local, noloco, diloco) share one
round loop (``training/algorithms/rounds.py``) and differ only in their outer step.

Adding an algorithm: its module here, its module in node/algorithms/, one line in each
registry. This file stays torch-free: training/settings.py takes the names from it.
"""

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from training.trainer import Trainer
    from training.worker_config import WorkerConfig

WorkerMain = Callable[["WorkerConfig", "Trainer", BinaryIO, BinaryIO], None]

MODULES = {
    "noloco": "training.algorithms.noloco",
    "diloco": "training.algorithms.diloco",
    "local": "training.algorithms.local",
    "zo": "training.algorithms.zo",
}
NAMES = tuple(MODULES)


def worker_main(name: str) -> WorkerMain:
    """The worker's loop for algorithm ``name`` (a name the settings already checked)."""
    main: WorkerMain = importlib.import_module(MODULES[name]).run
    return main
