"""The ``swarmtrain`` command: node, join, status, stop, simulate.

Errors the user can fix (a bad flag or config value, a busy data dir, no daemon running)
print one line and exit 2 (usage) or 1 (everything else), never a traceback.
"""

import argparse
import json
import logging
import os
import signal
import sys
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


def _add_node_flags(parser: argparse.ArgumentParser, *, with_bootstrap: bool) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (flags override it)")
    parser.add_argument("--data-dir", type=Path, help="identity, lock, control socket, saved state")
    parser.add_argument("--listen", action="append", metavar="MULTIADDR", help="/ip4/IP/tcp/PORT (repeatable)")
    parser.add_argument("--announce", action="append", metavar="MULTIADDR", help="address to tell peers (repeatable)")
    if with_bootstrap:
        parser.add_argument(
            "--bootstrap", action="append", metavar="MULTIADDR", help="/ip4/IP/tcp/PORT/p2p/ID (repeatable)"
        )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--new-run", metavar="NAME", help="start a new run called NAME")
    group.add_argument("--run", metavar="ID", help="join the run with this id")
    parser.add_argument("--role", choices=config_module.ROLES)
    parser.add_argument("--device", choices=config_module.DEVICES)
    parser.add_argument("--log-level", choices=config_module.LOG_LEVELS)
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
    parser.add_argument("--rounds", type=int, help="outer rounds to train")
    parser.add_argument("--inner-steps", type=int, metavar="H", help="inner steps per round")
    parser.add_argument("--model", help="model preset: micro, tiny, gpt-125m")
    parser.add_argument("--compression", choices=settings.COMPRESSIONS, help="outer payload encoding (default none)")
    _add_set_flag(parser)
    parser.add_argument("--data-shard", metavar="I/N", help="train on shard I of N")
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
    "heartbeat_s": "state.heartbeat_interval_s",
    "peer_ttl_s": "state.peer_ttl_s",
    "algorithm": "run.settings.algorithm",
    "rounds": "run.settings.rounds",
    "inner_steps": "run.settings.inner.steps_per_round",
    "model": "run.settings.model",
    "compression": "run.settings.compression",
}


def _add_set_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"any run setting, e.g. outer.beta=0.5 or zo.lr=1e-3 (repeatable; {len(settings.names())} settings: "
        f"{', '.join(settings.names())})",
    )


def _assignments(args: argparse.Namespace) -> dict[str, Any]:
    """The --set flags as dotted run-setting names and typed values."""
    values: dict[str, Any] = {}
    for text in args.set:
        try:
            name, value = settings.parse_assignment(text)
        except settings.SettingsError as exc:
            raise ConfigError(f"--set {exc}") from exc
        values[name] = value
    return values


