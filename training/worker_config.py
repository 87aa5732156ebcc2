"""The worker's settings, torch-free: the daemon builds them and passes them as JSON."""

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from training import settings
from training.settings import RunSettings

# Where a worker trains: auto (a GPU when this torch sees one, else the CPU), cpu, cuda
# (the first GPU) or cuda:N. The worker decides (training/worker.py ``resolve_device``): the
# daemon never imports torch, and a probe of the driver's files misses sandboxed GPUs.
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
MAX_CUDA_INDEX = 63
COMPILE_MODES = ("auto", "on", "off")


def check_device(name: str) -> str:
    """``name`` if it is one of DEVICES (N a GPU index, 0 to MAX_CUDA_INDEX); else ValueError."""
    if name in ("auto", "cpu", "cuda"):
        return name
    family, _, index = name.partition(":")
    if (
        family == "cuda"
        and index.isascii()
        and index.isdigit()
        and index == str(int(index))
        and int(index) <= MAX_CUDA_INDEX
    ):
        return name
    raise ValueError(f"must be auto, cpu, cuda or cuda:N (N a GPU index, 0 to {MAX_CUDA_INDEX}), got {name!r}")


@dataclass(kw_only=True, slots=True)
class WorkerConfig:
    run: RunSettings = field(default_factory=lambda: RunSettings(algorithm="noloco"))
    """The run's settings, whole (over JSON: their ``to_dict()``, read back strictly)."""
    model_overrides: dict[str, int] = field(default_factory=dict)
    """Preset fields to change, e.g. {"num_layers": 2} for tests."""
    node_index: int = 0
    num_nodes: int = 1
    data_path: str | None = None
    """Text file or folder; the embedded corpus when None."""
    tokenizer_path: str | None = None
    """The run's trained tokenizer.json (training/tokenizer.py); bytes when None."""
    seed: int = 0
    """Initial weights: the same on every node of a run."""
    batch_seed: int | None = None
    """Which batches this node draws; None: its shard index. Nodes that share a shard
    (no --data-shard) need distinct ones, or they would all train on the same batches."""
    threads: int = 1
    """torch threads: several workers share a CPU in a simulation."""
    slowdown: float = 1.0
    """A simulated slower machine: each inner step takes this many times as long (a pause
    after it); 1: none."""
    device: str = "cpu"
    """One of DEVICES; the worker reports where it trains in ``ready``."""
    compile: str = "auto"
    """torch.compile the model: auto means on CUDA only (on a CPU it barely helps small models)."""
    checkpoint_path: str | None = None
    """Saved after every outer step and resumed from at start (training/checkpoint.py)."""
    start_from: str | None = None
    """Without a checkpoint of its own: a peer's saved state to start from (a late joiner,
    node/algorithms/rounds.py), checked to fit and be finite, whatever its settings' fingerprint."""
    ask_start_from: bool = False
    """Without a checkpoint of its own, ask the daemon for ``start_from`` once the model is
    built (``built`` → ``start``): a joiner fetches its peer's state at the last moment, so
    it starts as close to its peers' round as it can."""

    def fingerprint(self) -> dict[str, Any]:
        """The settings a checkpoint must have been saved with to be resumed (not ``rounds``:
        a run may be extended)."""
        return {
            "model": self.run.model,
            "model_overrides": dict(sorted(self.model_overrides.items())),
            "algorithm": self.run.algorithm,
            "compression": self.run.compression,
            "node_index": self.node_index,
            "num_nodes": self.num_nodes,
            "data_path": self.data_path,
            "seed": self.seed,
            "batch_seed": self.batch_seed,
        }

    def __post_init__(self) -> None:
        if not self.run.trains:
            raise ValueError("a worker needs a run that trains (algorithm none trains nothing)")
        check_device(self.device)
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}")
        if not 0 <= self.node_index < self.num_nodes:
            raise ValueError(f"node_index {self.node_index} not in [0, {self.num_nodes})")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        if not 1 <= self.slowdown <= 100:
            raise ValueError("slowdown must be in [1, 100]")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "run": self.run.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> "WorkerConfig":
        raw = json.loads(text)
        return cls(**{**raw, "run": settings.from_dict(raw.get("run"))})
