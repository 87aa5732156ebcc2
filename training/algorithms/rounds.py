"""The round loop every φ/Δ algorithm shares (local, NoLoCo, DiLoCo): only the outer step differs.

Each round: H inner steps, ``inner_done`` (the daemon answers ``outbox_free`` once no peer
still reads last round's payload), φ and Δ into the outbox (shared memory), ``round_done``; then
the daemon's commands until ``outer_go``: DiLoCo first sends ``accumulate`` once per
peer payload it put in the inbox (each checked like any partner payload, kept or
refused); then the algorithm's outer step, a checkpoint (written in the background:
training/saver.py), ``outer_done``.

Overlapped rounds (``outer.overlap``, at most half a round by default; SPES and a run's last
round wait): the worker does not wait for the daemon's commands at a round's end. It keeps θ
as the round ended and trains on into the next round while the daemon pairs and the payloads
travel, asking before each step whether the daemon's word is there (``ipc.CommandReader``, a
thread); once it is (or after ``overlap_steps`` steps: then it waits), it makes the outer
step of θ as the round ended (the payload's φ and Δ: bit for bit what a barrier would have
stepped on) and lands it under what the steps since added (``Trainer.hold_round_end``). The
steps start from our own outer step alone (our Δ as sent standing in for the mean: the
eager updates of arXiv 2502.12996), so their gradients are stale only by how far the
partner's share moves the step; the local baseline starts from θ as the round ended (its
step keeps it). Measured (docs/training.md): steps taken from θ as the round ended, half a
round each, cost 10% of the final loss; from our own step, 5%; as many as the word took,
none measurable. Streaming DiLoCo (arXiv 2501.18512) overlaps too, mixing the local and the
new weights half and half instead. The round still has H steps; ``outer_done`` says how long
the worker waited (``wait_s``) and how many steps it overlapped (``overlapped``). The
checkpoint written when the step lands holds the overlap's start and AdamW's moments at the
round's end (staged then) besides the step's result, and the count of overlapped steps: a
restart takes as many again and lands the same step on them, bit for bit.
"""

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, BinaryIO

import torch

from training import checkpoint, ipc, validation
from training.pinned import page_locked
from training.saver import BackgroundSaver
from training.trainer import PayloadRejected, Trainer
from training.worker_config import WorkerConfig

logger = logging.getLogger("training.worker")


@dataclass(frozen=True, slots=True)
class Outer:
    """What an outer step made of the round: whether a peer's payload was used, and why
    one was refused (the daemon penalizes its sender)."""

    used_peer: bool
    rejected: str | None = None
    drifted: bool = False
    """``rejected`` only for being too far from ours (a point for its sender, no ban)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More fields for ``outer_done`` (SPES: the expert versions it refused)."""


OuterStep = Callable[[Trainer, dict[str, Any], torch.Tensor, dict[str, list[torch.Tensor]]], Outer]
"""(trainer, the ``outer_go`` command, the inbox as uint8, the Δs accumulated this round)."""


@dataclass(frozen=True, slots=True)
class Opening:
    """What an algorithm adds before the first round (SPES: its experts block, and which
    experts to train): more fields for ``ready``, and a handler for the daemon's one
    ``setup`` command that follows it."""

    ready_fields: dict[str, Any]
    setup: Callable[[dict[str, Any]], None]


def resume(config: WorkerConfig, trainer: Trainer) -> None:
    """Continue from the checkpoint if there is a usable one; a damaged or foreign one is
    moved aside (kept for the user, never deleted) and training starts over."""
    if config.checkpoint_path is None or not Path(config.checkpoint_path).exists():
        start_from_peer(config, trainer)
        return
    path = Path(config.checkpoint_path)
    try:
        tensors, meta = checkpoint.load(path)
        if meta.get("fingerprint") != config.fingerprint():
            raise checkpoint.CheckpointError(f"saved with other settings {meta.get('fingerprint')}")
        trainer.restore(tensors, meta)
    except checkpoint.CheckpointError as exc:
        aside = path.with_name(f"{path.name}.unusable-{int(time.time())}")
        path.rename(aside)
        logger.warning("checkpoint %s is unusable (%s); kept as %s; starting from round 0", path, exc, aside)
        return
    logger.info("resumed from %s at round %d (step %d)", path, trainer.round, trainer.step)


