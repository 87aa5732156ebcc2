"""The typed messages between the daemon and its worker process, and their framing.

Protocol flow (the worker's stdin and stdout, length-prefixed msgpack maps {t, v, ...}):

    daemon                                             worker
                                 ◀── {t: "built"} (only with ask_start_from and no
                                     checkpoint of its own: the model is built, where from?)
    {t: "start", path}           ──▶ (a peer's saved state to start from, or None)
                                 ◀── {t: "ready", payload_nbytes, outbox, inbox, round}
                                     (names of two shared-memory blocks of that size;
                                     round: where it resumes, 0 without a checkpoint)
                                 ◀── {t: "inner_done", round} (H inner steps done)
    {t: "outbox_free", round}    ──▶ (nobody reads the outbox now: last round's payload,
                                     which a peer behind us may pull, can be overwritten)
                                 ◀── {t: "round_done", round, train_loss, val_loss, compute_s,
                                     eval_s, memory, expert_load} (val_loss: on the run's curve
                                     blocks, training/validation.py; the outbox now holds φ then Δ,
                                     encoded as in training/trainer.py; memory:
                                     Trainer.memory(); expert_load: a MoE's routing shares)
    {t: "outer_go", round, peer, steps, skip} ──▶ (peer: the inbox holds a partner's
                                     payload; steps: the next round's inner steps, fewer
                                     than H while peers are ahead; skip: rounds to leave
                                     out, the next round that much later, NoLoCo)
                                 ◀── {t: "outer_done", round, used_peer, rejected, drifted,
                                     wait_s, outer_s, save_wait_s, overlapped, skipped,
                                     and in the run's last round full_val_loss, eval_s}
                                     (rejected: why the partner's payload was refused, or
                                     None: the daemon penalizes a partner whose payload was,
                                     with a ban unless drifted: not far past the bounds;
                                     wait_s: how long the worker waited for these commands;
                                     outer_s: its outer step, the payload's check and the
                                     checkpoint's staging; save_wait_s: of outer_s, the
                                     run's last round's wait for its checkpoint write (0
                                     before it); full_val_loss: φ now on the whole validation
                                     split, measured after outer_s in eval_s.
                                     With outer.overlap the worker takes the next round's
                                     steps until they come (at most its share of the round):
                                     overlapped says how many; its next inner_done comes
                                     after this outer_done; skipped: the rounds it left
                                     out, never past the run's last)
                                 ◀── {t: "saved", round, save_error} (with a checkpoint
                                     path: the state after ``round`` is on disk, written in
                                     the background, training/saver.py: at any point before
                                     the next round's outer_done; the run's last round's
                                     before its own outer_done. save_error: it could not be
                                     written, e.g. a full disk: training goes on, retried
                                     next round)

    DiLoCo instead collects every live node's payload before its outer step:
    {t: "accumulate", round, key}   ──▶ (the inbox holds the payload of peer ``key``)
                                 ◀── {t: "accumulated", round, ok, reason, drifted}
    {t: "outer_go", round, key}     ──▶ (``key``: ours; Δs are averaged in key order, so
                                        every node sums in the same order, bit for bit)
    SPES (training/algorithms/spes.py) adds a block of expert slots and one command:
                                 ◀── {t: "ready", ..., experts, num_experts, expert_nbytes,
                                     held_rounds} (the experts block's name; the round of
                                     the version of each expert the worker holds, -1: genesis)
    {t: "setup", owned}          ──▶ (before the first round: the experts to train)
    {t: "outer_go", round, peer, owned, swap: [[expert, round], ...]} ──▶ (swap: slots the
                                     daemon filled with a peer's version of that round)
                                 ◀── {t: "outer_done", ..., rejected_experts: [[expert,
                                     round, reason], ...]} (versions refused: their owner
                                     is penalized)
    Zeroth-order runs (algorithm "zo") use no shared memory (payload_nbytes 0):
                                 ◀── {t: "ready", ..., zo_snapshots} (how many copies of
                                     the weights at round ends the worker keeps)
    {t: "zo_apply", rebuild, rewind?, updates: [[seed, g code], ...], more, snapshot?} ──▶
                                        logged updates in this order (rebuild: from the
                                        genesis weights; rewind k: from the copy kept under
                                        key k, and copies of keys above k dropped); a round
                                        may come in parts (more: True until its last),
                                        applied together, once, as one summed group; with
                                        snapshot k on its last part, a copy of the weights
                                        after it is kept under key k (the oldest of more
                                        than zo_snapshots dropped)
    {t: "zo_go", round, seeds}   ──▶ (one update per seed, all at this round's weights)
                                 ◀── {t: "zo_step", round, g_codes, val_loss, compute_s}
    {t: "zo_finish"}             ──▶
                                 ◀── {t: "zo_done", param_hash, val_loss, full_val_loss}
    {t: "zo_save", path, round}  ──▶ (write the weights as a checkpoint file)
                                 ◀── {t: "zo_saved", param_hash, save_error}
    {t: "zo_load", path, param_hash} ──▶ (adopt a fetched checkpoint if it hashes right)
                                 ◀── {t: "zo_loaded", ok, reason?}

    {t: "stop"}                  ──▶ the worker exits 0

No torch here: the daemon imports this module and never imports torch. Tensors move
through shared memory, never through this pipe, and nothing is pickled.
"""

