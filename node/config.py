"""Typed node configuration: defaults < TOML file < command-line flags.

TOML is read in exactly one place (``load``). Flags arrive as a mapping of dotted field
names (``{"network.listen": [...]}``) laid over the file's values, and the merged mapping
is checked field by field: an unknown key or a value of the wrong type or range raises
``ConfigError`` naming the field, e.g. ``network.dial_timeout_s: must be > 0, got -1``.
"""

import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from node.errors import ConfigError
from training import settings
from training.settings import RunSettings
from training.worker_config import COMPILE_MODES, check_device

T = typing.TypeVar("T")

RUN_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
RUN_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}-[0-9a-f]{6}")
ROLES = ("trainer", "bootstrap", "observer")
LOG_LEVELS = ("debug", "info", "warning", "error")
# protocol/net/nat.py's RELAY_MODES and FORCED_REACHABILITY; repeated so reading a config never imports libp2p.
RELAY_MODES = ("auto", "on", "off")
REACHABILITY_MODES = ("auto", "public", "private")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "swarmtrain"


@dataclass(kw_only=True, slots=True)
class NetworkConfig:
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/7400"])
    """Multiaddrs to listen on (``/ip4/<ip>/tcp/<port>`` or ``/ip6/<ip>/tcp/<port>``; port 0 picks a free one)."""
    announce: list[str] = field(default_factory=list)
    """Addresses to tell peers instead of the listen addresses (e.g. a public IP)."""
    bootstrap: list[str] = field(default_factory=list)
    """Peers to join through, as ``/ip4/<ip>/tcp/<port>/p2p/<peer id>``."""
    dial_timeout_s: float = 10.0
    """Give up on a dial after this long."""
    mdns: bool = False
    """Also find peers on the local network by mDNS (multicasts on every interface)."""
    upload_limit_mbps: float = 0.0
    """Cap on tensor uploads in megabits per second (0: no cap); control traffic is not capped."""
    relay: str = "auto"
    """Offer circuit relay to peers behind NAT: auto (while peers confirm we are reachable), on, off."""
    relay_max_reservations: int = 32
    """Peers behind NAT that may hold a relay slot on us at once."""
    relay_max_circuits: int = 64
    """Relayed connections through us at once."""
    relay_circuit_duration_s: int = 3600
    """A relayed connection through us is closed after this long (the peers may reconnect)."""
    relay_circuit_data_mib: int = 64
    """Bytes a relayed connection through us may carry, both directions together."""
    relay_reservation_ttl_s: int = 900
    """A relay slot on us lasts this long unless its holder renews it (libp2p renews 30 s
    before the end): a slot held by a peer that needs it no more is free again after this."""
    upnp: bool = False
    """Ask the home router to forward our listen port (UPnP IGD); changes the router, so off by default."""
    reachability: str = "auto"
    """auto: peers dial us back to tell; public or private: skip the check (you know better)."""
    relayed_tensors_mbps: float = 0.0
    """Tensors over relayed connections: 0 never (default: control traffic only); > 0 allowed at this cap."""

    def __post_init__(self) -> None:
        from protocol.net.host import check_listen_addr, parse_dial_addr

        if not self.listen:
            raise ConfigError("network.listen: at least one address is needed")
        for addr in self.listen:
            _wrap("network.listen", check_listen_addr, addr)
        for addr in self.bootstrap:
            _wrap("network.bootstrap", parse_dial_addr, addr)
        _positive("network.dial_timeout_s", self.dial_timeout_s)
        if not 0 <= self.upload_limit_mbps < 1e9:  # also refuses NaN
            raise ConfigError(f"network.upload_limit_mbps: must be >= 0 (0: no cap), got {self.upload_limit_mbps:g}")
        if not 0 <= self.relayed_tensors_mbps < 1e9:
            raise ConfigError(
                f"network.relayed_tensors_mbps: must be >= 0 (0: never), got {self.relayed_tensors_mbps:g}"
            )
        if self.reachability not in REACHABILITY_MODES:
            raise ConfigError(
                f"network.reachability: must be one of {', '.join(REACHABILITY_MODES)}, got {self.reachability!r}"
            )
        if self.relay not in RELAY_MODES:
            raise ConfigError(f"network.relay: must be one of {', '.join(RELAY_MODES)}, got {self.relay!r}")
        for name in ("relay_max_reservations", "relay_max_circuits", "relay_circuit_duration_s"):
            if not 1 <= getattr(self, name) <= 1_000_000:
                raise ConfigError(f"network.{name}: must be 1 to 1000000, got {getattr(self, name)}")
        if not 1 <= self.relay_circuit_data_mib <= 1 << 20:
            raise ConfigError(
                f"network.relay_circuit_data_mib: must be 1 to {1 << 20}, got {self.relay_circuit_data_mib}"
            )
        if not 60 <= self.relay_reservation_ttl_s <= 86_400:
            # Below a minute a holder renewing 30 s before the end would renew all the time.
            raise ConfigError(
                f"network.relay_reservation_ttl_s: must be 60 to 86400, got {self.relay_reservation_ttl_s}"
            )


