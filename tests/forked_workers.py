"""Workers forked from a server that has imported torch: the suite's way of starting them.

A worker started as ``python -m training.worker`` spends 2-2.5 s of CPU before its first
step, ~1.1 s importing torch and 1.1-1.4 s importing ``torch._dynamo`` (torch.optim imports
it at the first ``add_param_group`` and ``step``, compiled or not). The suite starts a few
hundred workers on 2 cores. ``multiprocessing``'s fork server imports those once and forks
each worker from it: still its own OS process, running the same ``training.worker.main``
with its commands on stdin, replies on stdout and log on stderr, killed and reaped as
before. The daemons of the CLI tests (their own processes) start theirs as a user's do
(``node.supervisor.start_worker_process``).

The server's environment is the suite's when the first worker started: a test's
``monkeypatch.setenv`` does not reach workers (training/ reads no environment variable).
In the child, before the worker runs: its own resource tracker (a fork server's child
shares its parent's, which would keep the worker's shared memory until the suite ends and
see the daemon's unregistering of an attached block as the worker's).
"""

import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import sys
import threading
from multiprocessing import resource_tracker
from pathlib import Path

import trio

from node import supervisor

_CONTEXT = multiprocessing.get_context("forkserver")
# node.simulate.children sets its own list when imported; this one is set right before the
# server starts (the list a running server was started with is the one it keeps).
PRELOAD = ["torch", "torch._dynamo", "training.worker", "tests.forked_workers"]
_started = False
# multiprocessing reads a child's exit status from its sentinel once: Process.start (in a
# thread: it polls every live child) and poll/wait on the loop must not read it at once (the
# loser gets 255).
_status_lock = threading.Lock()
# A gate that has not filled by then is a test's mistake (a node that never asks for a
# worker: refused the run, or trains nothing), said as such.
GATE_TIMEOUT_S = 120.0


class _Gate:
    def __init__(self, count: int) -> None:
        self.waiting_for = count
        self.open = trio.Event()


_gate: _Gate | None = None


def start_together(count: int) -> None:
    """The next ``count`` workers asked for start once the last of them is asked. The
    trainers of a test then begin together, as they did when each worker took seconds to
    start. Without it the first node trained micro rounds of ~0.1 s alone while the others
    still joined the run, which the tests' assertions (trained together) do not expect."""
    global _gate
    assert _gate is None, "a gate is already waiting for workers"
    _gate = _Gate(count)


def forget_gate() -> None:
    """After each test (tests/conftest.py): a gate not filled holds nothing in the next."""
    global _gate
    _gate = None


def _child(config_json: str, commands: multiprocessing.connection.Connection,
           replies: multiprocessing.connection.Connection, log_path: str | None) -> None:  # fmt: skip
    """Runs in the forked child: fds 0, 1, 2 as a subprocess worker has them, then the worker."""
    tracker = resource_tracker._resource_tracker  # type: ignore[attr-defined]
    if tracker._fd is not None:  # the parent's, passed down by the server
        os.close(tracker._fd)
    tracker._fd = tracker._pid = None  # the first block the worker makes starts its own
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdin.close()  # the /dev/null object the child's bootstrap put there
    os.dup2(commands.fileno(), 0)
    sys.stdout.flush()
    os.dup2(replies.fileno(), 1)
    commands.close()
    replies.close()
    if log_path is not None:
        sys.stderr.flush()
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115  (the worker reads fd 0 itself)
    sys.argv = ["training.worker", config_json]
    from training import worker

    worker.main()


class ForkedWorker:
    """A forked worker as ``supervisor.WorkerProcess``: pipes as trio streams, poll, wait, kill."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdin_fd: int, stdout_fd: int) -> None:
        self._process = process
        self.stdin = trio.lowlevel.FdStream(stdin_fd)
        self.stdout = trio.lowlevel.FdStream(stdout_fd)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def poll(self) -> int | None:
        with _status_lock:
            return self._process.exitcode

    async def wait(self) -> int:
        if self.poll() is None:
            await trio.lowlevel.wait_readable(self._process.sentinel)
        with _status_lock:
            self._process.join()
            code = self._process.exitcode
        assert code is not None
        return code

    def kill(self) -> None:
        if self.poll() is None and self._process.pid is not None:
            os.kill(self._process.pid, signal.SIGKILL)


def _start(process: multiprocessing.process.BaseProcess) -> None:
    global _started
    with _status_lock:
        if not _started:
            _CONTEXT.set_forkserver_preload(PRELOAD)
            _started = True
        process.start()


async def start_forked_worker(config_json: str, log_path: str | Path | None) -> ForkedWorker:
    """``supervisor.start_worker_process``'s worker, forked (the first call starts the server)."""
    global _gate
    gate = _gate
    if gate is not None:
        gate.waiting_for -= 1
        if gate.waiting_for <= 0:
            _gate = None
            gate.open.set()
        with trio.move_on_after(GATE_TIMEOUT_S):
            await gate.open.wait()
        if not gate.open.is_set():
            raise AssertionError(f"start_together: {gate.waiting_for} of its workers were never asked for")
    commands_r, commands_w = os.pipe()
    replies_r, replies_w = os.pipe()
    commands = multiprocessing.connection.Connection(commands_r, writable=False)
    replies = multiprocessing.connection.Connection(replies_w, readable=False)
    path = None if log_path is None else str(log_path)
    process = _CONTEXT.Process(target=_child, args=(config_json, commands, replies, path), daemon=True)
    try:
        # Starting talks to the server (and starts it the first time, ~3 s): not on the loop.
        await trio.to_thread.run_sync(_start, process)
    except BaseException:
        os.close(commands_w)
        os.close(replies_r)
        raise
    finally:
        commands.close()  # the child has its own copies now
        replies.close()
    return ForkedWorker(process, commands_w, replies_r)


def use_forked_workers() -> None:
    """Make every in-process daemon's supervisor fork its workers (tests/conftest.py)."""
    supervisor.START_WORKER = start_forked_worker