def ask_start_from(config: WorkerConfig, commands: BinaryIO, replies: BinaryIO) -> WorkerConfig | None:
    """The config to resume with: asked of the daemon (``built`` → ``start``) if it says so
    and there is no checkpoint of our own; None if the daemon said ``stop`` instead."""
    own = config.checkpoint_path
    if not config.ask_start_from or (own is not None and Path(own).exists()):
        return config
    ipc.write_blocking(replies, "built")
    command = ipc.read_blocking(commands, ipc.DAEMON_TYPES)
    if command["t"] == "stop":
        return None
    path = command.get("path")
    if command["t"] != "start" or not (path is None or isinstance(path, str)):
        raise ipc.IpcError(f"{command['t']} (path {path!r}) while waiting to start")
    return dataclasses.replace(config, start_from=path)


def start_from_peer(config: WorkerConfig, trainer: Trainer) -> None:
    """A late joiner: a peer's saved state (φ, outer momentum, AdamW's moments, its round,
    not its encoding's state;
    the run's last round if the run is over: then there is nothing left to train). Refused
    (and training starts at round 0) unless it fits this model and is finite; its
    fingerprint is the peer's (another shard), so it is not compared."""
    if config.start_from is None or not Path(config.start_from).exists():
        return
    try:
        tensors, meta = checkpoint.load(Path(config.start_from))
        if not (isinstance(meta.get("round"), int) and 0 < meta["round"] <= config.run.round_limit):
            raise checkpoint.CheckpointError(f"round {meta.get('round')!r} is not one of this run's")
        # Not the peer's encoding state: its error feedback is what the peer has yet to send;
        # nor where its overlapped steps started (written mid-overlap): we start from its φ.
        trainer.restore({k: v for k, v in tensors.items() if not k.startswith(("encoding.", "overlap_start."))}, meta)
        # Nor its next round's length (shortened while it caught up with its own peers).
        trainer.next_round_steps = config.run.inner.steps_per_round
    except checkpoint.CheckpointError as exc:
        logger.warning("a peer's state %s is unusable (%s); starting from round 0", config.start_from, exc)
        return
    logger.info("starting from a peer's state at round %d", trainer.round)


def _saver(config: WorkerConfig, replies: BinaryIO) -> BackgroundSaver | None:
    if config.checkpoint_path is None:
        return None

    def report(round_index: int, error: str | None) -> None:
        ipc.write_blocking(replies, "saved", round=round_index, save_error=error)

    return BackgroundSaver(Path(config.checkpoint_path), report)


def save(
    config: WorkerConfig,
    trainer: Trainer,
    saver: BackgroundSaver | None,
    round_index: int,
    *,
    last: bool,
    held: tuple[int, int] | None = None,
) -> float:
    """The state after an outer step (never a non-finite one: the step refuses those
    first), written in the background (training/saver.py), or skipped while the last
    write is still going; the run's last round's is always written, before its
    ``outer_done``, so the daemon has it when its run is over: the seconds waited for
    that write are returned (0 in every other round).
    ``held``: the step landed under overlapped steps: (the step count at the round's end,
    the steps taken since); the round's end (AdamW's moments, the overlap's start) was
    staged when it ended (``Trainer.round_end_state``), and a restart takes as many steps
    before it lands the step (``Trainer.restore``)."""
    if saver is None:
        return 0.0
    tensors, meta = trainer.state()
    if held is not None:
        tensors = {name: t for name, t in tensors.items() if not name.startswith("adam.")}
        meta = {**meta, "step": held[0], "overlapped": held[1]}
    meta = {**meta, "round_steps": trainer.next_round_steps, "val_rows": validation.curve_rows(config.run)}
    began = time.perf_counter()
    saver.save(round_index, tensors, {**meta, "fingerprint": config.fingerprint()}, must=last)
    if not last:
        return 0.0
    saver.wait()  # the last round's save waited for the write before it too: all of it counts
    return time.perf_counter() - began


def capped_skip(told: object, next_round: int, rounds: int) -> int:
    """The rounds ``outer_go``'s ``skip`` says to leave out after its outer step (our peers
    are further ahead than a pull reaches: node/algorithms/noloco/pairing.py
    ``rounds_to_skip``), so our next round (``next_round``, or the one under way with
    overlapped steps) is that many later; never past the run's last round, which every
    node trains (its state is the run's result). 0 for anything else."""
    if type(told) is not int or told <= 0:
        return 0
    return max(0, min(told, rounds - 1 - next_round))


