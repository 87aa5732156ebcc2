"""The daemon side of each training algorithm, one module each, named here.

Each module (local, noloco, diloco, zo, spes) holds an ``ALGORITHM`` class that takes a
``base.Context`` and implements ``base.Algorithm``: what a round exchanges, with whom,
and when it is done; its worker side is the module of the same name in
training/algorithms/. The rest of the node asks this registry, never the algorithm's name.

An algorithm's wire protocol lives beside it: noloco/pairing.py, zo/zolog.py and
zo/zosync.py, spes/experts.py (and spes/leases.py, its rule); savedstate.py (the saved
state a joiner fetches) and rounds.py (payload rounds, joining.py) serve several.
"""

import importlib

from node.algorithms.base import Algorithm, Context, TrainingMetrics

MODULES = {
    "noloco": "node.algorithms.noloco",
    "diloco": "node.algorithms.diloco",
    "local": "node.algorithms.local",
    "zo": "node.algorithms.zo",
    "spes": "node.algorithms.spes",
}

__all__ = ["MODULES", "Algorithm", "Context", "TrainingMetrics", "algorithm_class", "create"]


def algorithm_class(name: str) -> type[Algorithm]:
    """The daemon side of algorithm ``name`` (``KeyError`` for a name the settings refuse)."""
    cls: type[Algorithm] = importlib.import_module(MODULES[name]).ALGORITHM
    return cls


def create(name: str, ctx: Context) -> Algorithm:
    return algorithm_class(name)(ctx)
