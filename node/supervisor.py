"""Runs the worker process, restarts it when it crashes, and speaks its control protocol.

The worker (training/worker.py) is a child process that trains and never touches the
network. A crash never takes the node off the network: the supervisor logs the worker's
exit, waits (1 s, doubling to 60 s while it keeps crashing) and starts a new one, which
resumes from its checkpoint (saved after an outer step whenever the last write has ended;
training/saver.py) at the round after it.
"""

import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any, Protocol

import trio

from node.device import detect_device
from training import ipc
from training.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 60.0
# A worker that ran this long before crashing was healthy: start the backoff over.
HEALTHY_RUN_S = 60.0
# Set (to 1) by the test suite: a failed session raises there instead of restarting.
STRICT_ENV = "SWARMTRAIN_STRICT"
# A session that fails this many times in a row is a bug that restarting will not cure.
MAX_SESSION_ERRORS_IN_A_ROW = 5


class WorkerProcess(Protocol):
    """What the supervisor needs of a running worker process (``trio.Process`` is one)."""

    @property
    def stdin(self) -> trio.abc.SendStream | None: ...
    @property
    def stdout(self) -> trio.abc.ReceiveStream | None: ...
    def poll(self) -> int | None: ...
    async def wait(self) -> int: ...
    def kill(self) -> None: ...


async def start_worker_process(config_json: str, log_path: str | Path | None) -> WorkerProcess:
    """The worker as a new interpreter, ``python -m training.worker CONFIG``: commands on
    its stdin, replies on its stdout, its log appended to ``log_path`` (else our stderr)."""
    command = [sys.executable, "-m", "training.worker", config_json]
    stderr = open(log_path, "ab") if log_path else None  # noqa: ASYNC230, SIM115
    try:
        return await trio.lowlevel.open_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    finally:
        if stderr is not None:
            stderr.close()


START_WORKER: Callable[[str, str | Path | None], Awaitable[WorkerProcess]] = start_worker_process
"""How the supervisor starts a worker. The test suite forks them instead from a server that
has imported torch (tests/forked_workers.py): the same worker, ~2.5 s of CPU less a start."""


class WorkerGone(Exception):
    """The worker exited or broke its protocol; the supervisor will start another."""


class RestartWorker(WorkerGone):
    """The session wants a fresh worker now (a replica that drifted from its peers takes a
    peer's state): stopped and started again at once, with no crash backoff."""