@dataclass(kw_only=True, slots=True)
class DiscoveryConfig:
    interval_s: float = 5.0
    """How often to look the run up in the DHT again while peers are missing."""
    idle_interval_s: float = 30.0
    """How often to look it up once every known member is connected."""

    def __post_init__(self) -> None:
        _positive("discovery.interval_s", self.interval_s)
        _positive("discovery.idle_interval_s", self.idle_interval_s)


@dataclass(kw_only=True, slots=True)
class StateConfig:
    heartbeat_interval_s: float = 5.0
    """How often to announce liveness (and our state digest) by gossip."""
    peer_ttl_s: float = 30.0
    """A peer silent for this long is considered gone."""
    anti_entropy_interval_s: float = 3.0
    """How often to pull state from a random live peer, repairing what gossip dropped."""
    save_interval_s: float = 2.0
    """At most this long between a state change and its write to disk."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "peer_ttl_s", "anti_entropy_interval_s", "save_interval_s"):
            _positive(f"state.{name}", getattr(self, name))
        if self.heartbeat_interval_s < 1.0:
            raise ConfigError(f"state.heartbeat_interval_s: must be at least 1 s, got {self.heartbeat_interval_s:g}")
        if self.peer_ttl_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"state.peer_ttl_s: must exceed twice state.heartbeat_interval_s "
                f"({2 * self.heartbeat_interval_s:g}), got {self.peer_ttl_s:g}"
            )


@dataclass(kw_only=True, slots=True)
class RunConfig:
    new_run: str | None = None
    """Start a new run with this name (its id gets a random suffix)."""
    run_id: str | None = None
    """Join the run with this id."""
    settings: RunSettings = field(default_factory=RunSettings)
    """What the run trains (training/settings.py), if this node creates it: a joiner
    adopts the run's own, whatever these say."""

    def __post_init__(self) -> None:
        if self.new_run is not None and self.run_id is not None:
            raise ConfigError("run: give either new_run (--new-run) or run_id (--run), not both")
        if self.new_run is not None and not RUN_NAME_PATTERN.fullmatch(self.new_run):
            raise ConfigError(
                f"run.new_run: {self.new_run!r} must be 1-40 of a-z 0-9 _ - (starting with a letter or digit)"
            )
        if self.run_id is not None and not RUN_ID_PATTERN.fullmatch(self.run_id):
            raise ConfigError(f"run.run_id: {self.run_id!r} is not a run id like 'name-1a2b3c'")


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """This node's own part in training; what the run trains is ``run.settings``."""

    shard_index: int = 0
    """Which slice of the corpus this node trains on ..."""
    num_shards: int = 1
    """... out of how many."""
    pair_timeout_s: float = 30.0
    """Longest wait for a NoLoCo partner at a round boundary; then the round goes on alone."""
    threads: int = 1
    """torch threads of the worker."""
    slowdown: float = 1.0
    """Simulations only (``simulate --slow-node``): the worker pauses after each inner step
    so that it takes this many times as long, as a slower machine would; 1: no pause."""
    compile: str = "auto"
    """torch.compile the model: auto (on CUDA only), on, off."""
    data: str | None = None
    """This node's copy of the run's text: a file or a folder of .txt/.md/.jsonl files
    (training/corpus.py); None: the embedded corpus. A run started with it records its hash."""

    def __post_init__(self) -> None:
        _choice("training.compile", self.compile, COMPILE_MODES)
        for name in ("num_shards", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(f"training.shard_index: must be in [0, {self.num_shards}), got {self.shard_index}")
        _positive("training.pair_timeout_s", self.pair_timeout_s)
        if not 1 <= self.slowdown <= 100:  # also refuses NaN
            raise ConfigError(f"training.slowdown: must be between 1 and 100, got {self.slowdown!r}")


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    """Holds the identity, the control socket, the lock and saved run state."""
    log_level: str = "info"
    """One of debug, info, warning, error."""
    log_file: Path | None = None
    """Also write the log here (appended), at ``log_level`` (``join`` shows only warnings on
    the console: its story is the console)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics at http://metrics_host:PORT/metrics (0: a free port); None: off."""
    metrics_host: str = "127.0.0.1"
    """Where the metrics server listens (0.0.0.0 for a Prometheus on another machine)."""
    role: str = "trainer"
    """What this node does in a run: trainer, bootstrap (infrastructure only) or observer."""
    device: str = "auto"
    """Where the worker trains: auto (a GPU if the worker's torch sees one), cpu, cuda or cuda:N."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    state: StateConfig = field(default_factory=StateConfig)
    run: RunConfig = field(default_factory=RunConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def __post_init__(self) -> None:
        _choice("log_level", self.log_level, LOG_LEVELS)
        _choice("role", self.role, ROLES)
        _wrap("device", check_device, self.device)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: a TCP port is 0 to 65535, got {self.metrics_port}")


def load(path: Path | None, overrides: dict[str, Any] | None = None) -> NodeConfig:
    """Build the config from an optional TOML file and dotted-name overrides (flags)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: not valid TOML: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    run_settings = data.get("run", {}).get("settings")
    if (
        isinstance(run_settings, dict)
        and "model" not in run_settings
        and isinstance(run_settings.get("algorithm"), str)
    ):
        # A run names an algorithm but no model: the algorithm's own default (SPES: tiny-moe).
        run_settings["model"] = settings.default_model(run_settings["algorithm"])
    return from_mapping(NodeConfig, data, prefix="")


# Before issue 13 these sat under [training]; say where they went rather than "unknown".
_MOVED = {
    **{name: f"run.settings.{name}" for name in ("algorithm", "model", "rounds", "compression")},
    **{name: f"run.settings.inner.{name}" for name in ("steps_per_round", "lr", "batch_size")},
}


def from_mapping(cls: type[T], data: dict[str, Any], *, prefix: str) -> T:
    """Construct dataclass ``cls`` from ``data``, checking names and types field by field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if prefix == "training." and (moved := [n for n in unknown if n in _MOVED]):
        raise ConfigError(f"training.{moved[0]}: run settings moved to [run.settings]: use {_MOVED[moved[0]]}")
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown setting (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        kwargs[f.name] = _convert(f"{prefix}{f.name}", hints[f.name], data[f.name])
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from exc


def _convert(name: str, hint: Any, value: Any) -> Any:
    if hint is RunSettings:  # checked where it is defined, with the same rules as a manifest's
        try:
            return settings.from_dict(value)
        except settings.SettingsError as exc:
            raise ConfigError(f"{name}.{exc}") from exc
    if is_dataclass(hint):
        return from_mapping(hint, value, prefix=f"{name}.")  # type: ignore[arg-type]
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(name, inner, value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [_convert(f"{name}[{i}]", args[0], item) for i, item in enumerate(value)]
    if hint is Path:
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(f"{name}: expected a path, got {value!r}")
        return Path(value).expanduser()
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected a whole number, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise AssertionError(f"config field {name} has unsupported type {hint}")


def _wrap(name: str, check: typing.Callable[[str], object], value: str) -> None:
    try:
        check(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from exc


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}: must be > 0, got {value:g}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: must be one of {', '.join(choices)}, got {value!r}")