import queue
import threading
from collections.abc import Mapping
from typing import Any, BinaryIO

import msgpack

VERSION = 1
LENGTH_NBYTES = 4
# Control messages are small; a larger frame means a bug or a corrupted pipe.
MAX_FRAME_NBYTES = 1 << 20
WORKER_TYPES = frozenset(
    {
        "built",
        "ready",
        "inner_done",
        "round_done",
        "outer_done",
        "saved",
        "accumulated",
        "error",
        "zo_step",
        "zo_done",
        "zo_saved",
        "zo_loaded",
    }
)
DAEMON_TYPES = frozenset(
    {
        *("start", "outbox_free", "outer_go", "accumulate", "stop", "setup"),
        *("zo_apply", "zo_go", "zo_finish", "zo_save", "zo_load"),
    }
)


class IpcError(Exception):
    """The other side sent something malformed, or the pipe closed."""


def encode(msg_type: str, fields: Mapping[str, Any]) -> bytes:
    body: bytes = msgpack.packb({"t": msg_type, "v": VERSION, **fields}, use_bin_type=True)
    if len(body) > MAX_FRAME_NBYTES:
        raise ValueError(f"control message of {len(body)} bytes is too large")
    return len(body).to_bytes(LENGTH_NBYTES, "big") + body


def decode(body: bytes, allowed: frozenset[str]) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise IpcError(f"undecodable control message: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise IpcError(f"unexpected control message {str(msg)[:100]}")
    if msg.get("v") != VERSION or msg["t"] not in allowed:
        raise IpcError(f"unexpected control message {str(msg)[:100]}")
    return msg


def read_blocking(stream: BinaryIO, allowed: frozenset[str]) -> dict[str, Any]:
    """Read one message from a blocking file (the worker's side)."""
    header = _read_exactly(stream, LENGTH_NBYTES)
    if len(header) < LENGTH_NBYTES:
        raise IpcError("control pipe closed")
    nbytes = int.from_bytes(header, "big")
    if nbytes > MAX_FRAME_NBYTES:
        raise IpcError(f"control frame of {nbytes} bytes")
    body = _read_exactly(stream, nbytes)
    if len(body) < nbytes:
        raise IpcError("control pipe closed mid-message")
    return decode(body, allowed)


def _read_exactly(stream: BinaryIO, nbytes: int) -> bytes:
    """``nbytes`` bytes, fewer only at the end of the stream (an unbuffered one may return
    less than asked for in one read)."""
    data = b""
    while len(data) < nbytes:
        chunk = stream.read(nbytes - len(data))
        if not chunk:
            break
        data += chunk
    return data


class CommandReader:
    """The daemon's commands, read by a thread of the worker's own as they come, so its
    round loop can ask between two inner steps whether one is waiting (overlapped rounds:
    training/algorithms/rounds.py). A malformed message or the pipe's end is raised by
    ``get``, as ``read_blocking`` would, to every later caller too. ``stream`` should be
    unbuffered (the worker's stdin is: training/worker.py): the thread is still reading when
    the worker exits, and a buffered reader's lock held then aborts the interpreter."""

    def __init__(self, stream: BinaryIO) -> None:
        self._queue: queue.SimpleQueue[dict[str, Any] | IpcError] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, args=(stream,), name="commands", daemon=True)
        self._thread.start()

    def _read(self, stream: BinaryIO) -> None:
        while True:
            try:
                message = read_blocking(stream, DAEMON_TYPES)
            except IpcError as exc:
                self._queue.put(exc)
                return
            except (OSError, ValueError) as exc:  # the pipe closed under us
                self._queue.put(IpcError(f"control pipe: {exc}"))
                return
            except BaseException as exc:  # a bug: the round loop must not wait forever for it
                self._queue.put(IpcError(f"the command reader failed: {type(exc).__name__}: {exc}"))
                raise
            self._queue.put(message)

    def waiting(self) -> bool:
        """Whether a command (or the pipe's end) is there to be taken without waiting."""
        return not self._queue.empty()

    def get(self) -> dict[str, Any]:
        """The next command, waiting for it."""
        item = self._queue.get()
        if isinstance(item, IpcError):
            self._queue.put(item)
            raise IpcError(str(item)) from item  # a fresh one each time: no growing traceback
        return item


_writing = threading.Lock()
"""One message at a time on the worker's pipe: its checkpoint thread writes ``saved``."""


def write_blocking(stream: BinaryIO, msg_type: str, **fields: Any) -> None:
    frame = encode(msg_type, fields)
    with _writing:
        stream.write(frame)
        stream.flush()
