"""What a simulation came to: its JSON report, built from the nodes' last statuses, the
summary printed from it, and the verdict the exit status gives.

Report: {"algorithm": str, "settings": {every run setting: training/settings.py},
         "wall_s": float, "converged": bool (the bootstrap node and the nodes not killed),
         "num_nodes": int, "stop_reason": str, "kill_after_s": float | null, "killed":
         [{"name", "peer_id", "after_s", "rounds"}], "bootstrap": {...}, "nodes": [{"peer_id", "peers_seen",
         "state_converged_s", "ready_s", "members", "state_digest", "exit_code", "killed",
         "rss_mb", "peak_rss_mb", "cpu_s" (the daemon process, as it last said), "uptime_s",
         "idle_cpu_share" (its CPU seconds per second from convergence to its last answer),
         and when it trains: "loss_curve" ([step, loss on the run's curve blocks]),
         "final_loss" (its last point), "val_rows" (those blocks), "full_val_loss" (the final
         model on the whole split), "full_val_rows", "full_eval_s", "bytes_sent", "bytes_received"
         (payloads), "wire_bytes_sent", "wire_bytes_received" (every byte on TCP),
         "rounds", "rounds_with_partner", "compute_s", "sync_wait_s", "eval_s"
         (the curve's validation), "outer_s" (outer steps with the partner payload's check and the
         checkpoint's staging), "outer_s_rounds" ([round, outer_s] each), "save_wait_s" (of
         outer_s: the wait for the run's last checkpoint write), "overlapped_steps"
         (inner steps taken before a round's outer step landed: outer.overlap),
         "train_wall_s", "utilization" (compute_s / train_wall_s), "late_join",
         "payloads_refused" (partner payloads refused: out of bounds, non-finite),
         "checkpoint_error" (why the last checkpoint could not be written, or null),
         and for --algorithm zo: "param_hash" (SHA-256 of the final weights),
         "bytes_per_update", "log_entries", "rebuilds", "rewinds" (late entries replayed from a
         copy of the weights, not from genesis), "start_round",
         "checkpoint_round" (a late joiner: the round of the checkpoint it fetched),
         "g_clipped", "g_silenced" (entries the robust g rule clipped or zeroed),
         "authors_excluded" (convicted of equivocation), "recoveries" (weights taken
         from the majority after the weights-hash agreement outvoted this node),
         and always: "connections" {peer_id: "direct" | "relayed"}, "reachability",
         "relay_reservations" [relay peer ids], "first_direct_s" (from the node's start to its
         first direct connection to a peer it had reached by relay; null if none),
         "nat_timeline" {step: s from the node's start: "asked", "verdict", "reserved", "relayed",
         "direct"; protocol/net/nat.py NatStatus.timeline}}],
         "topology": str, "pairs": {"direct", "relayed", "unconnected"} over daemon pairs,
         "direct_pair_fraction": float}
Times are seconds since the simulation started; ``ready_s`` is when the node's control API
first answered (its start-up done), so ``state_converged_s - ready_s`` is network time.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node import algorithms
from node.simulate.children import Child


@dataclass(slots=True)
class Node:
    """A simulated node: its process, and what its control API last said."""

    name: str
    data_dir: Path
    process: Child
    status: dict[str, Any] = field(default_factory=dict)
    ready_s: float | None = None
    """When its control API first answered: process start-up is over."""
    converged_s: float | None = None
    cpu_at_converged: tuple[float, float] | None = None
    """(seconds since the start, its CPU seconds) when it was first seen converged."""
    status_at_s: float | None = None
    """Seconds since the start when ``status`` was last read."""


def links(node: Node) -> dict[str, str]:
    """Its link to each peer, as it said: {peer id: "direct" | "relayed"}."""
    found = node.status.get("links")
    return found if isinstance(found, dict) else {}


def pair_links(daemons: list[Node]) -> dict[str, int]:
    """Over every pair of daemons: linked directly (by either side's view), only by relay, or not at all."""
    counts = {"direct": 0, "relayed": 0, "unconnected": 0}
    for i, a in enumerate(daemons):
        for b in daemons[i + 1 :]:
            a_id, b_id = a.status.get("peer_id", ""), b.status.get("peer_id", "")
            kinds = {links(a).get(b_id), links(b).get(a_id)}
            counts["direct" if "direct" in kinds else "relayed" if "relayed" in kinds else "unconnected"] += 1
    return counts


def when(kill: dict[str, Any]) -> str:
    """When a node was killed: its round (if it trained) and the time since training began."""
    at_round = f" at round {kill['rounds']}," if kill.get("rounds") is not None else ""
    return f"{at_round} {kill['after_s']:.1f} s into training"


def _process_entry(node: Node, wall_s: float) -> dict[str, Any]:
    """The daemon process's resident memory and CPU as it last said; ``idle_cpu_share``:
    the CPU it used per second from when it was seen converged to its last answer (a node
    that trains is not idle then: only for ``--algorithm none``)."""
    usage = node.status.get("process") or {}
    cpu_s, uptime_s = usage.get("cpu_s"), node.status.get("uptime_s")
    idle = None
    if node.cpu_at_converged is not None and isinstance(cpu_s, float | int):
        at_s, cpu_then = node.cpu_at_converged
        last_s = node.status_at_s if node.status_at_s is not None else wall_s
        if last_s - at_s >= 1.0:
            idle = round((cpu_s - cpu_then) / (last_s - at_s), 4)
    return {
        "rss_mb": usage.get("rss_mb"),
        "peak_rss_mb": usage.get("peak_rss_mb"),
        "cpu_s": cpu_s,
        "uptime_s": uptime_s,
        "idle_cpu_share": idle,
    }


def build(nodes: list[Node], wall_s: float, *, killed: set[str]) -> dict[str, Any]:
    """The report of ``nodes`` (the bootstrap node first) as they last said. ``killed``:
    nodes killed as asked and not started again: the run is judged without them (their
    state froze when they died), the bootstrap node and the others with."""

    def entry(node: Node) -> dict[str, Any]:
        s = node.status
        return {
            "name": node.name,
            "peer_id": s.get("peer_id", ""),
            "peers_seen": s.get("peers_seen", 0),
            "state_converged_s": node.converged_s if node.converged_s is not None else -1.0,
            "ready_s": node.ready_s if node.ready_s is not None else -1.0,
            "members": s.get("members", 0),
            "state_digest": s.get("state_digest"),
            "exit_code": node.process.returncode,
            "connections": links(node),
            "reachability": s.get("reachability"),
            "relay_reservations": sorted((s.get("nat") or {}).get("reservations", {})),
            "first_direct_s": (s.get("nat") or {}).get("first_direct_s"),
            "nat_timeline": (s.get("nat") or {}).get("timeline", {}),
            "punch_retries": (s.get("nat") or {}).get("punch_retries", {}),
            **_process_entry(node, wall_s),
            **_training_entry(s.get("training")),
        }

    daemons = [entry(n) for n in nodes[1:]]
    algorithm = next((d["algorithm"] for d in daemons if d.get("algorithm")), "none")
    judged = [n for n in nodes if n.name not in killed]
    digests = {n.status.get("state_digest") for n in judged}
    statuses = [n.status.get("training") or {} for n in nodes[1:]]
    summary = algorithms.algorithm_class(algorithm).summary(statuses) if algorithm in algorithms.MODULES else {}
    return {
        "algorithm": algorithm,
        "wall_s": round(wall_s, 3),
        "num_nodes": len(daemons),
        "converged": all(n.converged_s is not None for n in judged) and len(digests) == 1,
        "bootstrap": entry(nodes[0]) if nodes else {},
        "nodes": daemons,
        **summary,
    }


TRAINING_REPORT_KEYS = (
    *("algorithm", "final_loss", "loss_curve", "bytes_sent", "bytes_received"),
    *("wire_bytes_sent", "wire_bytes_received"),
    *("val_rows", "full_val_rows", "full_val_loss", "full_eval_s"),
    *("rounds", "rounds_with_partner", "compute_s", "sync_wait_s", "eval_s", "outer_s", "overlapped_steps"),
    *("outer_s_rounds", "save_wait_s"),
    *("train_wall_s", "utilization"),
    *("payloads_refused", "checkpoint_error"),
)


def _training_entry(training: dict[str, Any] | None) -> dict[str, Any]:
    if not training:
        return {}
    name = training.get("algorithm")
    own = algorithms.algorithm_class(name).REPORT_KEYS if name in algorithms.MODULES else ()
    return {key: training.get(key) for key in TRAINING_REPORT_KEYS + own}


def succeeded(report: dict[str, Any]) -> bool:
    """The exit status's verdict: the nodes meant to live converged and the run ended as
    asked (trained, or formed the network), with the kill it was asked for."""
    killed_as_asked = report.get("kill_after_s") is None or bool(report.get("killed"))
    return bool(report["converged"]) and report["stop_reason"] in ("converged", "trained") and killed_as_asked


def summary_lines(report: dict[str, Any]) -> list[str]:
    """What a run came to, in its report's own numbers: convergence of the nodes meant to
    live (a node killed as asked is named, not judged), then the loss curves' first and
    last points (the same validation blocks each) and the final models' full validation."""
    killed = report.get("killed") or []
    judged = [n for n in report["nodes"] if not n.get("killed")]
    status = "converged" if report["converged"] else "did NOT converge"
    slowest = max((n["state_converged_s"] for n in judged), default=-1.0)
    kills = "".join(f"; {k['name']} ({k['peer_id'][-8:]}) killed{when(k)}, as asked" for k in killed)
    lines = [
        f"{len(judged)} nodes {status}{kills}; slowest at {slowest:.2f} s, wall {report['wall_s']:.1f} s",
    ]
    if report.get("kill_after_s") is not None and not killed:
        lines.append(f"no node was killed: the run ended before --kill-after-s {report['kill_after_s']:g}")
    trained = [n for n in judged if n.get("loss_curve")]
    if not trained:
        return lines
    firsts = [n["loss_curve"][0][1] for n in trained]
    finals = [n["loss_curve"][-1][1] for n in trained]
    num_rows = shared(trained, "val_rows")
    blocks = "its validation blocks" if num_rows is None else f"{num_rows} validation block{'s' * (num_rows != 1)}"
    lines.append(
        f"{report['algorithm']}: loss on {blocks} (the curve) {_span(firsts)} after the first round -> "
        f"{_span(finals)} after {max(n['rounds'] for n in trained)} rounds"
    )
    fulls = [n["full_val_loss"] for n in trained if isinstance(n.get("full_val_loss"), float)]
    if fulls:
        full_rows = shared(trained, "full_val_rows")
        full_blocks = "its blocks" if full_rows is None else f"{full_rows} blocks"
        lines.append(f"{report['algorithm']}: full validation of the final models ({full_blocks}): {_span(fulls)}")
    return lines


def shared(entries: list[dict[str, Any]], key: str) -> Any:
    """``key``'s value where every node entry has the same one; None where they differ."""
    values = {entry.get(key) for entry in entries}
    return values.pop() if len(values) == 1 else None


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.3f}" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f}-{high:.3f}"
