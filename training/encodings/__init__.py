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

MODULES = {
    "none": "training.encodings.float32",
    "int8": "training.encodings.int8",
    "sparseloco": "training.encodings.sparseloco",
}
NAMES = tuple(MODULES)


def encoding(name: str) -> "Encoding":
    """The encoding called ``name`` (a run setting: ``compression``)."""
    if name not in MODULES:
        raise ValueError(f"compression must be one of {', '.join(NAMES)}, got {name!r}")
    found: Encoding = importlib.import_module(MODULES[name]).ENCODING
    return found
