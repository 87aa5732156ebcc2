"""Zeroth-order training, worker side: the weights are the genesis weights plus the log.

The daemon (node/algorithms/zo/__init__.py) says which logged updates to apply, one message per
round of the log in the canonical order, and asks for our own updates of a round (one g
byte per seed, by SPSA at the round's weights: training/zo.py has the arithmetic). It
also asks for checkpoints peers can fetch (``zo_save``) and hands over fetched ones
(``zo_load``, checked against the announced weights hash before anything changes).
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import torch

from training import checkpoint, ipc, validation, zo
from training.settings import ZoConfig
from training.trainer import Trainer
from training.worker_config import WorkerConfig

logger = logging.getLogger("training.worker")

MAX_UPDATES_PER_MESSAGE = 20_000
# Copies of the weights at the ends of the latest rounds applied: an entry that arrives a
# round or two late (the usual kind) replays from the copy before its round, not the whole
# log from genesis. Seen in a 16-node soak: every node replayed ~900 entries from genesis
# each round, which kept two cores saturated. Bounded by bytes for large models.
ZO_SNAPSHOTS = 4
ZO_SNAPSHOT_BUDGET_NBYTES = 2 << 30
# A round's parts together (zo_apply with more = True until the last): members × steps.
MAX_UPDATES_PER_ROUND = 1_000_000
# Whole rounds wait to be applied together until this many updates are pending (or the
# weights are read): one pass over the weights for many rounds of a replay, with the bits
# of one pass a round (kernels/zo_apply.py's groups).
REPLAY_BATCH_UPDATES = 4096


class Pending:
    """Round groups received and not applied yet; ``flush`` before anything reads the weights."""

    def __init__(self, params: Sequence[torch.Tensor], config: ZoConfig) -> None:
        self._params, self._config = params, config
        self._groups: list[list[tuple[int, int]]] = []
        self._count = 0

    def add(self, group: list[tuple[int, int]]) -> None:
        if group:  # a round whose updates all count zero changes nothing
            self._groups.append(group)
            self._count += len(group)
        if self._count >= REPLAY_BATCH_UPDATES:
            self.flush()

    def flush(self) -> None:
        if self._groups:
            zo.apply_updates(self._params, self._groups, self._config)
        self.drop()

    def drop(self) -> None:
        """For a rewind or a rebuild: the weights are about to be replaced."""
        self._groups, self._count = [], 0


def _updates(command: dict[str, Any]) -> list[tuple[int, int]]:
    raw = command.get("updates")
    if not isinstance(raw, list) or len(raw) > MAX_UPDATES_PER_MESSAGE:
        raise ipc.IpcError("zo_apply without a list of updates")
    updates: list[tuple[int, int]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)):
            raise ipc.IpcError("an update is [seed, g code]")
        seed, code = item
        if not (0 <= seed < 1 << 64 and 0 <= code <= 0xFF):
            raise ipc.IpcError("update out of range")
        updates.append((seed, code))
    return updates


class Snapshots:
    """Copies of the weights kept under the daemon's keys (the number of round groups
    applied since genesis), the oldest dropped beyond ``capacity``; the daemon mirrors the
    same rule (node/algorithms/zo/rounds.py), so it only rewinds to a key kept here."""

    def __init__(self, params: Sequence[torch.Tensor], capacity: int) -> None:
        self._params = params
        self.capacity = capacity
        self._kept: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def capacity_for(params: Sequence[torch.Tensor]) -> int:
        nbytes = sum(p.numel() * p.element_size() for p in params)
        return max(0, min(ZO_SNAPSHOTS, ZO_SNAPSHOT_BUDGET_NBYTES // max(1, nbytes)))

    def keep(self, key: int) -> None:
        if self.capacity == 0:
            return
        spare = self._kept.pop(next(iter(self._kept))) if len(self._kept) >= self.capacity else None
        if spare is None:
            spare = [p.detach().clone() for p in self._params]
        else:
            zo.copy_into(spare, self._params)
        self._kept[key] = spare

    def rewind(self, key: int) -> None:
        """Back to the copy under ``key``; copies of later keys go (they describe weights
        the daemon is about to replace)."""
        kept = self._kept.get(key)
        if kept is None:
            raise ipc.IpcError(f"zo_apply rewinds to {key}, a copy this worker does not keep")
        zo.copy_into(self._params, kept)
        for later in [k for k in self._kept if k > key]:
            del self._kept[later]

    def clear(self) -> None:
        self._kept.clear()


def _key(command: dict[str, Any], field: str) -> int | None:
    value = command.get(field)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < 1 << 40:
        raise ipc.IpcError(f"zo_apply {field} must be a round count")
    return value


def _zo_g(trainer: Trainer, params: Sequence[torch.Tensor], config: ZoConfig, step: int, seed: int) -> int:
    """One update: g by SPSA on this step's batch, as one byte."""
    inputs, targets = trainer.shard.batch(batch_size=trainer.inner.batch_size, seed=trainer.seed, step=step)
    batch = (inputs.to(trainer.device), targets.to(trainer.device))  # the shard is in host memory

    def loss() -> float:
        return float(trainer.model.loss(*batch).item())

    with torch.no_grad():
        g = zo.spsa(params, loss, seed, config.eps, signs=config.signs)
    try:
        return zo.encode_g(g, config.g_max)
    except ValueError:
        logger.warning("step %d: g is %s; publishing g = 0", step, g)
        return 0


