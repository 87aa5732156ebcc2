"""The worker's settings, torch-free: the daemon builds them and passes them as JSON."""

from dataclasses import dataclass, field
from typing import Any

ALGORITHMS = ("noloco", "diloco", "local", "zo")
# The presets of training/models.py, named here so torch-free code (the daemon) can check them.
MODEL_PRESETS = ("micro", "tiny", "gpt-125m")
DEVICES = ("cpu", "cuda")
COMPILE_MODES = ("auto", "on", "off")
# Outer payload encodings (training/trainer.py has the wire layout).
COMPRESSIONS = ("none", "int8")


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    model: str = "tiny"
    """Model preset (training/models.py)."""
    model_overrides: dict[str, int] = field(default_factory=dict)
    """Preset fields to change, e.g. {"num_layers": 2} for tests."""
    algorithm: str = "noloco"
    compression: str = "none"
    """Outer payload encoding: none (float32) or int8 (blockwise, ≈ 3.9× fewer bytes)."""
    node_index: int = 0
    num_nodes: int = 1
    rounds: int = 10
    inner: dict[str, Any] = field(default_factory=dict)
    """InnerConfig fields."""
    outer: dict[str, float] = field(default_factory=dict)
    """OuterConfig fields."""
    zo: dict[str, float] = field(default_factory=dict)
    """ZoConfig fields (algorithm zo)."""
    data_path: str | None = None
    """Text file or folder; the embedded corpus when None."""
    seed: int = 0
    """Initial weights: the same on every node of a run."""
    batch_seed: int | None = None
    """Which batches this node draws; None: its shard index. Nodes that share a shard
    (no --data-shard) need distinct ones, or they would all train on the same batches."""
    threads: int = 1
    """torch threads: several workers share a CPU in a simulation."""
    device: str = "cpu"
    compile: str = "auto"
    """torch.compile the model: auto means on CUDA only (on a CPU it barely helps small models)."""
    checkpoint_path: str | None = None
    """Saved after every outer step and resumed from at start (training/checkpoint.py)."""

    def fingerprint(self) -> dict[str, Any]:
        """The settings a checkpoint must have been saved with to be resumed (not ``rounds``:
        a run may be extended)."""
        return {
            "model": self.model,
            "model_overrides": dict(sorted(self.model_overrides.items())),
            "algorithm": self.algorithm,
            "compression": self.compression,
            "node_index": self.node_index,
            "num_nodes": self.num_nodes,
            "data_path": self.data_path,
            "seed": self.seed,
            "batch_seed": self.batch_seed,
        }

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model must be one of {', '.join(MODEL_PRESETS)}, got {self.model!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.device not in DEVICES or self.compile not in COMPILE_MODES:
            raise ValueError(f"device must be one of {DEVICES} and compile one of {COMPILE_MODES}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if not 0 <= self.node_index < self.num_nodes:
            raise ValueError(f"node_index {self.node_index} not in [0, {self.num_nodes})")
        if self.rounds < 1 or self.threads < 1:
            raise ValueError("rounds and threads must be >= 1")