class WorkerConnection:
    """One running worker: its messages in, commands out, and its shared-memory blocks."""

    def __init__(self, process: WorkerProcess) -> None:
        self.process = process
        self._buffer = b""
        self.outbox: shared_memory.SharedMemory | None = None
        self.inbox: shared_memory.SharedMemory | None = None
        self.payload_nbytes = 0
        self.start_round = 0
        self.ready: dict[str, Any] = {}
        """The worker's ``ready`` message (an algorithm reads its own fields there)."""
        self.on_saved: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        """Takes the worker's ``saved`` messages (its checkpoint thread's: they come between
        any two others), so ``receive`` returns only the round's own; without it, returned."""
        self._early: dict[str, Any] | None = None
        """A message ``saved_meanwhile`` read that is not ``saved``: ``receive``'s next."""
        self._reading = trio.Lock()
        """One reader of the pipe at a time (an exchange may ``receive`` while
        ``saved_meanwhile`` reads: DiLoCo's asks its worker to accumulate)."""
        self._failed: Exception | None = None
        """What ``saved_meanwhile`` met (it never raises: ``receive`` does, next): a broken
        pipe, or an offer that failed (``on_saved``'s error: the exchange beside it, with a
        partner waiting on it, is not cut short for it)."""

    async def receive(self) -> dict[str, Any]:
        async with self._reading:
            if self._failed is not None:
                raise self._failed
            if self._early is not None:
                message, self._early = self._early, None
                return message
            while True:
                message = await self._next()
                if message["t"] != "saved" or self.on_saved is None:
                    return message
                await self._take_saved(message)

    async def saved_meanwhile(self) -> None:
        """Takes ``saved`` messages while the daemon is busy with something else than
        reading (a round's exchange: pairing may wait seconds); stops at the first other
        message, kept for ``receive``. Cancel it when done: the pipe's read loses nothing
        to a cancel (the bytes are taken only once a read returns). Without it the offer of
        a checkpoint whose write ended after the next round's ``round_done`` waited behind
        that round's exchange (a joiner waiting for that offer waited on it in turn)."""
        if self.on_saved is None:
            return
        async with self._reading:
            while self._early is None and self._failed is None:
                try:
                    message = await self._next()
                except WorkerGone as exc:
                    self._failed = exc  # raised where the session reads (a task beside it must not)
                    return
                if message["t"] != "saved":
                    self._early = message  # for ``receive`` (waiting for the lock, or the next)
                    return
                try:
                    await self._take_saved(message)
                except Exception as exc:
                    self._failed = exc
                    return

    async def while_taking_saved(self, body: Callable[[], Awaitable[None]]) -> None:
        """``body()`` (a round's exchange) with ``saved_meanwhile`` beside it; what ``body``
        raises comes out as itself, not in an exception group (the supervisor catches
        ``WorkerGone`` and ``RestartWorker`` by their type)."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.saved_meanwhile)
                await body()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _alone(group) from None

    async def _take_saved(self, message: dict[str, Any]) -> None:
        assert self.on_saved is not None
        with trio.CancelScope(shield=True):  # an offer is made whole or not at all
            await self.on_saved(message)

    async def _next(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while True:
            if len(self._buffer) >= ipc.LENGTH_NBYTES:
                nbytes = int.from_bytes(self._buffer[: ipc.LENGTH_NBYTES], "big")
                if nbytes > ipc.MAX_FRAME_NBYTES:
                    raise WorkerGone(f"worker sent a {nbytes}-byte control frame")
                end = ipc.LENGTH_NBYTES + nbytes
                if len(self._buffer) >= end:
                    body, self._buffer = self._buffer[ipc.LENGTH_NBYTES : end], self._buffer[end:]
                    try:
                        return ipc.decode(body, ipc.WORKER_TYPES)
                    except ipc.IpcError as exc:
                        raise WorkerGone(str(exc)) from exc
            try:
                chunk = await self.process.stdout.receive_some(65536)
            except trio.BrokenResourceError as exc:
                raise WorkerGone("worker's pipe broke") from exc
            if not chunk:
                raise WorkerGone("worker exited")
            self._buffer += chunk

    async def send(self, msg_type: str, **fields: Any) -> None:
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send_all(ipc.encode(msg_type, fields))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise WorkerGone("worker's pipe broke") from exc

    def attach(self, ready: dict[str, Any]) -> None:
        self.ready = ready
        self.payload_nbytes = int(ready["payload_nbytes"])
        self.start_round = max(0, int(ready.get("round", 0)))
        if self.payload_nbytes > 0:  # zeroth-order workers have no payload blocks
            self.outbox, self.inbox = attach_block(str(ready["outbox"])), attach_block(str(ready["inbox"]))

    def detach(self) -> None:
        for block in (self.outbox, self.inbox):
            if block is not None:
                close_block(block)
        self.outbox = self.inbox = None


def _alone(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups of one each; one ``Cancelled``
    where all inside are (a cancel from outside reached both tasks: an ``except
    trio.Cancelled`` above would miss a group); else ``exc``."""
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
            continue
        cancelled, rest = exc.split(trio.Cancelled)
        if cancelled is None or rest is not None:
            break
        exc = cancelled.exceptions[0]
    return exc


_lingering: list[shared_memory.SharedMemory] = []
"""Blocks a transfer still held a view of when we closed them: kept referenced, since a
block's ``__del__`` closes it again, and its BufferError there would go where nobody catches
it (seen once at a test's end, cancelled mid-exchange); closed at a later ``close_block``."""


def close_block(block: shared_memory.SharedMemory) -> None:
    """Unmap ``block`` now, or, if a transfer still holds a view of it (the worker died
    mid-exchange), once that view is gone; the worker unlinks the name."""
    for waiting in list(_lingering):
        try:
            waiting.close()
        except BufferError:
            continue
        _lingering.remove(waiting)
    try:
        block.close()
    except BufferError:
        logger.info("shared block %s still in use; unmapped when the transfer ends", block.name)
        _lingering.append(block)


def attach_block(name: str) -> shared_memory.SharedMemory:
    """Map a shared-memory block the worker created, without taking over its removal."""
    block = shared_memory.SharedMemory(name=name)
    # Python < 3.13 registers attached blocks with our resource tracker, which would unlink
    # them when the daemon exits; the worker created them and removes them.
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    return block


