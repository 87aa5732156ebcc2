"""``swarmtrain simulate``: a bootstrap node and N daemons as separate processes on one machine.

``--topology loopback`` (default) puts every node on 127.0.0.1. ``--topology nat`` builds a
small internet in network namespaces (node/simulate/netbed.py, needs root): the bootstrap node on a
public address, each daemon behind its own NAT, so nodes must find relays, reserve slots
and hole-punch to reach each other; ``--symmetric-nats K`` makes the last K NATs
port-randomising (their hosts cannot hole-punch and stay relayed).

The bootstrap node starts the run; the others get its address and the run id, find each
other through the DHT and the run document, and converge. A live table shows each node's
view; the JSON report (its contract: node/simulate/report.py) records when each node
converged. No process outlives the simulation: children get SIGTERM when it ends,
SIGKILL if they linger, and die with it even if it is killed (PR_SET_PDEATHSIG).
"""

import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from node import algorithms, api
from node.errors import ApiError, ConfigError, NodeError
from node.simulate.children import Child, start_forkserver
from node.simulate.netbed import Netbed, NetbedUnavailable
from node.simulate.report import Node, build, links, pair_links, succeeded, summary_lines, when
from training.settings import RunSettings
from training.worker_config import check_device

MAX_NODES = 64
DEFAULT_ROUNDS = 10
"""A simulation's budget of rounds unless told (a run started by ``node`` has none)."""
POLL_INTERVAL_S = 0.5
# The simulation asks each node for its status every POLL_INTERVAL_S, or less often so that
# it asks at most this many a second in all: each answer costs a daemon CPU, taken from the
# cores the daemons share.
MAX_POLLS_PER_S = 32.0
CONVERGE_TIMEOUT_S = 120.0
TRAIN_TIMEOUT_S = 3600.0
STOP_GRACE_S = 10.0
API_WAIT_S = 60.0
TOPOLOGIES = ("loopback", "nat")
NAT_PORT = 4001
# Behind NATs, a pair still relayed after one of our extra hole-punch rounds ended
# (protocol/net/nat.py's PUNCH_RETRY_S: ~20 s after it was relayed, past DCUtR's own three
# tries and our punches at once), or this long after every pair connected, stays relayed.
NAT_SETTLE_S = 75.0


