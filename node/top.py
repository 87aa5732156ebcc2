"""``swarmtrain top``: a live table of one node, or of every node of a simulation.

Each data dir given (default: the node's own) is a running daemon's, or a folder of them
(``simulate --keep-data`` prints one: its nodes' data dirs are its sub-folders). Once a
second every daemon is asked for its status over its control socket; a row per node:

    node  run  round  val loss  tokens/s  left  partner  peers  reach  device  sent  received

"val loss" is the last round's loss on the run's curve blocks (training/validation.py);
"round" is N/budget, or N/∞ in a run until its nodes stop. A node that does not answer
is shown as such (it stopped, or has not started). On a terminal the table redraws in
place until Ctrl-C; ``--once`` (and a pipe) print it once,
PRINT_WIDTH wide (a pipe's 80 columns cut every cell). A running ``simulate`` draws its
own table; ``top`` shows its nodes from another terminal when it keeps their data dirs.
"""

from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.live import Live
from rich.table import Table

from node.api import SOCKET_NAME, call
from node.errors import ApiError
from node.identity import IDENTITY_FILE
from node.logs import short_peer
from node.progress import duration, megabytes, trained_here

REFRESH_S = 1.0
PRINT_WIDTH = 160
COLUMNS = (
    "node",
    "run",
    "round",
    "val loss",
    "tokens/s",
    "left",
    "partner",
    "peers",
    "reach",
    "device",
    "sent",
    "received",
)


def _is_data_dir(path: Path) -> bool:
    return (path / SOCKET_NAME).exists() or (path / IDENTITY_FILE).exists()


def data_dirs(given: list[Path]) -> list[Path]:
    """Each given data dir, or the nodes' data dirs inside a folder of them (running or not)."""
    found = []
    for path in given:
        if _is_data_dir(path) or not path.is_dir():
            found.append(path)
            continue
        nodes = sorted(p for p in path.iterdir() if p.is_dir() and _is_data_dir(p))
        found.extend(nodes or [path])
    return found


def row(name: str, status: dict[str, Any] | None) -> list[str]:
    """One node's cells (``status`` None: it did not answer)."""
    if status is None:
        return [name, "(not answering)", *["-"] * (len(COLUMNS) - 2)]
    training = status.get("training") or {}
    node = short_peer(str(status.get("peer_id", name)))
    run = str(status.get("run_id") or "-")
    peers, reach = str(status.get("peers_seen", 0)), str(status.get("reachability", "?"))
    if not training:
        idle = "not training" if status.get("not_training") else "-"
        return [node, run, idle, "-", "-", "-", "-", peers, reach, "-", "-", "-"]
    loss = training.get("final_loss")
    eta = training.get("eta_s")
    tokens = training.get("tokens_per_s")
    return [
        node,
        run,
        f"{training.get('rounds', 0)}/{training.get('rounds_total') or '∞'}",
        f"{loss:.3f}" if isinstance(loss, float) else "-",
        f"{tokens:,.0f}" if tokens else "-",
        "done" if training.get("finished") else (duration(eta) if eta is not None else "-"),
        f"{training.get('rounds_with_partner', 0)}/{trained_here(training)}",
        peers,
        reach,
        str(training.get("device") or "-"),
        megabytes(training.get("bytes_sent"), missing="-"),
        megabytes(training.get("bytes_received"), missing="-"),
    ]


def table(rows: list[list[str]]) -> Table:
    grid = Table(title="swarmtrain top", title_justify="left")
    for column in COLUMNS:
        grid.add_column(column, justify="right" if column not in ("node", "run", "reach", "device") else "left")
    for cells in rows:
        grid.add_row(*cells)
    return grid


async def _snapshot(dirs: list[Path]) -> list[list[str]]:
    statuses: dict[Path, dict[str, Any] | None] = {}

    async def ask(path: Path) -> None:
        try:
            statuses[path] = await call(path, "status", timeout_s=REFRESH_S * 3)
        except ApiError:
            statuses[path] = None

    async with trio.open_nursery() as nursery:
        for path in dirs:
            nursery.start_soon(ask, path)
    return [row(path.name, statuses[path]) for path in dirs]


async def top(given: list[Path], *, once: bool) -> None:
    dirs = data_dirs(given)
    console = Console()
    if once or not console.is_terminal:
        # Not cut to a pipe's 80 columns: a script reads every cell whole.
        Console(width=max(console.width, PRINT_WIDTH)).print(table(await _snapshot(dirs)))
        return
    with Live(table(await _snapshot(dirs)), console=console, auto_refresh=False) as live:
        while True:
            await trio.sleep(REFRESH_S)
            live.update(table(await _snapshot(dirs)), refresh=True)
