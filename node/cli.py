"""The ``swarmtrain`` command: node, join, status, stop, top, simulate, export, sample.

Errors the user can fix (a bad flag or config value, a busy data dir, no daemon running)
print one line and exit 2 (usage) or 1 (everything else), never a traceback.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import trio

from node import config as config_module
from node.errors import ConfigError
from node.launch import (
    add_node_flags,
    add_set_flag,
    assignments,
    node_config,
    resume_last_run,
    run_daemon,
    with_exit_codes,
)
from node.simulate import DEFAULT_ROUNDS, NAT_SETTLE_S, SimulationOptions, simulate
from training import settings


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarmtrain")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) if args.data_dir else config_module.default_data_dir()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmtrain", description="Train models with strangers, peer to peer.")
    parser.add_argument("--version", action="version", version=f"swarmtrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    node = sub.add_parser("node", help="run the node daemon")
    add_node_flags(node, with_bootstrap=True)
    join = sub.add_parser("join", help="join a run through a peer: the friendly way in")
    join.add_argument("multiaddr", help="a peer of the run: /ip4/IP/tcp/PORT/p2p/ID (or /ip6/…, /dns4/NAME/…)")
    add_node_flags(join, with_bootstrap=False)
    for name, text in (("status", "show what the running daemon is doing"), ("stop", "stop the running daemon")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--data-dir", type=Path, help="the daemon's data dir")
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="print the raw status as JSON")
    export = sub.add_parser("export", help="write a run's trained model for transformers (safetensors)")
    export.add_argument("--out", type=Path, required=True, help="folder to write the model into")
    export.add_argument(
        "--average",
        action="store_true",
        help="write the mean of the run's live trainers' weights (fetched by the running node), not only ours",
    )
    sample = sub.add_parser("sample", help="print a continuation of a prompt by a run's trained model")
    sample.add_argument("--prompt", default="", help="text to continue (default: a new line)")
    sample.add_argument("--tokens", type=int, default=200, help="bytes to generate (default 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest (default 0.8)")
    sample.add_argument("--top-k", type=int, default=40, help="draw among the k likeliest; 0: all (default 40)")
    sample.add_argument("--seed", type=int, default=0, help="the same seed gives the same text")
    for cmd in (export, sample):
        cmd.add_argument("--data-dir", type=Path, help="the node's data dir")
        cmd.add_argument("--run", metavar="ID", help="which run (default: the one trained last)")
    top = sub.add_parser("top", help="a live table of a node, or of every node of a simulation")
    top.add_argument(
        "data_dirs", nargs="*", type=Path, metavar="DATA_DIR", help="nodes' data dirs, or a folder of them"
    )
    top.add_argument("--once", action="store_true", help="print the table once and exit")
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
        help="noloco (default); diloco or local (baselines); zo (zeroth-order); spes (sparse expert sync, a "
        "mixture of experts); none (network only)",
    )
    sim.add_argument(
        "--rounds", type=int, default=DEFAULT_ROUNDS, help=f"outer rounds to train (default {DEFAULT_ROUNDS})"
    )
    sim.add_argument("--inner-steps", type=int, default=10, help="H, inner steps per round (default 10)")
    sim.add_argument(
        "--model",
        choices=settings.MODEL_PRESETS,
        help="model preset: tiny (default, 3.3 M), micro (0.12 M), gpt-125m; tiny-moe (default for spes), "
        "gpt-125m-moe (8 experts, top-2)",
    )
    sim.add_argument(
        "--compression", choices=settings.COMPRESSIONS, default="none", help="outer payload encoding (default none)"
    )
    add_set_flag(sim)
    sim.add_argument("--plot", type=Path, help="draw every node's loss curve into this PNG")
    sim.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help="where every trainer trains: auto (default: a GPU if there is one), cpu, cuda or cuda:N (they share it)",
    )
    sim.add_argument(
        "--link-mbps",
        type=float,
        default=0.0,
        metavar="MBIT",
        help="cap every node's tensor uploads at MBIT Mbit/s, as a home uplink would (0: none, the default)",
    )
    sim.add_argument("--late-join", action="store_true", help="start the last node a quarter of the way in")
    sim.add_argument(
        "--slow-node",
        type=float,
        default=1.0,
        metavar="F",
        help="the last node trains F times slower, as a slower machine would (default 1: all alike)",
    )
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
    sim.add_argument(
        "--nat-settle-s",
        type=float,
        default=NAT_SETTLE_S,
        metavar="S",
        help=f"with --topology nat: a pair still relayed after an extra hole-punch round, or S s after all "
        f"connected, is final (default {NAT_SETTLE_S:g})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return with_exit_codes(lambda: _command(args))


def _command(args: argparse.Namespace) -> int:
    match args.command:
        case "node":
            config = resume_last_run(node_config(args))
            return run_daemon(config, join_addr=None, watch_stdin=args.stop_on_stdin_eof)
        case "join":
            return run_daemon(node_config(args, bootstrap=[args.multiaddr]), join_addr=args.multiaddr)
        case "status":
            return _status(_data_dir(args), as_json=args.json)
        case "stop":
            return _stop(_data_dir(args))
        case "top":
            from node.top import top

            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a live table ends
                trio.run(lambda: top(args.data_dirs or [config_module.default_data_dir()], once=args.once))
            return 0
        case "export":
            from node.export import export_command

            return export_command(_data_dir(args), args.run, args.out, average=args.average)
        case "sample":
            from node.export import sample_command

            limits = {"--tokens": args.tokens, "--temperature": args.temperature, "--top-k": args.top_k}
            for name, value in limits.items():
                if value < 0:
                    raise ConfigError(f"{name} must be >= 0, got {value}")
            return sample_command(
                _data_dir(args),
                args.run,
                args.prompt,
                max_new_tokens=args.tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                seed=args.seed,
            )
        case "simulate":
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
                nat_settle_s=args.nat_settle_s,
                device=args.device,
                link_mbps=args.link_mbps,
                slow_node=args.slow_node,
            )
            return simulate(options)
    raise AssertionError(args.command)


def _simulated_settings(args: argparse.Namespace) -> settings.RunSettings:
    flags = {
        "algorithm": args.algorithm,
        "rounds": args.rounds,
        "inner.steps_per_round": args.inner_steps,
        "model": args.model or settings.default_model(args.algorithm),
        "compression": args.compression,
    }
    try:
        return settings.RunSettings().with_values({**flags, **assignments(args)})
    except settings.SettingsError as exc:
        raise ConfigError(str(exc)) from exc


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
