"""``swarmtrain node``: flags to a NodeConfig, then the daemon until a signal (or, under a
supervisor, the end of stdin).

Its own module so that ``simulate``'s node processes (node/simulate/children.py) start a
daemon without importing the whole CLI, which imports ``simulate``: no import loop.
"""

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node import config as config_module
from node import logs
from node.errors import ConfigError, NodeError
from training import settings

if TYPE_CHECKING:
    from node.daemon import Daemon

logger = logging.getLogger("swarmtrain")

EXIT_ERROR = 1
EXIT_USAGE = 2


def with_exit_codes(command: Callable[[], int]) -> int:
    """Run a command; an error the user can fix prints one line and gives its exit code."""
    try:
        return command()
    except ConfigError as exc:
        print(f"swarmtrain: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NodeError as exc:
        print(f"swarmtrain: {exc}", file=sys.stderr)
        return EXIT_ERROR


def node_main(argv: list[str]) -> int:
    """``swarmtrain node`` with these flags (what a simulated node process runs)."""
    parser = argparse.ArgumentParser(prog="swarmtrain node", description="run the node daemon")
    add_node_flags(parser, with_bootstrap=True)
    args = parser.parse_args(argv)
    return with_exit_codes(lambda: run_daemon(node_config(args), join_addr=None, watch_stdin=args.stop_on_stdin_eof))


def add_node_flags(parser: argparse.ArgumentParser, *, with_bootstrap: bool) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (flags override it)")
    parser.add_argument("--data-dir", type=Path, help="identity, lock, control socket, saved state")
    parser.add_argument(
        "--listen",
        action="append",
        metavar="MULTIADDR",
        help="/ip4/IP/tcp/PORT or /ip6/IP/tcp/PORT (repeatable: both families)",
    )
    parser.add_argument("--port", type=int, help="listen on this TCP port on every interface (for --listen)")
    parser.add_argument("--announce", action="append", metavar="MULTIADDR", help="address to tell peers (repeatable)")
    if with_bootstrap:
        parser.add_argument(
            "--bootstrap",
            action="append",
            metavar="MULTIADDR",
            help="/ip4/IP/tcp/PORT/p2p/ID, /ip6/… or /dns4/NAME/… (repeatable)",
        )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--new-run", metavar="NAME", help="start a new run called NAME")
    group.add_argument("--run", metavar="ID", help="join the run with this id")
    parser.add_argument("--role", choices=config_module.ROLES)
    parser.add_argument("--device", metavar="DEVICE", help="auto (default: a GPU if there is one), cpu, cuda or cuda:N")
    parser.add_argument("--log-level", choices=config_module.LOG_LEVELS)
    parser.add_argument("--log-file", type=Path, metavar="PATH", help="also write the log to this file (appended)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port")
    parser.add_argument("--metrics-host", metavar="IP", help="where the metrics server listens (default 127.0.0.1)")
    parser.add_argument("--mdns", action="store_true", default=None, help="also discover peers on the LAN by mDNS")
    parser.add_argument("--upload-limit-mbps", type=float, metavar="MBIT", help="cap tensor uploads (0: none)")
    parser.add_argument("--upnp", action="store_true", default=None, help="ask the router to forward our port")
    parser.add_argument("--relay", choices=config_module.RELAY_MODES, help="offer relay to peers behind NAT")
    parser.add_argument(
        "--reachability", choices=config_module.REACHABILITY_MODES, help="skip the dial-back check: public or private"
    )
    parser.add_argument(
        "--relayed-tensors-mbps",
        type=float,
        metavar="MBIT",
        help="allow tensors over relayed connections at this cap (default 0: never)",
    )
    parser.add_argument("--heartbeat-s", type=float, metavar="S", help="liveness heartbeat interval")
    parser.add_argument("--peer-ttl-s", type=float, metavar="S", help="a peer silent this long is gone")
    # What a new run trains (--new-run); a joiner adopts the run's settings instead.
    parser.add_argument("--algorithm", choices=settings.ALGORITHMS, help="a new run trains with this algorithm")
    parser.add_argument(
        "--rounds", type=int, metavar="N", help="a run started here trains N outer rounds (default 0: until stopped)"
    )
    parser.add_argument("--inner-steps", type=int, metavar="H", help="inner steps per round")
    parser.add_argument("--model", choices=settings.MODEL_PRESETS, help="model preset (a new run trains it)")
    parser.add_argument("--compression", choices=settings.COMPRESSIONS, help="outer payload encoding (default none)")
    add_set_flag(parser)
    parser.add_argument(
        "--data", metavar="PATH", help="train on this text: a file, a folder of .txt/.md/.jsonl, or a saved HF dataset"
    )
    parser.add_argument("--data-shard", metavar="I/N", help="train on shard I of N")
    parser.add_argument("--slowdown", type=float, metavar="F", help=argparse.SUPPRESS)  # simulate --slow-node
    # For supervisors (simulate): stop cleanly when the supervisor's end of our stdin closes.
    parser.add_argument("--stop-on-stdin-eof", action="store_true", help=argparse.SUPPRESS)


_FLAG_TO_FIELD = {
    "data_dir": "data_dir",
    "listen": "network.listen",
    "announce": "network.announce",
    "bootstrap": "network.bootstrap",
    "mdns": "network.mdns",
    "upload_limit_mbps": "network.upload_limit_mbps",
    "relay": "network.relay",
    "upnp": "network.upnp",
    "reachability": "network.reachability",
    "relayed_tensors_mbps": "network.relayed_tensors_mbps",
    "new_run": "run.new_run",
    "run": "run.run_id",
    "role": "role",
    "device": "device",
    "log_level": "log_level",
    "log_file": "log_file",
    "metrics_port": "metrics_port",
    "metrics_host": "metrics_host",
    "heartbeat_s": "state.heartbeat_interval_s",
    "peer_ttl_s": "state.peer_ttl_s",
    "algorithm": "run.settings.algorithm",
    "rounds": "run.settings.rounds",
    "inner_steps": "run.settings.inner.steps_per_round",
    "model": "run.settings.model",
    "compression": "run.settings.compression",
    "data": "training.data",
    "slowdown": "training.slowdown",
}


def add_set_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"any run setting, e.g. outer.beta=0.5 or zo.lr=1e-3 (repeatable; {len(settings.names())} settings: "
        f"{', '.join(settings.names())})",
    )


