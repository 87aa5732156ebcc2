"""Node processes for ``simulate``, forked from a server that has already imported everything.

Importing libp2p costs ≈1 s of CPU per process; sixteen nodes on a 2-core machine spent
≈8 s just starting. ``multiprocessing``'s forkserver imports the daemon once and forks each
node from it: every node is still its own OS process with its own trio loop, it just starts
warm. Each child's stdin is a pipe whose write end only the simulator holds; the child runs
``swarmtrain node --stop-on-stdin-eof`` and stops cleanly when that pipe closes, whether the
simulator closed it or died.
"""

import ctypes
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
from pathlib import Path

import trio

from node.launch import node_main

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["node.launch", "node.daemon"])


def start_forkserver(log_path: Path) -> None:
    """Start the fork server now, its stderr going to ``log_path``, not the user's terminal.

    If the simulator is interrupted while asking for a child, the fork server prints the
    broken request's traceback: that belongs in a log, not on the screen after Ctrl-C.
    """
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved_stderr = os.dup(2)
    try:
        os.dup2(log_fd, 2)
        multiprocessing.forkserver.ensure_running()
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        os.close(log_fd)


CLONE_NEWNET = 0x40000000


def enter_netns(path: str) -> None:
    """Move this process into the network namespace at ``path`` (what ``ip netns exec`` does)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path}) failed")
    finally:
        os.close(fd)


def _child_main(
    argv: list[str], lifeline: multiprocessing.connection.Connection, log_path: str, netns: str | None
) -> None:
    """Runs in the child: its network namespace, output to the log, the lifeline as stdin, then
    ``swarmtrain node`` with ``argv``."""
    if netns is not None:
        enter_netns(netns)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.dup2(lifeline.fileno(), 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the daemon installs its own handlers
    sys.exit(node_main(argv))


class Child:
    """One node process: start, wait, signal, and close its lifeline."""

    def __init__(self, argv: list[str], log_path: Path, *, netns: str | None = None) -> None:
        """``argv``: the flags of ``swarmtrain node``; ``netns``: run in that network
        namespace (a path under /var/run/netns)."""
        reader, self._lifeline = _CONTEXT.Pipe(duplex=False)
        self._process = _CONTEXT.Process(target=_child_main, args=(argv, reader, str(log_path), netns), daemon=False)
        self._process.start()
        reader.close()

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    async def wait(self) -> int:
        if self._process.exitcode is None:
            await trio.lowlevel.wait_readable(self._process.sentinel)
            self._process.join()
        code = self._process.exitcode
        assert code is not None
        return code

    def close_lifeline(self) -> None:
        """The child sees EOF on stdin and stops cleanly."""
        self._lifeline.close()

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None and self._process.pid is not None:
            os.kill(self._process.pid, signum)