@dataclass(kw_only=True, slots=True)
class SimulationOptions:
    num_nodes: int = 4
    """Daemons besides the bootstrap node."""
    report_path: Path | None = None
    timeout_s: float | None = None
    """Give up (exit 1) if the network has not converged (and trained) by then; default
    ``CONVERGE_TIMEOUT_S`` for network-only runs, ``TRAIN_TIMEOUT_S`` when training."""
    linger_s: float = 0.0
    """Keep the network running this long after it converged."""
    keep_data: bool = False
    """Keep each node's data dir and log (under /tmp) for inspection."""
    settings: RunSettings = field(default_factory=lambda: RunSettings(rounds=DEFAULT_ROUNDS))
    """What the run trains (algorithm none only forms the network)."""
    plot_path: Path | None = None
    """Draw the loss curves of all nodes into this PNG."""
    late_join: bool = False
    """Start the last node only once the others are a quarter of the way through their rounds."""
    kill_after_s: float | None = None
    """Kill the last node (SIGKILL) this long after training starts: the others must finish."""
    topology: str = "loopback"
    symmetric_nats: int = 0
    """With --topology nat: this many NATs (the last ones) randomise ports."""
    nat_settle_s: float = NAT_SETTLE_S
    """With --topology nat: how long a pair may stay relayed after every pair connected
    before the simulation calls it final (the extra punch rounds come 20 s and 60 s in)."""
    device: str = "auto"
    """Where every trainer's worker trains (all on one GPU with cuda: they share it)."""
    link_mbps: float = 0.0
    """Every node's upload cap (``network.upload_limit_mbps``), as a home link's; 0: none."""
    slow_node: float = 1.0
    """The last trainer's worker takes this many times as long per inner step (a slower
    machine, ``training.slowdown``); 1: every node at the same speed."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= MAX_NODES:
            raise ConfigError(f"--nodes: must be between 1 and {MAX_NODES}, got {self.num_nodes}")
        if self.settings.trains and not self.settings.rounds:
            raise ConfigError("--rounds: a simulation trains a budget of rounds (1 or more), got 0")
        if self.kill_after_s is not None and not (self.kill_after_s >= 0 and self.num_nodes >= 2):
            raise ConfigError(
                f"--kill-after-s: needs 0 s or more and --nodes 2 or more (one dies, the others finish), "
                f"got {self.kill_after_s:g} s and {self.num_nodes} node(s)"
            )
        if self.timeout_s is None:
            self.timeout_s = CONVERGE_TIMEOUT_S if not self.settings.trains else TRAIN_TIMEOUT_S
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout-s: must be > 0, got {self.timeout_s:g}")
        if self.linger_s < 0:
            raise ConfigError(f"--linger-s: must be >= 0, got {self.linger_s:g}")
        if not 1 <= self.slow_node <= 100:  # also refuses NaN
            raise ConfigError(f"--slow-node: must be between 1 and 100, got {self.slow_node:g}")
        if not 0 <= self.link_mbps < 1e9:  # also refuses NaN
            raise ConfigError(f"--link-mbps: must be >= 0 (0: no cap), got {self.link_mbps:g}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"--topology: must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if not 0 <= self.symmetric_nats <= self.num_nodes or (self.symmetric_nats and self.topology != "nat"):
            raise ConfigError(f"--symmetric-nats: must be 0 to --nodes ({self.num_nodes}), with --topology nat")
        if not 0 <= self.nat_settle_s <= 3600 or (self.nat_settle_s != NAT_SETTLE_S and self.topology != "nat"):
            raise ConfigError(f"--nat-settle-s: 0 to 3600 s, with --topology nat; got {self.nat_settle_s:g}")
        try:
            check_device(self.device)
        except ValueError as exc:
            raise ConfigError(f"--device: {exc}") from exc

    def run_flags(self) -> list[str]:
        """What the run trains (the bootstrap node writes it into the manifest)."""
        return [flag for name, value in self.settings.flat().items() for flag in ("--set", f"{name}={value}")]

    def training_flags(self, index: int) -> list[str]:
        """A node's own part: its data shard (the rest comes from the manifest)."""
        if not self.settings.trains:
            return []
        capped = ["--upload-limit-mbps", f"{self.link_mbps:g}"] if self.link_mbps else []
        slow = ["--slowdown", f"{self.slow_node:g}"] if self.slow_node != 1 and index == self.num_nodes - 1 else []
        return ["--data-shard", f"{index}/{self.num_nodes}", "--device", self.device, *capped, *slow]


class _Placement:
    """Where nodes run: all on loopback, or the bootstrap public and each daemon behind a NAT."""

    def __init__(self, bed: Netbed | None) -> None:
        self.bed = bed

    def start(self, name: str, base: Path, flags: list[str], *, index: int | None) -> Node:
        """``index``: the daemon's number (its NAT); None for the bootstrap node."""
        data_dir = base / name
        data_dir.mkdir(mode=0o700)
        listen, netns = "/ip4/127.0.0.1/tcp/0", None
        if self.bed is not None:
            listen = f"/ip4/0.0.0.0/tcp/{NAT_PORT}"
            netns = self.bed.netns_path("pub" if index is None else f"host{index}")
        argv = ["--data-dir", str(data_dir), "--listen", listen, "--stop-on-stdin-eof", *flags]
        return Node(name, data_dir, Child(argv, data_dir / "node.log", netns=netns))

    def bootstrap_addr(self, status: dict[str, Any]) -> str:
        addrs: list[str] = status["addrs"]
        if self.bed is None:
            return addrs[0]
        public = [a for a in addrs if a.startswith(f"/ip4/{self.bed.public_ip}/")]
        if not public:
            raise NodeError(f"the bootstrap node does not listen on {self.bed.public_ip}: {addrs}")
        return public[0]


async def _open_placement(options: SimulationOptions) -> _Placement:
    if options.topology == "loopback":
        return _Placement(None)
    symmetric = frozenset(range(options.num_nodes - options.symmetric_nats, options.num_nodes))
    bed = Netbed(num_nats=options.num_nodes, symmetric=symmetric)
    try:
        with trio.CancelScope(shield=True):  # once built, the caller's finally deletes it
            await trio.to_thread.run_sync(bed.open)
    except NetbedUnavailable as exc:
        raise NodeError(f"--topology nat needs network namespaces: {exc}") from exc
    print(
        f"NAT test bed (namespaces {bed.prefix}*): bootstrap at {bed.public_ip}, "
        f"{options.num_nodes} hosts behind separate NATs",
        flush=True,
    )
    return _Placement(bed)


