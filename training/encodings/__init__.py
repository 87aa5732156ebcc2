"""Outer payload encodings: how φ and Δ travel between partners (NoLoCo, DiLoCo).

Each encoding is one module here holding an ``ENCODING`` (``base.Encoding``); this table is
the only place that names them. No torch at this level: the daemon and the run settings
(training/settings.py) take the names from here without importing an encoding.

Both partners must use the same encoding: the run's settings fix it, and the payload sizes
differ, so pairing refuses a mismatch before a byte moves.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.encodings.base import Encoding
    from training.encodings.experts import ExpertVersions

MODULES = {
    "none": "training.encodings.float32",
    "int8": "training.encodings.int8",
    "sparseloco": "training.encodings.sparseloco",
}
NAMES = tuple(MODULES)
EXPERT_VERSIONS = {"none": "float32", "int8": "int8", "sparseloco": "sparse"}
"""How a run of each encoding sends SPES's published expert versions (training/encodings/experts.py)."""


def encoding(name: str) -> "Encoding":
    """The encoding called ``name`` (a run setting: ``compression``)."""
    if name not in MODULES:
        raise ValueError(f"compression must be one of {', '.join(NAMES)}, got {name!r}")
    found: Encoding = importlib.import_module(MODULES[name]).ENCODING
    return found


def expert_versions(name: str) -> "ExpertVersions":
    """How the expert versions of a run whose ``compression`` is ``name`` travel (numpy only)."""
    if name not in MODULES:
        raise ValueError(f"compression must be one of {', '.join(NAMES)}, got {name!r}")
    from training.encodings.experts import VERSIONS

    return VERSIONS[EXPERT_VERSIONS[name]]
