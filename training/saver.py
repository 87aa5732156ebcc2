"""Checkpoints written off the training path: the worker copies its state and trains on
while a thread serializes, hashes and writes it (issue 14).

Measured before (`training/checkpoint.py`'s save on the training path, one thread, this
2-core machine, idle): `tiny` (52 MB of state) 0.4-0.7 s a round, `tiny-moe` (153 MB)
0.5-0.9 s: finite checks 0.09 s, the hash 0.09 s, safetensors' encoding 0.15 s, the write
and its fsync 0.1-0.4 s. On the H100, a 2 GB gpt-125m state took ~6 s a round.

What stays on the training path is the copy: into CPU buffers kept from round to round
(page-locked on CUDA, copied without waiting; the thread waits for the copy's event), so
the next round's inner steps can change the weights at once. On a GPU with the memory to
spare (a quarter of it free beside the copy), the training stream's part is a copy on the device into
buffers kept there (2 GB of gpt-125m state: ~1 ms at the H200's bandwidth), and the copy
out to the page-locked buffers runs on a stream of its own while training goes on: before,
a written round's copy of that state over PCIe (~38 ms on the H200) came before the next
inner step; it queued on the training stream. The device buffers are reused only by the
next write, which starts after the thread has seen the last copy out end. One write at a time: a
round whose save finds the last write still going skips its own (training never waits
for the disk), except the run's last round, which waits and writes. On the H200 (issue
14, gpt-125m, H = 50) a write took 7.6 s and a round 1.7 s: waiting for each write
stalled training 70% of the time; now a round is written when the last write has ended
(bench/gpu_outer.py counts them). A restart resumes at the newest file's round (the
rounds since are trained again, or skipped to catch up with peers). A skipped round is
logged at debug and counted (``skipped``).

Each write ends in ``{t: "saved", round, save_error}`` to the daemon (training/ipc.py),
sent by the thread: the daemon offers the file to joiners only then. The file is written
atomically (training/files.py), so a crash mid-write leaves the last round's file whole,
and the daemon, whose count of rounds may then be one ahead of the file, sees the
restarted worker resume at the file's round and does that round again. ``close`` waits
for the write in flight: a worker that exits (its run done, or told to stop) leaves its
newest state on disk (a worker the daemon has to kill, 10 s after asking it to stop,
loses the write in flight: the file before it stays whole).

The daemon offers the file (a hard link of it) when it reads ``saved``; a daemon that
reads it only after the next round's write has landed offers that newer state under the
older round: a joiner then starts one round later than the offer said (the file's own
round is what it starts from).
"""

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from training import checkpoint

logger = logging.getLogger("training.worker")

Report = Callable[[int, str | None], None]
"""(round, why the write failed or None): called from the writing thread."""


def write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str | None:
    """Write a checkpoint; the reason it failed, or None. A failed write (a full disk, a
    read-only mount) is returned, not raised: training goes on, the old file stays whole
    (the write is atomic), and the next round tries again; a worker that crashed here
    instead would only crash again after its restart."""
    try:
        checkpoint.save(path, tensors, meta)
    except OSError as exc:
        logger.error(
            "could not save the checkpoint %s: %s; training goes on, retried next round", path, exc.strerror or exc
        )
        return f"{exc.strerror or exc} ({path})"
    except ValueError as exc:  # a non-finite state (the outer step refuses those first)
        logger.error("could not save the checkpoint %s: %s", path, exc)
        return str(exc)[:300]
    return None