def _outer_round(
    config: WorkerConfig,
    trainer: Trainer,
    reader: ipc.CommandReader,
    replies: BinaryIO,
    outer: OuterStep,
    in_view: torch.Tensor,
    saver: BackgroundSaver | None,
    round_index: int,
    held: tuple[int, int] | None = None,
) -> bool:
    """The daemon's commands for round ``round_index`` until ``outer_go``, then its outer
    step, checkpoint and ``outer_done`` (with ``wait_s``: how long the worker waited for
    the commands, its time not training; ``outer_s``: the time it took for them, DiLoCo's
    payload checks included). ``held``: the step lands under overlapped steps
    (the step count at the round's end, and how many were taken since). The next round's
    inner steps are ``outer_go``'s ``steps`` (``Trainer.next_round_steps``: fewer than H
    while our peers are ahead of us, node/algorithms/noloco/lag.py ``catch_up_steps``).
    False if the daemon said stop."""
    collected: dict[str, list[torch.Tensor]] = {}
    wait_s = outer_s = 0.0
    while True:
        asked = time.perf_counter()
        command = reader.get()
        began = time.perf_counter()
        wait_s += began - asked
        if command["t"] == "stop":
            return False
        if command.get("round") != round_index:
            raise ipc.IpcError(f"{command['t']} for round {command.get('round')} while at {round_index}")
        if command["t"] != "accumulate":
            break
        try:  # keep this peer's Δ (checked like any partner payload)
            collected[str(command.get("key"))] = trainer.parse_payload(in_view).delta
            refusal, drifted = None, False
        except PayloadRejected as exc:
            refusal, drifted = str(exc)[:200], exc.drifted
        outer_s += time.perf_counter() - began
        ipc.write_blocking(
            replies, "accumulated", round=round_index, ok=refusal is None, reason=refusal, drifted=drifted
        )
    result = outer(trainer, command, in_view, collected)
    told = command.get("steps")
    steps = config.run.inner.steps_per_round
    trainer.next_round_steps = told if type(told) is int and 1 <= told <= steps else steps
    if trainer.round <= round_index:  # the loop's next round is trainer.round: it must move on
        raise RuntimeError(f"the outer step of round {round_index} left the trainer at round {trainer.round}")
    skipped = capped_skip(command.get("skip"), trainer.round, config.run.round_limit)
    trainer.round += skipped
    last = round_index + 1 == config.run.round_limit
    save_wait_s = save(config, trainer, saver, trainer.round - 1, last=last, held=held)
    outer_s += time.perf_counter() - began
    full: dict[str, float] = {}
    if last:  # the run's result (φ after its last outer step) on the whole validation split, once
        evaluated = time.perf_counter()
        full["full_val_loss"] = trainer.phi_val_loss(validation.FULL_MAX_ROWS)
        full["eval_s"] = time.perf_counter() - evaluated
    ipc.write_blocking(
        replies,
        "outer_done",
        save_wait_s=save_wait_s,
        round=round_index,
        used_peer=result.used_peer,
        rejected=result.rejected,
        drifted=result.drifted,
        wait_s=wait_s,
        outer_s=outer_s,
        overlapped=0 if held is None else held[1],
        skipped=skipped,
        **full,
        **result.extra,
    )
    return True


def run_rounds(
    config: WorkerConfig,
    trainer: Trainer,
    commands: BinaryIO,
    replies: BinaryIO,
    outer: OuterStep,
    opening: Callable[[], Opening] | None = None,
    *,
    overlapped: bool = False,
    eager: bool = True,
) -> None:
    """Resume, then rounds until the run's last, with shared-memory out- and inboxes.
    ``opening``: called once resumed, for what the algorithm adds before the first round.
    ``overlapped``: each round after the first takes up to ``outer.overlap`` of its inner
    steps before the last round's outer step (a barrier at every round's end without it, or
    with an overlap of 0); ``eager``: they start from our own outer step alone, not from θ
    as the round ended (which the local baseline's outer step keeps: ``Trainer.hold_round_end``)."""
    overlap_steps = config.run.outer.overlap_steps(config.run.inner.steps_per_round) if overlapped else 0
    asked = ask_start_from(config, commands, replies)
    if asked is None:
        return
    config = asked
    resume(config, trainer)
    nbytes = trainer.payload_nbytes
    outbox = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    inbox = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    saver = _saver(config, replies)
    try:
        with page_locked(outbox, trainer.device), page_locked(inbox, trainer.device):
            _rounds(
                config,
                trainer,
                outbox,
                inbox,
                commands,
                replies,
                outer,
                None if opening is None else opening(),
                saver,
                overlap_steps,
                eager,
            )
    finally:
        if saver is not None:
            saver.close()  # the newest state on disk before the worker exits
        for block in (outbox, inbox):
            block.close()
            block.unlink()