async def _wait_for_api(node: Node) -> dict[str, Any]:
    with trio.move_on_after(API_WAIT_S):
        while node.process.poll() is None:
            try:
                return await api.call(node.data_dir, "status", timeout_s=2.0)
            except ApiError:
                await trio.sleep(0.1)  # the process is still starting; nothing to wait on but time
    raise NodeError(f"{node.name} did not come up; its log:\n{_tail(node.data_dir / 'node.log')}")


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


async def _poll(node: Node) -> None:
    if node.process.poll() is not None:
        return
    try:
        node.status = await api.call(node.data_dir, "status", timeout_s=2.0)
    except ApiError:
        return


# Without a terminal, the table is printed again only once something in it changed, and at
# most this often.
NO_TTY_EVERY_S = 2.0


def _render(nodes: list[Node], elapsed_s: float, expected_peers: int) -> str:
    rows = [f"swarmtrain simulate: {len(nodes) - 1} nodes + bootstrap, {elapsed_s:5.1f} s"]
    rows.append(
        f"{'node':6} {'peer':10} {'peers':>7} {'members':>7} {'digest':16} {'converged':>9} {'round':>5} "
        f"{'val loss':>8}"
    )
    for node in nodes:
        s = node.status
        peer = s.get("peer_id", "")[-8:] or "…"
        converged = f"{node.converged_s:.1f} s" if node.converged_s is not None else "-"
        if node.process.poll() is not None:
            converged = f"exit {node.process.returncode}"
        training = s.get("training") or {}
        loss = training.get("final_loss")
        rows.append(
            f"{node.name:6} {peer:10} {s.get('peers_seen', 0):>3}/{expected_peers:<3} "
            f"{s.get('members', 0):>7} {s.get('state_digest') or '':16} {converged:>9} "
            f"{training.get('rounds', '-'):>5} {f'{loss:.3f}' if loss is not None else '-':>8}"
        )
    return "\n".join(rows)


async def _stop_all(nodes: list[Node]) -> None:
    """Close each child's lifeline (it stops cleanly), then SIGTERM, then SIGKILL."""
    with trio.CancelScope(shield=True):
        for node in nodes:
            node.process.close_lifeline()
        for escalate in (signal.SIGTERM, signal.SIGKILL):
            with trio.move_on_after(STOP_GRACE_S):
                for node in nodes:
                    await node.process.wait()
            for node in nodes:
                if node.process.poll() is None:
                    node.process.send_signal(escalate)
        for node in nodes:
            await node.process.wait()


def poll_interval_s(num_nodes: int) -> float:
    """Seconds between two status polls of every node: ``POLL_INTERVAL_S``, longer past
    ``MAX_POLLS_PER_S`` (convergence times are as fine as this)."""
    return max(POLL_INTERVAL_S, num_nodes / MAX_POLLS_PER_S)


