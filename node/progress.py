"""Human-readable views of a node: ``swarmtrain status`` and the running ``join`` story."""

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import trio

from node.logs import short_peer

if TYPE_CHECKING:
    from node.daemon import Daemon

logger = logging.getLogger("swarmtrain")

POLL_INTERVAL_S = 0.5


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"peer id       {status['peer_id']}",
        f"role          {status['role']}",
        f"reachability  {status['reachability']}",
        f"              {status['network']}",
        "addresses     " + ("\n              ".join(status["addrs"]) or "(none)"),
        f"run           {status['run_id'] or '(none: serving the DHT only)'}",
    ]
    if status["run_id"]:
        lines.append(f"state         {status['members']} members, digest {status['state_digest']}")
    lines.append(f"peers live    {status['peers_seen']} ({status['connections']} connections)")
    for peer in status["peers"]:
        link = peer["connection"] or "via gossip"
        lines.append(f"  {peer['peer_id']}  {peer['role'] or '?':9} {link:10} seen {peer['last_seen_s']:.1f} s ago")
    training = status.get("training")
    if status["run_id"]:
        refusal = status.get("not_training")
        idle = f"no: {refusal}" if refusal else "no"
        lines.append("training      " + ("\n              ".join(training_lines(training)) if training else idle))
    if status.get("metrics_url"):
        lines.append(f"metrics       {status['metrics_url']}")
    lines.append(f"uptime        {status['uptime_s']:.0f} s")
    return "\n".join(lines)


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def megabytes(nbytes: object, *, missing: str = "?") -> str:
    return f"{nbytes / 1e6:,.1f} MB" if isinstance(nbytes, int | float) else missing


def training_lines(training: dict[str, Any]) -> list[str]:
    """A node's training in two lines: where it is and how fast, then its exchanges."""
    device = training.get("device") or "a worker still starting"
    total = training.get("rounds_total")
    budget = f"of {total}" if total else "(until stopped)"
    head = f"{training['algorithm']} on {device}: round {training['rounds']} {budget}"
    if training.get("final_loss") is not None:
        head += f", validation loss {training['final_loss']:.3f}"
    if training.get("full_val_loss") is not None:
        head += f" (full validation {training['full_val_loss']:.3f})"
    if training.get("tokens_per_s"):
        head += f", {training['tokens_per_s']:,.0f} tokens/s"
    if training.get("finished"):
        head += ", finished"
    elif training.get("eta_s") is not None:
        head += f", about {duration(training['eta_s'])} left"
    exchanges = (
        f"a partner in {training.get('rounds_with_partner', 0)} of {trained_here(training)} rounds, "
        f"{megabytes(training.get('bytes_sent'))} sent, {megabytes(training.get('bytes_received'))} received"
    )
    return [head, exchanges, *busy_lines(training)]


def trained_here(training: dict[str, Any]) -> int:
    """Rounds this node trained (its status's loss curve is thinned past 512 points)."""
    counted = training.get("rounds_trained_here")
    return counted if type(counted) is int else len(training.get("loss_curve") or [])


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // total if total else width
    return "[" + "#" * filled + "." * (width - filled) + f"] {100 * done // total if total else 100}%"


def busy_lines(training: dict[str, Any]) -> list[str]:
    """What holds the node up before it trains: a peer's state coming in, a log replaying."""
    lines = []
    download = training.get("download")
    if isinstance(download, list | tuple) and len(download) == 2:
        done, total = download
        lines.append(f"fetching a peer's state {_bar(done, total)} of {megabytes(total)}")
    replay = training.get("replay")
    if isinstance(replay, list | tuple) and len(replay) == 2:
        done, total = replay
        lines.append(f"replaying the log {_bar(done, total)} of {total} rounds")
    return lines


def _round_of(training: dict[str, Any] | None) -> tuple[object, ...]:
    """What changes once a round (or when the worker starts or ends, or a download or a
    replay moves by a tenth): a line is due."""
    if not training:
        return ()
    tenths = tuple(
        (key, 10 * progress[0] // max(progress[1], 1))
        for key in ("download", "replay")
        if isinstance(progress := training.get(key), list | tuple) and len(progress) == 2
    )
    return (training["rounds"], training["device"], training["finished"], tenths)


async def log_training_progress(daemon: "Daemon") -> None:
    """``swarmtrain node``: the training line once a round, in the log (a daemon's console)."""
    await daemon.ready.wait()
    shown: tuple[object, ...] = ()
    while True:
        await trio.sleep(POLL_INTERVAL_S)
        training = daemon.training.status() if daemon.training else None
        if training and _round_of(training) != shown:
            logger.info("training: %s", "; ".join(training_lines(training)))
            shown = _round_of(training)


def _say(text: str) -> None:
    """A line for the person running ``swarmtrain join``. With their reader gone (``| head``
    done, or a Ctrl-C that ended ``| tee`` first), the node goes on without a word instead
    of dying of a BrokenPipeError: our stdout goes to /dev/null (Python's advice)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


async def show_join_progress(daemon: "Daemon", join_addr: str) -> None:
    """Tell the person running ``swarmtrain join`` what happens, one line per change."""
    await daemon.ready.wait()
    status = daemon.status()
    _say(f"joined through {join_addr}")
    _say(format_status(status))
    _say("doing: keeping the run state in sync, and training when the run trains; Ctrl-C to leave")
    seen = {p["peer_id"] for p in status["peers"]}
    digest, members = status["state_digest"], status["members"]
    network = ""
    trained: tuple[object, ...] = ()
    while True:
        await trio.sleep(POLL_INTERVAL_S)
        status = daemon.status()
        now_seen = {p["peer_id"] for p in status["peers"]}
        for peer_id in sorted(now_seen - seen):
            _say(f"+ peer {short_peer(peer_id)} is live ({len(now_seen)} peers)")
        for peer_id in sorted(seen - now_seen):
            _say(f"- peer {short_peer(peer_id)} went silent ({len(now_seen)} peers)")
        if (status["state_digest"], status["members"]) != (digest, members):
            _say(f"state: {status['members']} members, digest {status['state_digest']}")
        nat = status["nat"]
        line = f"reachability {nat['reachability']}, relay slots {len(nat['reservations'])}"
        kinds = {short_peer(p["peer_id"]): p["connection"] for p in status["peers"] if p["connection"]}
        line += ", peers " + (", ".join(f"{p} {kind}" for p, kind in sorted(kinds.items())) or "none connected")
        if line != network:
            _say(line)
        training = status.get("training")
        progress = _round_of(training)
        if training and progress != trained:  # once per round: no repeated lines when not on a TTY
            _say("training: " + "; ".join(training_lines(training)))
        seen, digest, members, network, trained = now_seen, status["state_digest"], status["members"], line, progress
