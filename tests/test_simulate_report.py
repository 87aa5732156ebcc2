"""simulate's report and summary, from nodes' statuses (no processes): what is judged, and
that the summary's numbers are the report's."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from node.errors import ConfigError
from node.simulate import SimulationOptions
from node.simulate.children import Child
from node.simulate.report import Node, build, succeeded, summary_lines


@dataclass
class _Exited:
    """A child process that has exited (what ``_report`` reads of one)."""

    returncode: int

    def poll(self) -> int:
        return self.returncode


def node(name: str, digest: str, *, exit_code: int = 0, curve: list[list[float]] | None = None) -> Node:
    training = None
    if curve is not None:
        training = {"algorithm": "noloco", "rounds": len(curve), "loss_curve": curve, "final_loss": curve[-1][1]}
        training |= {"val_rows": 9, "full_val_rows": 180, "full_val_loss": curve[-1][1] + 1.0}
    status = {"peer_id": f"12D3KooW{name:0>44}", "state_digest": digest, "members": 4, "peers_seen": 3}
    made = Node(name, Path("/nonexistent"), cast(Child, _Exited(exit_code)), status={**status, "training": training})
    made.converged_s = 2.0
    return made


def test_a_killed_node_is_named_and_not_judged_and_a_living_one_that_differs_fails() -> None:
    """The killed node's state froze when it died: the others agree without it. The same
    stale digest on a node meant to live is a run that did not converge."""
    curve = [[10.0, 3.5], [20.0, 2.5], [30.0, 2.0]]
    nodes = [node("boot", "aa"), node("n0", "aa", curve=curve), node("n1", "aa", curve=curve)]
    nodes.append(node("n2", "stale", exit_code=-9, curve=curve[:1]))
    report = build(nodes, 30.0, killed={"n2"})
    assert report["converged"] is True
    assert build(nodes, 30.0, killed=set())["converged"] is False
    for stale in (1, 0):  # a living node, or the bootstrap node, that differs is still judged
        other = list(nodes)
        other[stale] = node(other[stale].name, "other", curve=curve if stale else None)
        assert build(other, 30.0, killed={"n2"})["converged"] is False
    report["killed"] = [{"name": "n2", "peer_id": nodes[3].status["peer_id"], "after_s": 12.5, "rounds": 1}]
    for entry in report["nodes"]:
        entry["killed"] = entry["name"] == "n2"
    head, losses, full = summary_lines(report)
    assert head.startswith("2 nodes converged; n2 (000000n2) killed at round 1, 12.5 s into training, as asked;")
    # The curve's own first and last points, the killed node's aside; the full validation apart.
    curve = "noloco: loss on 9 validation blocks (the curve) 3.500 after the first round -> 2.000 after 3 rounds"
    assert losses == curve
    assert full == "noloco: full validation of the final models (180 blocks): 3.000"


def test_the_exit_status_wants_convergence_the_end_asked_for_and_the_kill_asked_for() -> None:
    nodes = [node("boot", "aa"), node("n0", "aa", curve=[[10.0, 3.0]]), node("n1", "aa", curve=[[10.0, 3.0]])]
    report = {**build(nodes, 30.0, killed=set()), "stop_reason": "trained", "killed": [], "kill_after_s": None}
    assert succeeded(report)
    assert not succeeded({**report, "stop_reason": "n1 exited early"})
    assert not succeeded({**report, "stop_reason": "not trained after 3600 s"})
    assert not succeeded({**report, "converged": False})
    unkilled = {**report, "kill_after_s": 30.0}  # the run ended before the kill was due
    assert not succeeded(unkilled)
    assert "no node was killed: the run ended before --kill-after-s 30" in summary_lines(unkilled)
    for nodes_asked, after_s in ((1, 5.0), (3, -1.0), (3, float("nan"))):  # one node: who would finish?
        with pytest.raises(ConfigError, match="--kill-after-s"):
            SimulationOptions(num_nodes=nodes_asked, kill_after_s=after_s)


def test_the_summary_spans_every_nodes_first_and_last_points() -> None:
    nodes = [node("boot", "aa"), node("n0", "aa", curve=[[10.0, 3.0], [20.0, 1.5]])]
    nodes.append(node("n1", "aa", curve=[[10.0, 3.25], [20.0, 1.25]]))
    report: dict[str, Any] = build(nodes, 30.0, killed=set())
    _, losses, full = summary_lines(report)
    assert "3.000-3.250 after the first round -> 1.250-1.500 after 2 rounds" in losses
    assert full.endswith(": 2.250-2.500")


def test_each_daemon_s_memory_and_idle_cpu_are_in_the_report() -> None:
    """Idle CPU: what the daemon spent per second from when it was seen converged to its
    last answer (issue 42: what each daemon costs)."""
    made = node("n0", "aa")
    made.status["process"] = {"cpu_s": 14.5, "rss_mb": 84.2, "peak_rss_mb": 90.0}
    made.cpu_at_converged = (10.0, 12.0)
    made.status_at_s = 60.0
    entry = build([node("boot", "aa"), made], 61.0, killed=set())["nodes"][0]
    assert entry["rss_mb"] == 84.2 and entry["peak_rss_mb"] == 90.0 and entry["cpu_s"] == 14.5
    assert entry["idle_cpu_share"] == pytest.approx(2.5 / 50.0)
    never = build([node("boot", "aa"), node("n1", "aa")], 61.0, killed=set())["nodes"][0]
    assert never["idle_cpu_share"] is None and never["rss_mb"] is None  # an older daemon says nothing


def test_a_daemon_says_what_its_process_uses() -> None:
    from node.daemon import process_usage

    usage = process_usage()
    assert isinstance(usage["cpu_s"], float) and usage["cpu_s"] > 0
    # Two counts of one memory (/proc's pages now, getrusage's peak): both there, both > 0.
    assert usage["rss_mb"] is not None and usage["rss_mb"] > 0 and (usage["peak_rss_mb"] or 0) > 0


def test_the_simulation_polls_at_most_so_many_statuses_a_second() -> None:
    from node.simulate import MAX_POLLS_PER_S, POLL_INTERVAL_S, poll_interval_s

    assert poll_interval_s(4) == POLL_INTERVAL_S  # small runs: every node twice a second
    for nodes in (16, 33, 65):
        assert nodes / poll_interval_s(nodes) <= MAX_POLLS_PER_S