def _rounds(
    config: WorkerConfig,
    trainer: Trainer,
    outbox: shared_memory.SharedMemory,
    inbox: shared_memory.SharedMemory,
    commands: BinaryIO,
    replies: BinaryIO,
    outer: OuterStep,
    opening: Opening | None,
    saver: BackgroundSaver | None,
    overlap_steps: int,
    eager: bool,
) -> None:
    # Tensors over the shared blocks live only in this frame, and are deleted on the way
    # out, so a traceback holding the frame cannot keep the blocks exported (close() fails).
    out_view = torch.frombuffer(outbox.buf, dtype=torch.uint8, count=trainer.payload_nbytes)
    in_view = torch.frombuffer(inbox.buf, dtype=torch.uint8, count=trainer.payload_nbytes)
    reader = ipc.CommandReader(commands)
    try:
        ipc.write_blocking(
            replies,
            "ready",
            payload_nbytes=trainer.payload_nbytes,
            outbox=outbox.name,
            inbox=inbox.name,
            round=trainer.round,
            device=str(trainer.device),
            val_blocks=len(trainer.shard.val),
            **({} if opening is None else opening.ready_fields),
        )
        if opening is not None and trainer.round < config.run.round_limit:
            command = reader.get()
            if command["t"] == "stop":
                return
            if command["t"] != "setup":
                raise ipc.IpcError(f"{command['t']} before the first round (expected setup)")
            opening.setup(command)
        steps = config.run.inner.steps_per_round
        early = overlap_steps if 0 < overlap_steps <= steps else 0
        pending: tuple[int, int] | None = None
        """A round whose outer step is still to come, and the step count at its end."""
        round_index = trainer.round
        while round_index < config.run.round_limit:
            compute_s, loss_sum, taken = 0.0, 0.0, 0
            started = time.perf_counter()
            if trainer.landing:  # resumed from a checkpoint written mid-overlap: as it went
                taken = trainer.landing_steps
                loss_sum = trainer.inner_steps(taken) * taken
                trainer.land()
            elif pending is not None:  # the last round's exchange goes on during these steps
                ended_round, ended_step = pending
                # Until the daemon's word for that round is here (or at most ``early`` steps).
                mean = trainer.inner_steps(early, until=reader.waiting)
                taken = trainer.step - ended_step
                loss_sum = mean * taken
                compute_s += time.perf_counter() - started
                if not _outer_round(
                    config, trainer, reader, replies, outer, in_view, saver, ended_round, (ended_step, taken)
                ):
                    return
                pending, started = None, time.perf_counter()
                round_index = trainer.round  # later if the daemon said to skip rounds
            # H steps, or fewer while we catch up with peers ahead (the overlapped ones count).
            rest = max(0, trainer.next_round_steps - taken)
            train_loss = (loss_sum + trainer.inner_steps(rest) * rest) / max(1, taken + rest)
            # The outbox may still be read by a peer pulling last round's payload: the
            # daemon says when it is ours to overwrite.
            ipc.write_blocking(replies, "inner_done", round=round_index)
            command = reader.get()
            if command["t"] == "stop":
                return
            if command["t"] != "outbox_free" or command.get("round") != round_index:
                raise ipc.IpcError(f"{command['t']} for round {command.get('round')} while waiting for the outbox")
            trainer.steps_this_round = taken + rest
            trainer.export_into(out_view)
            compute_s += time.perf_counter() - started
            evaluated = time.perf_counter()
            val_loss = trainer.val_loss(validation.curve_rows(config.run))
            eval_s = time.perf_counter() - evaluated
            overlap = bool(early) and round_index + 1 < config.run.round_limit
            if overlap:  # before round_done: its memory report counts the two copies this holds
                trainer.hold_round_end(eager=eager)
            ipc.write_blocking(
                replies,
                "round_done",
                round=round_index,
                train_loss=train_loss,
                val_loss=val_loss,
                compute_s=compute_s,
                eval_s=eval_s,
                step=trainer.step,
                tokens=trainer.tokens_per_round(taken + rest),
                memory=trainer.memory(),
                expert_load=trainer.expert_load,
            )
            if overlap:  # the next round's first steps go on meanwhile
                if saver is not None:
                    saver.stage(trainer.round_end_state())
                pending = (round_index, trainer.step)
                round_index += 1
            elif _outer_round(config, trainer, reader, replies, outer, in_view, saver, round_index):
                round_index = trainer.round
            else:
                return
        reader.get()  # the daemon's "stop" (or EOF)
    finally:
        del out_view, in_view