async def _run(options: SimulationOptions, base: Path) -> dict[str, Any]:
    nodes: list[Node] = []
    start = trio.current_time()
    tty = sys.stdout.isatty()
    placement = await _open_placement(options)
    try:
        start_forkserver(base / "forkserver.log")
        # The bootstrap node starts the run, so its manifest says what everyone trains.
        boot = placement.start(
            "boot", base, ["--new-run", "sim", "--role", "bootstrap", *options.run_flags()], index=None
        )
        nodes.append(boot)
        boot_status = await _wait_for_api(boot)
        run_id, boot_addr = boot_status["run_id"], placement.bootstrap_addr(boot_status)
        print(f"bootstrap {boot_addr}\nrun {run_id}", flush=True)
        late: tuple[str, list[str]] | None = None
        for i in range(options.num_nodes):
            flags = ["--bootstrap", boot_addr, "--run", run_id, *options.training_flags(i)]
            if options.late_join and i == options.num_nodes - 1:
                late = (f"n{i}", flags)  # started once the others are half way through
            else:
                nodes.append(placement.start(f"n{i}", base, flags, index=i))
        expected_peers = options.num_nodes  # every other daemon plus the bootstrap node
        converged_at: float | None = None
        last_print, last_table = -1e9, ""
        assert options.timeout_s is not None
        stop_reason = f"not {'converged' if not options.settings.trains else 'trained'} after {options.timeout_s:g} s"
        killed: dict[str, dict[str, Any]] = {}
        """The nodes killed as asked, and when: judged no more (``_report``)."""
        late_names: set[str] = set()
        links_settled_at: float | None = None
        with trio.move_on_after(options.timeout_s):
            while True:
                async with trio.open_nursery() as nursery:
                    for node in nodes:
                        nursery.start_soon(_poll, node)
                now = trio.current_time()
                for node in nodes:
                    s = node.status
                    if s and node.ready_s is None:
                        node.ready_s = round(now - start, 3)
                    if s:
                        node.status_at_s = now - start
                    if (
                        node.converged_s is None
                        and s.get("members") == options.num_nodes + 1
                        and s.get("peers_seen", 0) >= expected_peers
                    ):
                        node.converged_s = round(now - start, 3)
                        cpu_s = (s.get("process") or {}).get("cpu_s")
                        if isinstance(cpu_s, float | int):
                            node.cpu_at_converged = (now - start, float(cpu_s))
                table = _render(nodes, now - start, expected_peers)
                if tty:
                    print("\x1b[H\x1b[J" + table, flush=True)
                elif now - last_print >= NO_TTY_EVERY_S and table.split("\n", 1)[1] != last_table:
                    # A log or a pipe gets the table when something in it changed (the clock
                    # in its first line aside), at most every few seconds: not dozens of copies.
                    print(table, flush=True)
                    last_print, last_table = now, table.split("\n", 1)[1]
                if late is not None and all(
                    (n.status.get("training") or {}).get("rounds", 0) >= options.settings.rounds // 4 for n in nodes[1:]
                ):
                    print(f"starting {late[0]} late, as asked (the others are a quarter of the way)", flush=True)
                    nodes.append(placement.start(late[0], base, late[1], index=options.num_nodes - 1))
                    late_names.add(late[0])
                    late = None
                victim = nodes[-1]
                if (
                    options.kill_after_s is not None
                    and converged_at is not None
                    and victim.name not in killed
                    and victim.process.poll() is None
                    and now - converged_at >= options.kill_after_s
                ):
                    killed[victim.name] = _kill(victim, now - converged_at)
                exited = [n.name for n in nodes if n.process.poll() is not None and n.name not in killed]
                if exited:
                    stop_reason = f"{', '.join(exited)} exited early"
                    break
                if converged_at is None and late is None and all(n.converged_s is not None for n in nodes):
                    converged_at = now
                if placement.bed is not None and links_settled_at is None and _all_pairs_linked(nodes[1:]):
                    links_settled_at = now
                pairs_now = pair_links(nodes[1:])
                linked = placement.bed is None or (
                    links_settled_at is not None
                    and pairs_now["unconnected"] == 0
                    and (_relayed_pairs_retried(nodes[1:]) or now - links_settled_at >= options.nat_settle_s)
                )
                trained = not options.settings.trains or (
                    late is None
                    and all((n.status.get("training") or {}).get("finished") for n in nodes[1:] if n.name not in killed)
                    and _settled(options, [n for n in nodes[1:] if n.name not in killed])
                )
                if converged_at is not None and trained and linked and now - converged_at >= options.linger_s:
                    stop_reason = "converged" if not options.settings.trains else "trained"
                    break
                await trio.sleep(poll_interval_s(len(nodes)))
    finally:
        await _stop_all(nodes)
        if placement.bed is not None:
            placement.bed.close()
    wall_s = trio.current_time() - start
    print(_render(nodes, wall_s, options.num_nodes), flush=True)
    print(f"stopped: {stop_reason}", flush=True)
    for node in nodes:
        if node.process.returncode not in (0, None) and node.name not in killed:
            print(f"--- {node.name} exited {node.process.returncode}; its log:\n{_tail(node.data_dir / 'node.log')}")
    report = build(nodes, wall_s, killed=set(killed))
    report["settings"] = options.settings.to_dict()  # what the run was asked to train, every setting
    report["killed"] = list(killed.values())
    report["kill_after_s"] = options.kill_after_s
    for entry in report["nodes"]:
        entry["killed"] = entry["name"] in killed
        entry["late_join"] = entry["name"] in late_names
    pairs = pair_links(nodes[1:])
    total = sum(pairs.values())
    return {
        **report,
        "stop_reason": stop_reason,
        "topology": options.topology,
        "pairs": pairs,
        "direct_pair_fraction": round(pairs["direct"] / total, 4) if total else None,
    }


def _relayed_pairs_retried(daemons: list[Node]) -> bool:
    """Whether every pair linked only by relay has had an extra hole-punch round end (either side's)."""
    for i, a in enumerate(daemons):
        for b in daemons[i + 1 :]:
            a_id, b_id = a.status.get("peer_id", ""), b.status.get("peer_id", "")
            if "direct" in {links(a).get(b_id), links(b).get(a_id)}:
                continue
            retried = ((a.status.get("nat") or {}).get("punch_retries") or {}).get(b_id, 0)
            retried += ((b.status.get("nat") or {}).get("punch_retries") or {}).get(a_id, 0)
            if not retried:
                return False
    return True