class BackgroundSaver:
    """One checkpoint write in flight at a time, in a thread of its own."""

    def __init__(self, path: Path, report: Report) -> None:
        self._path = path
        self._report = report
        self._buffers: dict[str, torch.Tensor] = {}
        self._on_device: dict[str, torch.Tensor] = {}
        """Each CUDA tensor's snapshot on its device (where there was room): the copy out to
        ``_buffers`` goes from these on ``_stream``."""
        self._stream: torch.cuda.Stream | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """(tensor, its snapshot, its buffer) for ``_copy_out``: the snapshots taken on the
        training stream in one list op, then copied out on ``_stream``."""
        self._no_room = False
        """A snapshot found no room once: the rest of the run copies over the bus (asking the
        device's free memory for every tensor of every save would cost the training path)."""
        self._on_training_stream: torch.cuda.Stream | None = None
        """Where copies straight to the buffers were queued since the last write began."""
        self._copied_out: torch.cuda.Event | None = None
        """The end of the last copy out (a stage's or a save's): the next write waits for it,
        and no snapshot is taken again before it on the training stream."""
        self._thread: threading.Thread | None = None
        self._staged: dict[str, torch.Tensor] | None = {}
        """Copied for the next save; None: that round's staging was skipped (a write busy)."""
        self.skipped = 0
        """Rounds not written because the last write was still going."""
        self._reported = threading.Event()
        """The write in flight is on disk (its report going out, its thread about to end)."""

    def busy(self) -> bool:
        """A write is under way: its file not on disk yet (one that is, is collected here)."""
        if self._thread is not None and (self._reported.is_set() or not self._thread.is_alive()):
            self.wait()
        return self._thread is not None

    def stage(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` now for the next ``save`` (a round's end, when its outer step
        lands later: training/algorithms/rounds.py); a write still going skips that save
        (the buffers are the writer's until it ends)."""
        if self.busy():
            self._staged = None
            return
        self._staged = {name: self._copy(name, tensor) for name, tensor in tensors.items()}
        self._copy_out()

    def save(
        self, round_index: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, must: bool = False
    ) -> bool:
        """Copy ``tensors`` (the caller may change them as soon as this returns) and write
        them, with what was staged, as the state after ``round_index`` in the background;
        whether it does. While the last write is still going the round is skipped, unless
        ``must`` (the run's last round), which waits for it."""
        staged = self._staged
        self._staged = {}
        if not must and (staged is None or self.busy()):
            self.skipped += 1
            logger.debug("round %d not saved: the last checkpoint write is still going", round_index)
            return False
        if staged is None:  # never: only a round with a next one is staged
            raise RuntimeError(f"round {round_index} must be saved, but its end was not staged")
        self.wait()
        copies = {**staged, **{name: self._copy(name, tensor) for name, tensor in tensors.items()}}
        self._buffers = {name: self._buffers[name] for name in copies}  # a lost expert's go
        self._on_device = {name: t for name, t in self._on_device.items() if name in copies}
        copied: list[torch.cuda.Event] = []
        if self._on_training_stream:  # copies queued there (the stage's too)
            copied.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
            copied[0].record(self._on_training_stream)
            self._on_training_stream = None
        self._copy_out()
        if self._copied_out is not None:  # this save's copy out, or the stage's before it
            copied.append(self._copied_out)
            self._copied_out = None  # the thread waits for it: the next write comes after
        self._reported = threading.Event()
        self._thread = threading.Thread(
            target=self._write, args=(round_index, copies, dict(meta), copied), name="checkpoint", daemon=False
        )
        self._thread.start()
        return True

    def wait(self) -> None:
        """Until the write in flight (if any) is done and reported."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """``wait``, then the device's snapshots are given back."""
        self.wait()
        self._on_device.clear()
        self._pending.clear()

    def _copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` into this name's CPU buffer (made again if its shape or dtype changed:
        SPES's optimizer state comes and goes with the experts it owns). A CUDA tensor goes
        into its snapshot on the device when there is one (the copy out is ``_copy_out``'s),
        else straight into the buffer, queued on the training stream."""
        tensor = tensor.detach()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
            self._buffers[name] = buffer
        if tensor.device.type != "cuda":
            buffer.copy_(tensor)
            return buffer
        snapshot = self._on_device.get(name)
        if (
            snapshot is None
            or snapshot.shape != tensor.shape
            or snapshot.dtype != tensor.dtype
            or (snapshot.device != tensor.device)
        ):
            self._on_device.pop(name, None)
            snapshot = None if self._no_room else _room_for(tensor)
            if snapshot is None and not self._no_room:
                self._no_room = True  # asked once: no device snapshots for this run from here
                logger.info("no room on %s for more checkpoint snapshots: new ones go over the bus", tensor.device)
        if snapshot is None:
            buffer.copy_(tensor, non_blocking=True)
            self._on_training_stream = torch.cuda.current_stream(tensor.device)
            return buffer
        self._on_device[name] = snapshot
        self._pending.append((tensor, snapshot, buffer))
        return buffer

    def _copy_out(self) -> None:
        """The snapshots taken since the last call, copied to their buffers on a stream of
        their own once the training stream has taken them (``_copied_out``: that copy's end)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        device = pending[0][1].device
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        training = torch.cuda.current_stream(device)
        if self._copied_out is not None:  # a stage's copy out may still read the snapshots
            training.wait_event(self._copied_out)
        torch._foreach_copy_([snapshot for _, snapshot, _ in pending], [tensor for tensor, _, _ in pending])
        taken = torch.cuda.Event()  # type: ignore[no-untyped-call]
        taken.record(training)
        self._stream.wait_event(taken)
        with torch.cuda.stream(self._stream):
            for _, snapshot, buffer in pending:
                buffer.copy_(snapshot, non_blocking=True)
                snapshot.record_stream(self._stream)  # freed (an expert lost) only after this copy
            self._copied_out = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied_out.record(self._stream)

    def _write(
        self, round_index: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], copied: list[Any]
    ) -> None:
        for event in copied:
            event.synchronize()
        try:
            error = write(self._path, tensors, meta)
        except Exception as exc:  # a bug of ours: said to the daemon (status), not a silent thread's end
            logger.exception("the checkpoint of round %d could not be written", round_index)
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        # The file is on disk: a save from now on writes (it waits for this report to go
        # out first, so reports stay in order), also one the report itself brings about.
        self._reported.set()
        try:
            self._report(round_index, error)
        except (OSError, ValueError):  # the daemon went away (a closed pipe): the main loop sees it too
            logger.info("could not tell the daemon about the checkpoint of round %d", round_index)


def _room_for(tensor: torch.Tensor) -> torch.Tensor | None:
    """A snapshot buffer like ``tensor`` on its GPU, if a quarter of the device's memory
    stays free beside it: None otherwise, and the copy goes over the bus on the training
    stream as before. Asked after the first round's inner steps (their memory is in torch's
    cache), but possibly before the first outer step (a stage), whose peak (a partner's
    payload, new φ and m: ~4× the model for NoLoCo) the quarter is meant to leave room for.
    The snapshots cost the checkpoint state's size on the device (2 GB for gpt-125m) for
    the run (``close`` gives them back)."""
    free, total = torch.cuda.mem_get_info(tensor.device)
    if free - tensor.numel() * tensor.element_size() < total // 4:
        return None
    return torch.empty_like(tensor)