Session = Callable[[WorkerConnection], Awaitable[None]]
"""Drives one worker from "ready" until it finishes (returns) or dies (WorkerGone)."""
StartingPoint = Callable[[], Awaitable[str | None]]
"""A worker built its model and has no checkpoint: the peer state to start from, or None."""


class Supervisor:
    def __init__(self, config: WorkerConfig, session: Session, *, log_path: str | None = None) -> None:
        self.config = config
        """What the next worker starts with (an algorithm may change it before the first)."""
        self._session = session
        self._log_path = log_path
        self.num_starts = 0
        self.session_errors = 0
        """Sessions that ended in an error of ours (a bug), each followed by a restart."""
        self._errors_in_a_row = 0
        self._restart_now = False
        self.finished = trio.Event()
        self.starting_point: StartingPoint | None = None
        """Asked when a worker with ``ask_start_from`` says ``built``."""
        self.before_start: Callable[[], Awaitable[None]] | None = None
        """Awaited before each worker starts, once the one before it has exited."""
        self.device: str | None = None
        """Where the last worker trains, as it said (``cpu``, ``cuda``...)."""
        self.val_blocks: int | None = None
        """The run's validation split in blocks, as the last worker said (its ``ready``)."""

    async def run(self) -> None:
        delay_s = RESTART_DELAY_S
        while True:
            started = trio.current_time()
            self.num_starts += 1
            self._restart_now = False
            if await self._run_once():
                self.finished.set()
                return
            if self._restart_now:
                continue
            if trio.current_time() - started > HEALTHY_RUN_S:
                delay_s = RESTART_DELAY_S
            logger.warning("worker stopped unexpectedly; restarting in %.0f s", delay_s)
            await trio.sleep(delay_s)
            delay_s = min(2 * delay_s, MAX_RESTART_DELAY_S)

    def _note_device(self, device: str) -> None:
        """Say it on the console when the worker does not train where it was asked to (a GPU
        machine with a CPU build of torch): once, not at every restart."""
        # auto expects a GPU where the driver lists one (a GPU the probe missed is no surprise).
        expected = detect_device(self.config.device)
        if device == "cpu" and expected == "cuda" and device != self.device:
            logger.warning(
                "asked to train on %s, but the worker trains on %s (its reason is in the worker log)",
                self.config.device,
                device,
            )
        self.device = device or None

    async def _run_once(self) -> bool:
        """One worker's life; True if it finished its rounds."""
        if self.before_start is not None:
            await self.before_start()
        process = await START_WORKER(self.config.to_json(), self._log_path)
        connection = WorkerConnection(process)
        try:
            ready = await connection.receive()
            if ready["t"] == "built":
                path = await self.starting_point() if self.starting_point is not None else None
                await connection.send("start", path=path)
                ready = await connection.receive()
            if ready["t"] != "ready":
                raise WorkerGone(f"worker began with {ready['t']!r}")
            connection.attach(ready)
            self._note_device(str(ready.get("device") or ""))
            blocks = ready.get("val_blocks")
            self.val_blocks = blocks if type(blocks) is int and blocks > 0 else None
            await self._session(connection)
            self._errors_in_a_row = 0
            await connection.send("stop")
            return True
        except RestartWorker as exc:
            self._errors_in_a_row = 0
            self._restart_now = True
            logger.info("worker restarted: %s", exc)
            return False
        except WorkerGone as exc:
            self._errors_in_a_row = 0
            logger.warning("worker: %s", exc)
            return False
        except MemoryError:
            raise
        except Exception:
            # A bug on our side of the session (seen: a negative pause in pairing killed 3
            # daemons of a soak). The daemon stays up and the session starts again from the
            # worker's checkpoint, as after a worker crash; tests want it loud instead, and
            # one that fails every time ends the daemon after a few tries.
            self.session_errors += 1
            self._errors_in_a_row += 1
            if os.environ.get(STRICT_ENV) == "1" or self._errors_in_a_row >= MAX_SESSION_ERRORS_IN_A_ROW:
                raise
            logger.exception("the training session failed (a bug: please report it with this log); restarting")
            return False
        finally:
            connection.detach()
            with trio.CancelScope(shield=True):
                if process.poll() is None and process.stdin is not None:
                    await process.stdin.aclose()  # EOF: a healthy worker exits on its own
                with trio.move_on_after(10):
                    await process.wait()
                if process.poll() is None:
                    process.kill()
                    await process.wait()