def _node_config(args: argparse.Namespace, *, bootstrap: list[str] | None = None) -> config_module.NodeConfig:
    overrides: dict[str, Any] = {}
    for flag, field_name in _FLAG_TO_FIELD.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[field_name] = str(value) if isinstance(value, Path) else value
    if bootstrap is not None:
        overrides["network.bootstrap"] = bootstrap
    for name, value in _assignments(args).items():
        overrides[f"run.settings.{name}"] = value
    if getattr(args, "data_shard", None):
        index, _, count = args.data_shard.partition("/")
        if not (index.isdigit() and count.isdigit()):
            raise ConfigError(f"--data-shard: expected I/N like 0/4, got {args.data_shard!r}")
        overrides["training.shard_index"], overrides["training.num_shards"] = int(index), int(count)
    return config_module.load(args.config, overrides)


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) if args.data_dir else config_module.default_data_dir()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmtrain", description="Train models with strangers, peer to peer.")
    sub = parser.add_subparsers(dest="command", required=True)
    node = sub.add_parser("node", help="run the node daemon")
    _add_node_flags(node, with_bootstrap=True)
    join = sub.add_parser("join", help="join a run through a peer: the friendly way in")
    join.add_argument("multiaddr", help="a peer of the run: /ip4/IP/tcp/PORT/p2p/ID")
    _add_node_flags(join, with_bootstrap=False)
    for name, text in (("status", "show what the running daemon is doing"), ("stop", "stop the running daemon")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--data-dir", type=Path, help="the daemon's data dir")
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="print the raw status as JSON")
    sim = sub.add_parser("simulate", help="run a whole network of nodes on this machine")
    sim.add_argument("--nodes", type=int, default=4, help="number of nodes besides the bootstrap (default 4)")
    sim.add_argument("--report", type=Path, help="write the JSON report here")
    sim.add_argument(
        "--timeout-s", type=float, help="give up after this long (default 120 for --algorithm none, else 3600)"
    )
    sim.add_argument("--linger-s", type=float, default=0.0, help="keep running this long after convergence")
    sim.add_argument("--keep-data", action="store_true", help="keep the nodes' data dirs and logs")
    sim.add_argument(
        "--algorithm",
        choices=settings.ALGORITHMS,
        default="noloco",
        help="noloco (default); diloco or local (baselines); zo (zeroth-order); none (network only)",
    )
    sim.add_argument("--rounds", type=int, default=10, help="outer rounds to train (default 10)")
    sim.add_argument("--inner-steps", type=int, default=10, help="H, inner steps per round (default 10)")
    sim.add_argument("--model", default="tiny", help="model preset: tiny (default, 3.3 M), micro (0.12 M), gpt-125m")
    sim.add_argument(
        "--compression", choices=settings.COMPRESSIONS, default="none", help="outer payload encoding (default none)"
    )
    _add_set_flag(sim)
    sim.add_argument("--plot", type=Path, help="draw every node's loss curve into this PNG")
    sim.add_argument("--late-join", action="store_true", help="start the last node a quarter of the way in")
    sim.add_argument("--kill-after-s", type=float, metavar="S", help="SIGKILL the last node S s into training")
    sim.add_argument(
        "--topology",
        choices=("loopback", "nat"),
        default="loopback",
        help="loopback (default), or nat: each node behind its own NAT in network namespaces (needs root)",
    )
    sim.add_argument(
        "--symmetric-nats", type=int, default=0, metavar="K", help="with --topology nat: K NATs randomise ports"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        match args.command:
            case "node":
                return _run_daemon(_node_config(args), join_addr=None, watch_stdin=args.stop_on_stdin_eof)
            case "join":
                return _run_daemon(_node_config(args, bootstrap=[args.multiaddr]), join_addr=args.multiaddr)
            case "status":
                return _status(_data_dir(args), as_json=args.json)
            case "stop":
                return _stop(_data_dir(args))
            case "simulate":
                from node.simulate import SimulationOptions, simulate

                options = SimulationOptions(
                    num_nodes=args.nodes,
                    report_path=args.report,
                    timeout_s=args.timeout_s,
                    linger_s=args.linger_s,
                    keep_data=args.keep_data,
                    settings=_simulated_settings(args),
                    plot_path=args.plot,
                    kill_after_s=args.kill_after_s,
                    late_join=args.late_join,
                    topology=args.topology,
                    symmetric_nats=args.symmetric_nats,
                )
                return simulate(options)
    except ConfigError as exc:
        print(f"swarmtrain: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NodeError as exc:
        print(f"swarmtrain: {exc}", file=sys.stderr)
        return EXIT_ERROR
    raise AssertionError(args.command)


def _simulated_settings(args: argparse.Namespace) -> settings.RunSettings:
    flags = {
        "algorithm": args.algorithm,
        "rounds": args.rounds,
        "inner.steps_per_round": args.inner_steps,
        "model": args.model,
        "compression": args.compression,
    }
    try:
        return settings.RunSettings().with_values({**flags, **_assignments(args)})
    except settings.SettingsError as exc:
        raise ConfigError(str(exc)) from exc


def _run_daemon(config: config_module.NodeConfig, *, join_addr: str | None, watch_stdin: bool = False) -> int:
    from node.daemon import Daemon

    daemon = Daemon(config, run_from_bootstrap=join_addr is not None)
    peer_id = daemon.prepare()
    logs.setup(config.log_level if join_addr is None else "warning", peer_id)
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
            if join_addr is not None:
                from node.progress import show_join_progress

                nursery.start_soon(show_join_progress, daemon, join_addr)
            await daemon.run()
            nursery.cancel_scope.cancel()


def _status(data_dir: Path, *, as_json: bool) -> int:
    from node.api import call
    from node.progress import format_status

    status = trio.run(call, data_dir, "status")
    print(json.dumps(status, indent=2) if as_json else format_status(status))
    return 0


def _stop(data_dir: Path) -> int:
    from node.api import call

    trio.run(call, data_dir, "stop")
    print(f"asked the daemon in {data_dir} to stop")
    return 0


def entry_point() -> None:
    sys.exit(main())
