"""What a run trains: one `RunSettings`, defined and validated here, used whole everywhere.

It flows unchanged from the TOML file (`[run.settings]`) or CLI flags (`--algorithm`,
`--set outer.beta=0.5`…) of the node that creates the run into the run manifest
(protocol/runstate/state.py carries it as `encode()` bytes, signed by the creator), to every
joiner (which adopts the run's, whatever its own say), to the worker (training/worker.py,
as `to_dict()` JSON) and to `simulate`. Nothing re-declares a field: a new setting is one
field here.

Torch-free, so the daemon imports it. The manifest's settings are a stranger's bytes:
`decode` bounds them before anything else, and `from_dict` accepts exactly the fields
below, each type- and range-checked (a node that does not know a model or an algorithm of
a newer release refuses to train in that run, and stays on the network).
"""

import math
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

import msgpack

from training import algorithms, encodings
from training.tokenizer import TokenizerError, bpe_vocab

ABSENT = "absent"
"""Field metadata: the value a run manifest that lacks the setting means (a setting added
after a release: that release behaved as this value; see ``from_dict``)."""

# "none": the run trains nothing (its nodes form the network only); the others are the
# registry's (training/algorithms/).
ALGORITHMS = ("none", *algorithms.NAMES)
# The presets of training/models.py, named here so torch-free code (the daemon) can check them.
MODEL_PRESETS = ("micro", "tiny", "gpt-125m", "micro-moe", "tiny-moe", "gpt-125m-moe")
# The mixture-of-experts presets: what SPES trains (each node owns some of their experts).
MOE_PRESETS = ("tiny-moe", "micro-moe", "gpt-125m-moe")
# Outer payload encodings: the registry's (training/encodings/).
COMPRESSIONS = encodings.NAMES
# Far above any settings blob (a few hundred bytes): bounds what a manifest can make us decode.
MAX_ENCODED_NBYTES = 4096
MAX_ROUNDS = 1 << 30
"""The largest budget of rounds, and the round a run without one (``rounds`` 0) stops
before: past any run's life (2^30 rounds of one second are 34 years)."""


