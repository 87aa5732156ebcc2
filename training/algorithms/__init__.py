"""The worker side of each training algorithm, one module each, named here.

An algorithm is two modules: this side (what the worker computes each round: inner and
outer steps) and the daemon's (node/algorithms/: what a round exchanges, with whom, and
when it is done). Each module here has ``run(config, trainer, commands, replies)``, the
worker's whole life in that algorithm; the φ/Δ family (local, noloco, diloco) share one
round loop (``training/algorithms/rounds.py``) and differ only in their outer step (SPES
too, with an experts block beside it, and a trainer of its own: ``make_trainer``).

Adding an algorithm: its module here, its module in node/algorithms/, one line in each
registry. This file stays torch-free and imports nothing of ours: training/settings.py
takes the names from it, and training/worker.py looks the module up (``worker_main``).
"""

MODULES = {
    "noloco": "training.algorithms.noloco",
    "diloco": "training.algorithms.diloco",
    "local": "training.algorithms.local",
    "zo": "training.algorithms.zo",
    "spes": "training.algorithms.spes",
}
NAMES = tuple(MODULES)
MIXTURE_OF_EXPERTS = frozenset({"spes"})
"""Algorithms that train only a mixture-of-experts model (their default: its tiny preset)."""
FORWARDS_PER_STEP = {"noloco": 3, "diloco": 3, "local": 3, "zo": 2, "spes": 3}
"""What one step costs per block of its batch, in forwards of a block: a training step's
forward and backward ≈ 3 (the backward ≈ twice the forward); ZO's SPSA, two forwards
(training/validation.py sizes evaluation by it)."""
