"""The commands as a user runs them: separate processes, real signals, no orphans."""

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

pytestmark = pytest.mark.e2e

SWARMTRAIN = [sys.executable, "-m", "node"]
TIMEOUT_S = 90.0


def processes_with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> str:
    """Its command line and signal masks (pending, blocked, ignored: a stuck Ctrl-C shows there)."""
    try:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        masks = [
            line
            for line in (Path("/proc") / str(pid) / "status").read_text().splitlines()
            if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        ]
    except OSError:
        return "?"
    return f"{cmdline[:160]} [{' '.join(masks)}]"


async def wait_until_gone(marker: str, *, timeout_s: float = 15.0) -> None:
    """Every process carrying ``marker`` exits within ``timeout_s`` (waiting on pidfds, not a clock).

    Children and the forkserver notice their parent's exit by a pipe closing, so they may
    outlive it by a moment; what must not happen is that they stay.
    """
    with trio.fail_after(timeout_s):
        for pid in processes_with_marker(marker):
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                await trio.lowlevel.wait_readable(pidfd)
            finally:
                os.close(pidfd)
    assert processes_with_marker(marker) == []


class Proc:
    """A child process whose combined output we read line by line, waiting on the pipe, not the clock."""

    def __init__(self, process: trio.Process, marker: str = "") -> None:
        self.process = process
        self.marker = marker
        self.lines: list[str] = []
        self._buffer = b""

    @classmethod
    async def start(cls, args: list[str], env: dict[str, str], *, default_sigint: bool = False) -> "Proc":
        process = await trio.lowlevel.open_process(
            [*SWARMTRAIN, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if default_sigint else None,
        )
        return cls(process, env.get("SWARMTRAIN_TEST_MARKER", ""))

    async def expect(self, text: str, *, at_start: bool = False) -> str:
        """Read until a line containing ``text`` (``at_start``: starting with it); returns that line."""
        assert self.process.stdout is not None
        with trio.fail_after(TIMEOUT_S):
            while True:
                for line in self.lines:
                    if line.startswith(text) if at_start else text in line:
                        return line
                chunk = await self.process.stdout.receive_some(65536)
                if not chunk:
                    raise AssertionError(f"exited before printing {text!r}:\n" + "\n".join(self.lines))
                self._buffer += chunk
                *complete, self._buffer = self._buffer.split(b"\n")
                self.lines.extend(c.decode(errors="replace") for c in complete)

    async def finish(self) -> int:
        """Wait for exit, collecting the rest of the output."""
        assert self.process.stdout is not None
        try:
            with trio.fail_after(TIMEOUT_S):
                while chunk := await self.process.stdout.receive_some(65536):
                    self._buffer += chunk
                self.lines.extend(c.decode(errors="replace") for c in self._buffer.split(b"\n") if c)
                return await self.process.wait()
        except trio.TooSlowError:
            # Who still holds the output pipe open (seen once in a full run, not reproduced).
            alive = {pid: _cmdline(pid) for pid in processes_with_marker(self.marker)} if self.marker else {}
            text = self._buffer.decode(errors="replace")
            partial = text if len(text) <= 6000 else f"{text[:3000]}\n[...]\n{text[-3000:]}"
            raise AssertionError(
                f"no exit within {TIMEOUT_S:g} s (exit code {self.process.poll()}); "
                f"processes left: {alive}\n{self.output}\n{partial}"
            ) from None

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def env() -> dict[str, str]:
    """The environment for children, with a marker that finds every process they start."""
    return {**os.environ, "SWARMTRAIN_TEST_MARKER": uuid.uuid4().hex}


async def simulate(tmp: Path, env: dict[str, str], *args: str) -> tuple[dict[str, Any], str]:
    """Run ``swarmtrain simulate ARGS --report``; it must exit 0 and leave no process behind."""
    report_path = tmp / "report.json"
    sim = await Proc.start(["simulate", *args, "--report", str(report_path)], env)
    assert await sim.finish() == 0, sim.output
    await wait_until_gone(env["SWARMTRAIN_TEST_MARKER"])
    return json.loads(report_path.read_text()), sim.output


async def test_simulate_converges_and_writes_the_report(short_tmp: Path, env: dict[str, str]) -> None:
    report, output = await simulate(short_tmp, env, "--nodes", "4", "--algorithm", "none")
    assert "4 nodes converged" in output
    assert isinstance(report["algorithm"], str)
    assert isinstance(report["wall_s"], float) and report["wall_s"] > 0
    assert len(report["nodes"]) == 4
    assert report["converged"] is True
    for node in report["nodes"]:
        assert node["peer_id"].startswith("12D3KooW")
        assert node["peers_seen"] == 4  # three other nodes and the bootstrap node
        assert isinstance(node["state_converged_s"], float) and 0 < node["state_converged_s"] < report["wall_s"]
        assert node["exit_code"] == 0
    assert len({n["state_digest"] for n in report["nodes"]}) == 1
    assert len({n["peer_id"] for n in report["nodes"]}) == 4


async def test_simulate_trains_with_noloco_and_reports_it(short_tmp: Path, env: dict[str, str]) -> None:
    plot_path = short_tmp / "loss.png"
    args = ("--nodes", "3", "--rounds", "3", "--inner-steps", "5", "--model", "micro", "--plot", str(plot_path))
    report, output = await simulate(short_tmp, env, *args)  # noloco is the default
    assert report["algorithm"] == "noloco" and report["stop_reason"] == "trained"
    for node in report["nodes"]:
        assert node["rounds"] == 3 and len(node["loss_curve"]) == 3
        assert node["final_loss"] == node["loss_curve"][-1][1] < node["loss_curve"][0][1]  # it learned
        # Every point on the same 3 blocks (0.03 of a round's 3 · 5 · 8 forwards: 3.6), the
        # final model on 256 (micro's split is 358 blocks: FULL_MAX_ROWS of them) besides.
        assert node["val_rows"] == 3 and node["full_val_rows"] == 256 and math.isfinite(node["full_val_loss"])
        assert node["compute_s"] > 0 and node["sync_wait_s"] >= 0
    assert "noloco: loss on 3 validation blocks (the curve)" in output
    assert "full validation of the final models (256 blocks)" in output
    # With 3 nodes one may be left out of a round; pairs still form and move bytes both ways.
    assert sum(n["rounds_with_partner"] for n in report["nodes"]) >= 2
    assert sum(n["bytes_sent"] for n in report["nodes"]) == sum(n["bytes_received"] for n in report["nodes"]) > 0
    assert plot_path.read_bytes().startswith(b"\x89PNG")


async def test_simulate_diloco_averages_with_everyone(short_tmp: Path, env: dict[str, str]) -> None:
    report, _ = await simulate(
        short_tmp,
        env,
        "--nodes",
        "3",
        "--algorithm",
        "diloco",
        "--rounds",
        "3",
        "--inner-steps",
        "5",
        "--model",
        "micro",
    )
    assert report["algorithm"] == "diloco"
    for node in report["nodes"]:
        assert node["rounds"] == node["rounds_with_partner"] == 3
        assert node["final_loss"] < node["loss_curve"][0][1]
    sent = [n["bytes_sent"] for n in report["nodes"]]
    assert len(set(sent)) == 1 and sent[0] > 0  # each node sent its payload to both others every round


async def test_two_nodes_pair_every_round_with_int8_payloads(short_tmp: Path, env: dict[str, str]) -> None:
    args = ("--nodes", "2", "--rounds", "3", "--inner-steps", "5", "--model", "micro", "--compression", "int8")
    report, output = await simulate(short_tmp, env, *args)
    seen = [
        {k: n.get(k) for k in ("rounds", "rounds_with_partner", "payloads_refused", "start_round")}
        for n in report["nodes"]
    ]
    for node in report["nodes"]:
        # Every payload was accepted (a refused one means a round alone), and learning went on.
        assert node["rounds"] == node["rounds_with_partner"] == 3, f"{seen}\n{output[-3000:]}"
        assert node["final_loss"] < node["loss_curve"][0][1]
    # micro: 2 × 120,576 values as int8 plus a scale per 256 → ≈ 0.25 MB per payload, not ≈ 0.96 MB.
    assert all(0 < n["bytes_sent"] < 3 * 300_000 for n in report["nodes"])


@pytest.mark.parametrize("compression", ["none", "sparseloco"])
async def test_a_node_killed_mid_run_does_not_stop_the_others(
    short_tmp: Path, env: dict[str, str], compression: str
) -> None:
    args = ("--nodes", "3", "--rounds", "4", "--inner-steps", "5", "--model", "micro", "--kill-after-s", "1")
    report, output = await simulate(short_tmp, env, *args, "--compression", compression)
    victim, *survivors = report["nodes"][::-1]
    assert victim["killed"] is True and victim["exit_code"] == -9
    assert all(n["rounds"] == 4 and not n["killed"] and n["exit_code"] == 0 for n in survivors)
    (kill,) = report["killed"]
    assert kill["name"] == victim["name"] == "n2" and kill["peer_id"] == victim["peer_id"] and kill["after_s"] >= 1
    at_round = "" if kill["rounds"] is None else f" at round {kill['rounds']},"  # None: before its worker was up
    assert f"2 nodes converged; n2 ({victim['peer_id'][-8:]}) killed{at_round} {kill['after_s']:.1f} s into" in output


async def test_interrupted_simulation_leaves_no_process(env: dict[str, str]) -> None:
    # As from a terminal: a suite started as a shell's background job ignores SIGINT, and a
    # child inherits that (it failed that way, twice, when run with `check &`).
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    sim = await Proc.start(
        ["simulate", "--nodes", "3", "--algorithm", "none", "--linger-s", "600"], env, default_sigint=True
    )
    await sim.expect("run sim-")  # the bootstrap is up and the nodes are starting
    sim.process.send_signal(signal.SIGINT)
    assert await sim.finish() == 130, sim.output
    assert "Traceback" not in sim.output
    await wait_until_gone(env["SWARMTRAIN_TEST_MARKER"])


async def test_killed_simulation_leaves_no_process(env: dict[str, str]) -> None:
    # SIGKILL: no handler runs. The nodes must notice by themselves (their lifeline closes).
    sim = await Proc.start(["simulate", "--nodes", "2", "--algorithm", "none", "--linger-s", "600"], env)
    # The table lists every node: all of them were started. (A row, not any line: the first
    # names a random data dir, and one ending in "n1" matched before anything started.)
    await sim.expect("n1 ", at_start=True)
    assert len(processes_with_marker(env["SWARMTRAIN_TEST_MARKER"])) >= 4  # simulate, forkserver, 3 nodes
    sim.process.kill()
    assert await sim.finish() == -signal.SIGKILL
    await wait_until_gone(env["SWARMTRAIN_TEST_MARKER"])


async def test_node_status_join_stop_and_restart(short_tmp: Path, env: dict[str, str]) -> None:
    node_dir, join_dir = short_tmp / "node", short_tmp / "join"
    flags = ["--listen", "/ip4/127.0.0.1/tcp/0"]
    # A run that trains nothing: this is about the network, the status and clean stops
    # (tests/test_walkthrough.py trains).
    node = await Proc.start(
        ["node", "--data-dir", str(node_dir), *flags, "--new-run", "e2e", "--algorithm", "none"], env
    )
    await node.expect("ready in run e2e-")

    status_run = await trio.run_process(
        [*SWARMTRAIN, "status", "--json", "--data-dir", str(node_dir)], capture_stdout=True
    )
    status = json.loads(status_run.stdout)
    assert status["run_id"].startswith("e2e-") and status["members"] == 1
    peer_id, addr = status["peer_id"], status["addrs"][0]
    assert (node_dir / "identity.key").stat().st_mode & 0o777 == 0o600

    join = await Proc.start(["join", addr, "--data-dir", str(join_dir), *flags], env)
    await join.expect(f"run           {status['run_id']}")
    await join.expect("reachability public, relay slots 0, peers ")  # the node dialed us back on loopback
    await join.expect("state: 2 members")
    join.process.send_signal(signal.SIGINT)
    assert await join.finish() == 0, join.output
    assert "Traceback" not in join.output

    human = await trio.run_process([*SWARMTRAIN, "status", "--data-dir", str(node_dir)], capture_stdout=True)
    assert b"2 members" in human.stdout
    await trio.run_process([*SWARMTRAIN, "stop", "--data-dir", str(node_dir)], capture_stdout=True)
    assert await node.finish() == 0, node.output
    assert "Traceback" not in node.output

    # Started again with no run named, it goes back to the one it was in.
    again = await Proc.start(["node", "--data-dir", str(node_dir), *flags], env)
    await again.expect(f"resuming run {status['run_id']}, the one this node was in last")
    line = await again.expect("peer id ")
    assert peer_id in line
    await again.expect("loaded saved state of run")
    again.process.send_signal(signal.SIGTERM)
    assert await again.finish() == 0, again.output
    await wait_until_gone(env["SWARMTRAIN_TEST_MARKER"])


async def test_second_daemon_on_the_same_data_dir_is_refused(short_tmp: Path, env: dict[str, str]) -> None:
    flags = ["--data-dir", str(short_tmp / "d"), "--listen", "/ip4/127.0.0.1/tcp/0"]
    first = await Proc.start(["node", *flags], env)
    await first.expect("ready")
    second = await Proc.start(["node", *flags], env)
    assert await second.finish() == 1
    assert "another daemon" in second.output and "Traceback" not in second.output
    first.process.send_signal(signal.SIGINT)
    assert await first.finish() == 0


async def test_join_with_nobody_there_fails_clearly(short_tmp: Path, env: dict[str, str]) -> None:
    ghost = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWRQR6dEJXaYFpJcVNJ2gCWNScK5th5Cp4oFTyJnM2bvKx"
    join = await Proc.start(
        ["join", ghost, "--data-dir", str(short_tmp / "j"), "--listen", "/ip4/127.0.0.1/tcp/0"], env
    )
    assert await join.finish() == 1
    assert "could not learn the run" in join.output and "Traceback" not in join.output
    assert "cannot reach" in join.output and "is it running" in join.output  # what to check


async def test_zo_nodes_and_a_late_joiner_end_bit_identical(short_tmp: Path, env: dict[str, str]) -> None:
    # 30 steps a round: rounds long enough that the joiner, started at round 4, comes in
    # before the end (with zo.signs = 2 a run of 10-step rounds ended before it was up). At
    # that many updates micro's default step (lr·d = 362) is noisy: `python
    # bench/zo_step_size.py --model micro --lrs 3e-3,1e-3 --nodes 3 --rounds 16 --steps 30`
    # gave validation loss ratios 0.945 (jumps to 6.1 on the way) and 0.622 (falling).
    args = ("--nodes", "3", "--algorithm", "zo", "--model", "micro", "--rounds", "16", "--inner-steps", "30")
    args = (*args, "--set", "zo.lr=1e-3")
    report, _ = await simulate(short_tmp, env, *args, "--late-join")
    assert report["algorithm"] == "zo" and report["stop_reason"] == "trained"
    nodes = report["nodes"]
    late = [n for n in nodes if n["late_join"]]
    # It fetched a peer's checkpoint, replayed the log after it, then joined in.
    assert len(late) == 1 and late[0]["start_round"] > 0 and late[0]["checkpoint_round"] > 0
    assert len({n["param_hash"] for n in nodes}) == 1 and len(nodes[0]["param_hash"]) == 64
    for node in nodes:
        if not node["late_join"]:
            assert node["loss_curve"][-1][1] < node["loss_curve"][0][1]  # ZO training lowers the loss
        # One signed batch of 30 one-byte updates per round: ≈ 7 bytes each on the wire.
        assert node["bytes_per_update"] < 20
    assert nodes[0]["loss_curve"][-1][1] < 5.0  # from ≈ 5.1 at the first round