def _zo_step(
    trainer: Trainer,
    params: Sequence[torch.Tensor],
    config: ZoConfig,
    round_index: int,
    seeds: list[int],
    val_rows: int,
) -> dict[str, Any]:
    """Our updates for a round: one per seed, all at this round's weights (the log applies
    them, with everyone's, before the next round)."""
    started = time.perf_counter()
    codes = [_zo_g(trainer, params, config, round_index * len(seeds) + k, s) for k, s in enumerate(seeds)]
    compute_s = time.perf_counter() - started
    return {
        "round": round_index,
        "g_codes": codes,
        "val_loss": trainer.val_loss(val_rows),
        "compute_s": compute_s,
    }


def _zo_load(params: Sequence[torch.Tensor], command: dict[str, Any]) -> dict[str, Any]:
    """Adopt a fetched checkpoint if it parses, fits and hashes as announced; else keep ours."""
    try:
        tensors, _ = checkpoint.load(Path(str(command.get("path"))))
        loaded = [tensors.get(f"param.{k}") for k in range(len(params))]
        if len(tensors) != len(params) or any(
            t is None or t.shape != p.shape or t.dtype != p.dtype for t, p in zip(loaded, params, strict=True)
        ):
            raise checkpoint.CheckpointError("it does not fit this model")
        if zo.param_hash([t for t in loaded if t is not None]) != command.get("param_hash"):
            raise checkpoint.CheckpointError("its weights do not hash to the announced value")
    except checkpoint.CheckpointError as exc:
        logger.warning("fetched checkpoint refused: %s", exc)
        return {"ok": False, "reason": str(exc)[:200]}
    with torch.no_grad():
        for param, tensor in zip(params, loaded, strict=True):
            assert tensor is not None
            param.copy_(tensor)
    return {"ok": True}


def run(config: WorkerConfig, trainer: Trainer, commands: BinaryIO, replies: BinaryIO) -> None:
    """Zeroth-order mode: the daemon says which logged updates to apply (one message per
    round of the log, in the canonical order: one message is one summed group, so the
    grouping is part of the arithmetic) and asks for our own updates of a round; the
    weights are the genesis weights plus the applied log, never anything else."""
    params = list(trainer.model.parameters())
    zo_config = replace(config.run.zo, lr=zo.step_size(config.run.zo, trainer.model.num_params()))
    logger.info("zo: step size %.3g", zo_config.lr)
    genesis = [p.detach().clone() for p in params]
    snapshots = Snapshots(params, Snapshots.capacity_for(params))
    trainer.model.eval()
    ipc.write_blocking(
        replies,
        "ready",
        payload_nbytes=0,
        outbox="",
        inbox="",
        round=0,
        zo_snapshots=snapshots.capacity,
        device=str(trainer.device),
        val_blocks=len(trainer.shard.val),
    )
    round_parts: list[tuple[int, int]] = []
    pending = Pending(params, zo_config)
    while True:
        command = ipc.read_blocking(commands, ipc.DAEMON_TYPES)
        kind = command["t"]
        if kind == "stop":
            return
        if kind != "zo_apply":
            pending.flush()  # every other command reads the weights
        if kind == "zo_apply":
            rewind, snapshot = _key(command, "rewind"), _key(command, "snapshot")
            if command.get("rebuild") is True:
                round_parts.clear()
                pending.drop()
                snapshots.clear()
                zo.copy_into(params, genesis)
            elif rewind is not None:
                round_parts.clear()
                pending.drop()
                snapshots.rewind(rewind)
            round_parts += _updates(command)
            if len(round_parts) > MAX_UPDATES_PER_ROUND:
                raise ipc.IpcError(f"a round of more than {MAX_UPDATES_PER_ROUND} updates")
            if command.get("more") is not True:  # the round's last part: the whole group is one sum
                pending.add(round_parts)
                round_parts = []
                if snapshot is not None:
                    pending.flush()
                    snapshots.keep(snapshot)
        elif kind == "zo_go":
            round_index, seeds = command.get("round"), command.get("seeds")
            if type(round_index) is not int or round_index < 0 or not isinstance(seeds, list) or not seeds:
                raise ipc.IpcError("zo_go needs a round and a list of seeds")
            if len(seeds) > 4096 or not all(type(s) is int and 0 <= s < 1 << 64 for s in seeds):
                raise ipc.IpcError("zo_go seeds must be 64-bit integers (at most 4096)")
            step = _zo_step(trainer, params, zo_config, round_index, seeds, validation.curve_rows(config.run))
            ipc.write_blocking(replies, "zo_step", **step)
        elif kind == "zo_save":
            # The weights as they stand (genesis + whole rounds of the log): a checkpoint peers can fetch.
            path = Path(str(command.get("path")))
            try:
                checkpoint.save(path, {f"param.{k}": p for k, p in enumerate(params)}, {"round": command.get("round")})
                error = None
            except OSError as exc:  # a full disk: no checkpoint to offer this time, training goes on
                logger.error("could not save the ZO checkpoint %s: %s", path, exc.strerror or exc)
                error = f"{exc.strerror or exc} ({path})"
            ipc.write_blocking(replies, "zo_saved", param_hash=zo.param_hash(params), save_error=error)
        elif kind == "zo_load":
            loaded = _zo_load(params, command)
            if loaded["ok"]:
                snapshots.clear()  # the daemon counts round groups from the loaded weights' log afresh
            ipc.write_blocking(replies, "zo_loaded", **loaded)
        elif kind == "zo_finish":
            ipc.write_blocking(
                replies,
                "zo_done",
                param_hash=zo.param_hash(params),
                val_loss=trainer.val_loss(validation.curve_rows(config.run)),
                full_val_loss=trainer.val_loss(validation.FULL_MAX_ROWS),
            )
        else:
            raise ipc.IpcError(f"{kind!r} in zo mode")
