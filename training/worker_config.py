"""The worker's settings, torch-free: the daemon builds them and passes them as JSON."""

from dataclasses import dataclass, field
from typing import Any

ALGORITHMS = ("noloco", "diloco", "local")
# The presets of training/models.py, named here so torch-free code (the daemon) can check them.
MODEL_PRESETS = ("micro", "tiny", "gpt-125m")


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    model: str = "tiny"
    """Model preset (training/models.py)."""
    model_overrides: dict[str, int] = field(default_factory=dict)
    """Preset fields to change, e.g. {"num_layers": 2} for tests."""
    algorithm: str = "noloco"
    node_index: int = 0
    num_nodes: int = 1
    rounds: int = 10
    inner: dict[str, Any] = field(default_factory=dict)
    """InnerConfig fields."""
    outer: dict[str, float] = field(default_factory=dict)
    """OuterConfig fields."""
    data_path: str | None = None
    """Text file or folder; the embedded corpus when None."""
    seed: int = 0
    """Initial weights: the same on every node of a run."""
    threads: int = 1
    """torch threads: several workers share a CPU in a simulation."""

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model must be one of {', '.join(MODEL_PRESETS)}, got {self.model!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if not 0 <= self.node_index < self.num_nodes:
            raise ValueError(f"node_index {self.node_index} not in [0, {self.num_nodes})")
        if self.rounds < 1 or self.threads < 1:
            raise ValueError("rounds and threads must be >= 1")