class SettingsError(ValueError):
    """A setting has the wrong name, type or value; the message names it (`outer.beta`)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


def _in_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    low_ok = value > lo if lo_open else value >= lo
    finite = not isinstance(value, float) or math.isfinite(value)  # ints compare exactly, however large
    _check(
        finite and low_ok and value <= hi,
        f"{name}: must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r:.40}",
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerConfig:
    """The inner steps (training/trainer.py); ZO uses steps_per_round only."""

    steps_per_round: int = 50
    """H: inner steps between outer steps (ZO: updates each node publishes per round)."""
    lr: float = 1e-3
    """Inner AdamW learning rate."""
    weight_decay: float = 0.1
    batch_size: int = 8
    grad_clip: float = 1.0
    """Gradient norm clip."""

    def __post_init__(self) -> None:
        _in_range("inner.steps_per_round", self.steps_per_round, 1, 1 << 20)
        _in_range("inner.batch_size", self.batch_size, 1, 1 << 16)
        _in_range("inner.lr", self.lr, 0.0, 1.0, lo_open=True)
        _in_range("inner.weight_decay", self.weight_decay, 0.0, 10.0)
        _in_range("inner.grad_clip", self.grad_clip, 0.0, 1e6, lo_open=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    """The outer step of NoLoCo and DiLoCo (training/noloco.py)."""

    alpha: float = 0.5
    """Outer momentum decay α."""
    beta: float = 0.7
    """Outer learning rate β on the averaged outer gradient."""
    gamma: float = 0.7
    """Pull γ of our slow weights towards the pair's mean (NoLoCo only)."""
    overlap: float = 0.5
    """At most this share of the next round's inner steps is taken before a round's outer
    step lands (NoLoCo, DiLoCo, local): the worker trains on while its exchange travels,
    and makes the step as soon as the daemon's word is there, under the steps taken since
    (training/algorithms/rounds.py); past that share it waits. 0: the worker waits at every
    round boundary (a barrier), as before. SPES waits at each boundary whatever this says
    (its experts change owner there)."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            _in_range(f"outer.{name}", getattr(self, name), 0.0, 2.0)
        _in_range("outer.overlap", self.overlap, 0.0, 1.0)

    def overlap_steps(self, steps_per_round: int) -> int:
        """How many of a round's inner steps come before the last round's outer step (the
        nearest whole number: 0.29 of 100 is 29, where the floor of 28.999999999999996 is 28)."""
        return round(self.overlap * steps_per_round)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZoConfig:
    """Seed-based zeroth-order steps (training/zo.py)."""

    eps: float = 1e-3
    """Perturbation size ε of the two forwards."""
    lr: float = 0.0
    """Step size: θ ← θ − lr·g·z; 0 (the default): scaled to the model, 360 / its
    parameter count (training/zo.py ``step_size``: 3e-3 on micro, 1.1e-4 on tiny)."""
    g_max: float = 16.0
    """Largest |g| one byte carries (larger saturates)."""
    signs: int = field(default=2, metadata={ABSENT: 1})
    """The perturbation generator (kernels/rng.py): 1, one 32-bit hash per sign; 2, 32 signs
    per hash. Every node of a run uses the run's. 2 by default since 2026-11-27 (a manifest
    without the setting is from before it and means 1): it applies 2.1-2.8× faster on a
    CPU, and on an H200 its kernel ran 1.3-4.7× faster than version 1's at K = 8 to 64
    updates a pass and replayed a gpt-125m log 3.0× faster (22.4k updates/s against 7.4k;
    docs/performance.md). At K = 1 it was 0.73-0.76× of version 1's, both far under the
    copy bandwidth there (a call's fixed costs, not the kernel). 3: version 2's signs, a
    round's updates summed in chunks of 8 (kernels/zo_apply.py), so a GPU looks each chunk's
    sum up in a table: the same bits as 2 for rounds of at most 8 updates; its kernel takes
    1.69 instructions per element and update against version 2's 4.09 (sm_90 code) and ran
    64 updates a pass 1.26× as fast as version 2's on an H100 (0.379 of copy bandwidth
    against 0.300; 1 and 8 a pass the same), 1.04× since both load θ whole (0.289 / 0.277).
    For runs whose rounds hold many updates (nodes × H): a round of fewer than 8 still makes
    a chunk's 8 hashes and its table of 256. 4: as 3
    with chunks of 4, whose tables of 16 a GPU holds in a warp's registers and looks up by
    shuffles, not loads (the same bits as 2 for rounds of at most 4 updates): on an H100
    (2026-11-28) 64 updates a pass at 0.511 of copy bandwidth against version 2's 0.277, 1
    and 8 a pass at 0.99 as version 2, a gpt-125m log replayed at 29.2k updates/s against
    21.4k (docs/zo.md). Versions 3 and 4 are opt-in; the default stays 2."""

    def __post_init__(self) -> None:
        _check(self.signs in (1, 2, 3, 4), f"zo.signs: must be 1, 2, 3 or 4, got {self.signs!r}")
        _in_range("zo.eps", self.eps, 0.0, 1.0, lo_open=True)
        _in_range("zo.lr", self.lr, 0.0, 1.0)
        _in_range("zo.g_max", self.g_max, 0.0, 1e6, lo_open=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpesConfig:
    """Sparse expert sync (training/spes.py, node/algorithms/spes/): each node trains only
    the experts it leases; the shared weights are averaged as NoLoCo does (``outer``)."""

    merge_alpha: float = 0.05
    """α_0 of expert merging: an owned expert moves this far toward the mean of its most
    similar peers each round, e ← e + α_t·mean_k(e_k − e); 0 turns merging off."""
    merge_fraction: float = 0.2
    """α_t falls linearly from merge_alpha to 0 over this fraction of the run's rounds (of
    100 rounds in a run until its nodes stop: training/spes.py)."""
    merge_k: int = 2
    """How many of the most similar experts (cosine of their first-layer weights) an expert merges with."""
    lapse_rounds: int = 2
    """An owner that published none of its experts for this many of our rounds loses its
    leases (as does one whose liveness expired)."""
    prefer_owned: float = field(default=0.1, metadata={ABSENT: 0.0})
    """Added to an owned expert's routing score (a softmax probability, 1/8 on average
    with 8 experts) when a node picks experts for its training steps, so its own experts
    get more of its tokens; evaluation routes without it (training/moe.py). 0: off, what
    a run whose manifest lacks it (made before 2026-11-27) does. docs/training.md has
    what it measured."""

    def __post_init__(self) -> None:
        _in_range("spes.prefer_owned", self.prefer_owned, 0.0, 1.0)
        _in_range("spes.merge_alpha", self.merge_alpha, 0.0, 1.0)
        _in_range("spes.merge_fraction", self.merge_fraction, 0.0, 1.0)
        _in_range("spes.merge_k", self.merge_k, 1, 1024)
        _in_range("spes.lapse_rounds", self.lapse_rounds, 1, 1 << 20)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """Everything every trainer of a run must do alike; the run's creator decides."""

    algorithm: str = "noloco"
    """noloco (the default: a node that starts a run trains), none (network only), diloco
    (average with every live peer: a baseline),
    local (no averaging: the other baseline), zo (seed-based zeroth-order) or spes
    (sparse expert sync: a mixture-of-experts model, each node training its own experts)."""
    model: str = "tiny"
    """Model preset (training/models.py)."""
    rounds: int = 0
    """Outer rounds to train, then the workers stop (the nodes stay on the network); 0
    (the default): no budget, the run trains until its nodes stop. ``simulate`` sets its
    own short budget."""
    compression: str = "none"
    """Outer payload encoding: none (float32), int8 (blockwise, ≈ 3.9× fewer bytes) or
    sparseloco (training/encodings/); SPES's expert versions follow it
    (training/encodings/experts.py: float32, int8, int8 keyframes and sparse deltas)."""
    seed: int = 0
    """The run's initial weights (the same on every node) and the order of each node's
    batches: runs that differ only in it show what chance does (bench/spes.py)."""
    data_sha256: str = ""
    """The SHA-256 of the text the run trains on (training/corpus.py), set by a creator
    started with ``--data``; "" is the embedded corpus. A node trains in the run only with
    data that hashes the same."""
    tokenizer: str = "bytes"
    """How text becomes tokens (training/tokenizer.py): bytes, or bpe-N, a byte-level BPE of
    at most N tokens every node trains alike on the run's text."""
    tokenizer_sha256: str = ""
    """With bpe-N: the SHA-256 of the creator's trained tokenizer.json (set when the run is
    created); a node whose own differs does not train in the run."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    zo: ZoConfig = field(default_factory=ZoConfig)
    spes: SpesConfig = field(default_factory=SpesConfig)

    def __post_init__(self) -> None:
        _choice("algorithm", self.algorithm, ALGORITHMS)
        _choice("model", self.model, MODEL_PRESETS)
        _choice("compression", self.compression, COMPRESSIONS)
        _in_range("rounds", self.rounds, 0, MAX_ROUNDS)
        _in_range("seed", self.seed, 0, 65535)
        for name in ("data_sha256", "tokenizer_sha256"):
            value = getattr(self, name)
            _check(
                value == "" or (len(value) == 64 and set(value) <= set("0123456789abcdef")),
                f"{name}: a SHA-256 in lowercase hex, or empty, got {value!r:.80}",
            )
        try:
            bpe_vocab(self.tokenizer)
        except TokenizerError as exc:
            raise SettingsError(str(exc)) from exc
        _check(
            self.algorithm not in algorithms.MIXTURE_OF_EXPERTS or self.model in MOE_PRESETS,
            f"model: {self.algorithm} trains a mixture of experts ({', '.join(MOE_PRESETS)}), got {self.model!r}",
        )

    @property
    def trains(self) -> bool:
        return self.algorithm in algorithms.MODULES

    @property
    def round_limit(self) -> int:
        """The round every trainer of the run stops before: ``rounds``, or ``MAX_ROUNDS``
        for a run until its nodes stop."""
        return self.rounds or MAX_ROUNDS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def encode(self) -> bytes:
        """Canonical bytes (the manifest signs them): msgpack of `to_dict`, fields in order."""
        packed: bytes = msgpack.packb(self.to_dict(), use_bin_type=True)
        return packed

    def flat(self) -> dict[str, Any]:
        """Every leaf by its dotted name: {"inner.lr": 0.001, ...}."""
        return _flatten(self.to_dict())

    def differences(self, other: "RunSettings") -> list[str]:
        """'name ours -> theirs' for every leaf setting that differs."""
        ours, theirs = _flatten(self.to_dict()), _flatten(other.to_dict())
        return [f"{name} {ours[name]!r} -> {theirs[name]!r}" for name in ours if ours[name] != theirs[name]]

    def with_values(self, values: dict[str, Any]) -> "RunSettings":
        """A copy with dotted-name values in place (`{"outer.beta": 0.5}`), each checked."""
        nested = self.to_dict()
        for dotted, value in values.items():
            *parents, leaf = dotted.split(".")
            node = nested
            for part in parents:
                _check(isinstance(node.get(part), dict), f"{dotted}: unknown setting (known: {', '.join(names())})")
                node = node[part]
            _check(
                leaf in node and not isinstance(node[leaf], dict),
                f"{dotted}: unknown setting (known: {', '.join(names())})",
            )
            node[leaf] = value
        return from_dict(nested)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name}: must be one of {', '.join(choices)}, got {value!r}")


def _flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in nested.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def default_model(algorithm: str) -> str:
    """The model a run of ``algorithm`` trains unless told otherwise."""
    return MOE_PRESETS[0] if algorithm in algorithms.MIXTURE_OF_EXPERTS else "tiny"


def names() -> list[str]:
    """Every settable leaf, dotted (`outer.beta`)."""
    return list(_flatten(RunSettings().to_dict()))


def from_dict(data: Any, *, manifest: bool = False) -> RunSettings:
    """The settings ``data`` names (missing ones keep their defaults), each checked: unknown
    names, wrong types and out-of-range values are a `SettingsError` naming the setting.
    ``manifest``: ``data`` is a run's manifest, perhaps written by an earlier release, so a
    setting added since (its field's ``ABSENT`` metadata) takes the value that release
    behaved as, not the new default: every trainer of that run then does alike."""
    settings: RunSettings = _from_dict(data, RunSettings, prefix="", manifest=manifest)
    return settings


def _from_dict(data: Any, cls: type, *, prefix: str, manifest: bool = False) -> Any:
    _check(isinstance(data, dict), f"{prefix.rstrip('.') or 'settings'}: expected a table, got {type(data).__name__}")
    assert is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = [str(k)[:40] for k in data if k not in known]
    _check(not unknown, f"{prefix}{unknown[0] if unknown else ''}: unknown setting (known: {', '.join(known)})")
    values: dict[str, Any] = {}
    for name, spec in known.items():
        hint, dotted = hints[name], f"{prefix}{name}"
        if name not in data:
            if manifest and ABSENT in spec.metadata:
                values[name] = spec.metadata[ABSENT]
            elif manifest and is_dataclass(hint):
                values[name] = _from_dict({}, typing.cast(type, hint), prefix=f"{dotted}.", manifest=True)
            continue
        value = data[name]
        if is_dataclass(hint):
            values[name] = _from_dict(value, typing.cast(type, hint), prefix=f"{dotted}.", manifest=manifest)
        else:
            values[name] = _scalar(dotted, hint, value)
    return cls(**values)


def _scalar(name: str, hint: Any, value: Any) -> Any:
    if hint is str:
        _check(isinstance(value, str) and len(value) <= 64, f"{name}: expected a short string, got {value!r:.40}")
        return value
    is_number = not isinstance(value, bool) and isinstance(value, int | float)
    _check(is_number, f"{name}: expected a number, got {value!r:.40}")
    if hint is int:
        # CRDT documents hand small ints back as floats: a whole float is an int.
        whole = isinstance(value, int) or value.is_integer()
        _check(whole, f"{name}: expected a whole number, got {value!r:.40}")
        return int(value)
    assert hint is float, f"setting {name} has unsupported type {hint}"
    try:
        return float(value)
    except OverflowError as exc:
        raise SettingsError(f"{name}: {str(value)[:40]}... is too large") from exc


def decode(raw: bytes) -> RunSettings:
    """Settings from `encode()` bytes (a stranger's, in a manifest): bounded, then checked."""
    _check(len(raw) <= MAX_ENCODED_NBYTES, f"settings of {len(raw)} bytes exceed {MAX_ENCODED_NBYTES}")
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise SettingsError(f"settings: undecodable: {exc}") from exc
    return from_dict(data, manifest=True)


def parse_assignment(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` from the command line (`outer.beta=0.5`): the name checked, the value
    read as the setting's type."""
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    _check(bool(sep) and bool(name), f"{text!r}: expected NAME=VALUE, e.g. outer.beta=0.5")
    default = _flatten(RunSettings().to_dict()).get(name)
    _check(default is not None, f"{name}: unknown setting (known: {', '.join(names())})")
    if isinstance(default, str):
        return name, value
    try:
        return name, int(value) if isinstance(default, int) else float(value)
    except ValueError as exc:
        kind = "a whole number" if isinstance(default, int) else "a number"
        raise SettingsError(f"{name}: expected {kind}, got {value!r}") from exc


__all__ = [
    "ALGORITHMS",
    "COMPRESSIONS",
    "MAX_ROUNDS",
    "MODEL_PRESETS",
    "MOE_PRESETS",
    "InnerConfig",
    "OuterConfig",
    "RunSettings",
    "SettingsError",
    "SpesConfig",
    "ZoConfig",
    "decode",
    "default_model",
    "from_dict",
    "names",
    "parse_assignment",
]