def _all_pairs_linked(daemons: list[Node]) -> bool:
    return pair_links(daemons)["unconnected"] == 0


def _kill(victim: Node, training_s: float) -> dict[str, Any]:
    """SIGKILL ``victim`` (``--kill-after-s``): what the report and the summary say of it."""
    rounds = (victim.status.get("training") or {}).get("rounds")
    kill = {
        "name": victim.name,
        "peer_id": victim.status.get("peer_id", ""),
        "after_s": round(training_s, 3),
        "rounds": rounds if type(rounds) is int else None,
    }
    print(f"killing {victim.name} (SIGKILL){when(kill)}, as asked", flush=True)
    victim.process.send_signal(signal.SIGKILL)
    return kill


def _settled(options: SimulationOptions, nodes: list[Node]) -> bool:
    """Whether the run's algorithm says the finished nodes are done (ZO: one log, all applied)."""
    statuses = [n.status.get("training") or {} for n in nodes]
    return algorithms.algorithm_class(options.settings.algorithm).settled(statuses)


def _only_interrupts(exc: BaseException) -> bool:
    """Ctrl-C: a KeyboardInterrupt, alone or inside trio's exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(KeyboardInterrupt)[1] is None
    return isinstance(exc, KeyboardInterrupt)


async def _run_until_terminated(options: SimulationOptions, base: Path) -> dict[str, Any] | int:
    """``_run``, stopped cleanly by SIGTERM or Ctrl-C too (nodes stopped, NAT namespaces
    deleted): the report, or the signal that stopped it.

    Ctrl-C arrives through the same receiver, not as a KeyboardInterrupt: Python raises
    that in whatever code runs when the signal comes (inside a ``__del__`` or a finalizer it
    is printed and dropped). A SIGINT ignored by whoever started us (a shell's background
    job) stays ignored, as Python itself leaves it."""
    report: dict[str, Any] | int = signal.SIGTERM
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            nonlocal report
            report = await _run(options, base)
            nursery.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal report
            watched = [signal.SIGTERM]
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                watched.append(signal.SIGINT)
            with trio.open_signal_receiver(*watched) as signals:
                async for signum in signals:
                    report = signum
                    if signum == signal.SIGTERM:
                        print("\nterminated; stopping all nodes", file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch)
        nursery.start_soon(run)
    return report


def check_output_path(flag: str, path: Path) -> None:
    """Where a result will be written: checked before a run of minutes, not after it."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable")


def simulate(options: SimulationOptions) -> int:
    for flag, path in (("--report", options.report_path), ("--plot", options.plot_path)):
        if path is not None:
            check_output_path(flag, path)
    base = Path(tempfile.mkdtemp(prefix="swarmtrain-sim-", dir="/tmp"))  # short: unix socket paths
    print(f"nodes' data dirs in {base} (another terminal: swarmtrain top {base})", flush=True)
    try:
        report = trio.run(_run_until_terminated, options, base)
    except BaseException as exc:
        if not _only_interrupts(exc):  # a Ctrl-C before the receiver was up
            raise
        report = signal.SIGINT
    finally:
        if options.keep_data:
            print(f"node data dirs and logs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    if report == signal.SIGINT:
        print("\ninterrupted; all nodes stopped", file=sys.stderr)
        return 130
    if isinstance(report, int):
        return 128 + report
    text = json.dumps(report, indent=2)
    if options.report_path is not None:
        options.report_path.write_text(text + "\n")
        print(f"report written to {options.report_path}")
    if options.plot_path is not None and options.settings.trains:
        from node.simulate.plot import plot_report

        plot_report(report, options.plot_path)
        print(f"loss curves drawn in {options.plot_path}")
    for line in summary_lines(report):
        print(line)
    if options.topology == "nat":
        pairs = report["pairs"]
        firsts = sorted(n["first_direct_s"] for n in report["nodes"] if n["first_direct_s"] is not None)
        print(
            f"behind NATs: {pairs['direct']} pairs direct, {pairs['relayed']} relayed, "
            f"{pairs['unconnected']} unconnected (direct fraction {report['direct_pair_fraction']}); "
            f"first direct connection {firsts[0] if firsts else '-'} s after a node started"
        )
    return 0 if succeeded(report) else 1