def assignments(args: argparse.Namespace) -> dict[str, Any]:
    """The --set flags as dotted run-setting names and typed values."""
    values: dict[str, Any] = {}
    for text in args.set:
        try:
            name, value = settings.parse_assignment(text)
        except settings.SettingsError as exc:
            raise ConfigError(f"--set {exc}") from exc
        values[name] = value
    return values


def node_config(args: argparse.Namespace, *, bootstrap: list[str] | None = None) -> config_module.NodeConfig:
    overrides: dict[str, Any] = {}
    for flag, field_name in _FLAG_TO_FIELD.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[field_name] = str(value) if isinstance(value, Path) else value
    port = getattr(args, "port", None)
    if port is not None:
        if getattr(args, "listen", None):
            raise ConfigError("--port and --listen: give one of them (--port P means --listen /ip4/0.0.0.0/tcp/P)")
        if not 0 <= port <= 65535:
            raise ConfigError(f"--port: a TCP port is 0 to 65535, got {port}")
        overrides["network.listen"] = [f"/ip4/0.0.0.0/tcp/{port}"]
    if bootstrap is not None:
        overrides["network.bootstrap"] = bootstrap
    for name, value in assignments(args).items():
        overrides[f"run.settings.{name}"] = value
    if getattr(args, "data_shard", None):
        index, _, count = args.data_shard.partition("/")
        if not (index.isdigit() and count.isdigit()):
            raise ConfigError(f"--data-shard: expected I/N like 0/4, got {args.data_shard!r}")
        overrides["training.shard_index"], overrides["training.num_shards"] = int(index), int(count)
    return config_module.load(args.config, overrides)


def resume_last_run(config: config_module.NodeConfig) -> config_module.NodeConfig:
    """A trainer started with no run (neither --new-run nor --run) goes back to the run it
    was in last: the newest saved run state in its data dir. Said on the console."""
    if config.run.new_run is not None or config.run.run_id is not None or config.role != "trainer":
        return config
    runs = config.data_dir / "runs"
    saved = sorted(
        (p for p in runs.glob("*.crdt") if config_module.RUN_ID_PATTERN.fullmatch(p.stem)),
        key=lambda p: p.stat().st_mtime,
    )
    if not saved:
        return config
    run_id = saved[-1].stem
    others = f" (the newest of {len(saved)}; --run ID for another)" if len(saved) > 1 else ""
    print(f"resuming run {run_id}, the one this node was in last{others}", file=sys.stderr)
    config.run.run_id = run_id
    return config


def run_daemon(config: config_module.NodeConfig, *, join_addr: str | None, watch_stdin: bool = False) -> int:
    from node.daemon import Daemon

    daemon = Daemon(config, run_from_bootstrap=join_addr is not None)
    peer_id = daemon.prepare()
    console = config.log_level if join_addr is None else "warning"
    try:
        logs.setup(console, peer_id, log_file=config.log_file, file_level=config.log_level)
    except OSError as exc:
        raise ConfigError(f"--log-file {config.log_file}: {exc.strerror or exc}") from exc
    try:
        trio.run(_run_until_signal, daemon, join_addr, watch_stdin)
    except BaseExceptionGroup as group:
        _, rest = group.split(NodeError)
        if rest is not None:
            raise
        first = _first_leaf(group)
        print(f"swarmtrain: {first}", file=sys.stderr)
        return EXIT_ERROR
    return 0


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def _stop_on_stdin_eof(daemon: "Daemon") -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))  # fd 0 itself: sys.stdin may have been replaced
    async with stdin:
        while await stdin.receive_some(4096):
            pass
    logger.info("supervisor went away: stopping")
    daemon.request_stop()


async def _run_until_signal(daemon: "Daemon", join_addr: str | None, watch_stdin: bool) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch_signals() -> None:
                async for signum in signals:
                    if daemon.stopping:
                        logger.warning("second %s: stopping now", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return
                    logger.info("%s: stopping cleanly (again to force)", signal.Signals(signum).name)
                    daemon.request_stop()

            nursery.start_soon(watch_signals)
            if watch_stdin:
                nursery.start_soon(_stop_on_stdin_eof, daemon)
            from node.progress import log_training_progress, show_join_progress

            if join_addr is not None:
                nursery.start_soon(show_join_progress, daemon, join_addr)
            else:
                nursery.start_soon(log_training_progress, daemon)
            await daemon.run()
            nursery.cancel_scope.cancel()
