"""The worker process: trains, and talks to its daemon only through training/ipc.py.

    python -m training.worker CONFIG_JSON

It never touches the network. Each round: H inner steps, φ and Δ into the outbox (shared
memory), ``round_done``; then wait for ``outer_go`` and apply the outer step, with the
inbox's partner payload when there is one, and save a checkpoint. A restarted worker
resumes from its checkpoint (its "ready" says from which round). stdout carries control messages only; logs go
to stderr.
"""

import logging
import sys
import time
from collections.abc import Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, BinaryIO

import torch

from training import checkpoint, data, ipc, zo
from training.models import GPT, GPTConfig, preset
from training.settings import ZoConfig
from training.trainer import PayloadRejected, Trainer
from training.worker_config import WorkerConfig

logger = logging.getLogger("training.worker")


def build_trainer(config: WorkerConfig) -> Trainer:
    torch.set_num_threads(config.threads)
    device = config.device
    if device == "cuda" and not torch.cuda.is_available():
        # A GPU machine with a CPU build of torch: train anyway (a crash would only loop).
        logger.warning("device cuda asked for, but this torch sees no CUDA device: training on the CPU")
        device = "cpu"
    model_config = GPTConfig(**{**_fields(preset(config.run.model)), **config.model_overrides})
    torch.manual_seed(config.seed)
    model = GPT(model_config)
    tokens = data.encode(data.read_corpus(None if config.data_path is None else Path(config.data_path)))
    shard = data.make_shard(
        tokens, context_len=model_config.context_len, node_index=config.node_index, num_nodes=config.num_nodes
    )
    return Trainer(
        model,
        shard,
        inner=config.run.inner,
        outer=config.run.outer,
        seed=config.node_index if config.batch_seed is None else config.batch_seed,
        compression=config.run.compression,
        device=device,
        compile_model=config.compile == "on" or (config.compile == "auto" and device == "cuda"),
    )


def _fields(config: GPTConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}


def resume(config: WorkerConfig, trainer: Trainer) -> None:
    """Continue from the checkpoint if there is a usable one; a damaged or foreign one is
    moved aside (kept for the user, never deleted) and training starts over."""
    if config.checkpoint_path is None or not Path(config.checkpoint_path).exists():
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


def save(config: WorkerConfig, trainer: Trainer) -> str | None:
    """The state after an outer step (never a non-finite one: the step refuses those first).

    A failed write (a full disk, a read-only mount) is returned, not raised: training goes
    on, the old file stays whole (the write is atomic), and the next round tries again;
    a worker that crashed here instead would only crash again after its restart.
    """
    if config.checkpoint_path is None:
        return None
    tensors, meta = trainer.state()
    try:
        checkpoint.save(Path(config.checkpoint_path), tensors, {**meta, "fingerprint": config.fingerprint()})
    except OSError as exc:
        logger.error(
            "could not save the checkpoint %s: %s; training goes on, retried next round",
            config.checkpoint_path,
            exc.strerror or exc,
        )
        return f"{exc.strerror or exc} ({config.checkpoint_path})"
    return None


def run(config: WorkerConfig, commands: BinaryIO, replies: BinaryIO) -> None:
    trainer = build_trainer(config)
    if config.run.algorithm == "zo":
        _zo_rounds(config, trainer, commands, replies)
        return
    resume(config, trainer)
    nbytes = trainer.payload_nbytes
    outbox = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    inbox = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    try:
        _rounds(config, trainer, outbox, inbox, commands, replies)
    finally:
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
) -> None:
    # Tensors over the shared blocks live only in this frame, and are deleted on the way
    # out, so a traceback holding the frame cannot keep the blocks exported (close() fails).
    out_view = torch.frombuffer(outbox.buf, dtype=torch.uint8, count=trainer.payload_nbytes)
    in_view = torch.frombuffer(inbox.buf, dtype=torch.uint8, count=trainer.payload_nbytes)
    try:
        ipc.write_blocking(
            replies,
            "ready",
            payload_nbytes=trainer.payload_nbytes,
            outbox=outbox.name,
            inbox=inbox.name,
            round=trainer.round,
        )
        for round_index in range(trainer.round, config.run.rounds):
            started = time.perf_counter()
            train_loss = trainer.inner_steps()
            out_view.copy_(trainer.outer_payload())
            compute_s = time.perf_counter() - started
            val_loss = trainer.val_loss()
            ipc.write_blocking(
                replies,
                "round_done",
                round=round_index,
                train_loss=train_loss,
                val_loss=val_loss,
                compute_s=compute_s,
                step=trainer.step,
            )
            collected: dict[str, list[torch.Tensor]] = {}
            while True:
                command = ipc.read_blocking(commands, ipc.DAEMON_TYPES)
                if command["t"] == "stop":
                    return
                if command.get("round") != round_index:
                    raise ipc.IpcError(f"{command['t']} for round {command.get('round')} while at {round_index}")
                if command["t"] != "accumulate":
                    break
                try:  # DiLoCo: keep this peer's Δ (checked like any partner payload)
                    collected[str(command.get("key"))] = trainer.parse_payload(in_view.clone()).delta
                    refusal = None
                except PayloadRejected as exc:
                    refusal = str(exc)[:200]
                ipc.write_blocking(replies, "accumulated", round=round_index, ok=refusal is None, reason=refusal)
            if config.run.algorithm == "diloco":
                collected[str(command.get("key"))] = trainer.own_delta()
                trainer.apply_diloco([collected[key] for key in sorted(collected)])
                used = len(collected) > 1
            else:
                peer = in_view.clone() if command.get("peer") is True else None
                used = trainer.apply_outer(peer, algorithm=config.run.algorithm)
            save_error = save(config, trainer)  # before "outer_done": a round the daemon counted is kept
            rejected = trainer.last_rejection if config.run.algorithm == "noloco" else None
            ipc.write_blocking(
                replies, "outer_done", round=round_index, used_peer=used, rejected=rejected, save_error=save_error
            )
        ipc.read_blocking(commands, ipc.DAEMON_TYPES)  # the daemon's "stop" (or EOF)
    finally:
        del out_view, in_view


MAX_UPDATES_PER_MESSAGE = 20_000
# A round's parts together (zo_apply with more = True until the last): members × steps.
MAX_UPDATES_PER_ROUND = 1_000_000


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


def _zo_g(trainer: Trainer, params: Sequence[torch.Tensor], config: ZoConfig, step: int, seed: int) -> int:
    """One update: g by SPSA on this step's batch, as one byte."""
    batch = trainer.shard.batch(batch_size=trainer.inner.batch_size, seed=trainer.seed, step=step)

    def loss() -> float:
        return float(trainer.model.loss(*batch).item())

    with torch.no_grad():
        g = zo.spsa(params, loss, seed, config.eps)
    try:
        return zo.encode_g(g, config.g_max)
    except ValueError:
        logger.warning("step %d: g is %s; publishing g = 0", step, g)
        return 0


def _zo_step(
    trainer: Trainer, params: Sequence[torch.Tensor], config: ZoConfig, round_index: int, seeds: list[int]
) -> dict[str, Any]:
    """Our updates for a round: one per seed, all at this round's weights (the log applies
    them, with everyone's, before the next round)."""
    started = time.perf_counter()
    codes = [_zo_g(trainer, params, config, round_index * len(seeds) + k, s) for k, s in enumerate(seeds)]
    compute_s = time.perf_counter() - started
    return {
        "round": round_index,
        "g_codes": codes,
        "val_loss": trainer.val_loss(),
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


def _zo_rounds(config: WorkerConfig, trainer: Trainer, commands: BinaryIO, replies: BinaryIO) -> None:
    """Zeroth-order mode: the daemon says which logged updates to apply (one message per
    round of the log, in the canonical order: one message is one summed group, so the
    grouping is part of the arithmetic) and asks for our own updates of a round; the
    weights are the genesis weights plus the applied log, never anything else."""
    zo_config = config.run.zo
    params = list(trainer.model.parameters())
    genesis = [p.detach().clone() for p in params]
    trainer.model.eval()
    ipc.write_blocking(replies, "ready", payload_nbytes=0, outbox="", inbox="", round=0)
    round_parts: list[tuple[int, int]] = []
    while True:
        command = ipc.read_blocking(commands, ipc.DAEMON_TYPES)
        kind = command["t"]
        if kind == "stop":
            return
        if kind == "zo_apply":
            if command.get("rebuild") is True:
                round_parts.clear()
                with torch.no_grad():
                    for param, start in zip(params, genesis, strict=True):
                        param.copy_(start)
            round_parts += _updates(command)
            if len(round_parts) > MAX_UPDATES_PER_ROUND:
                raise ipc.IpcError(f"a round of more than {MAX_UPDATES_PER_ROUND} updates")
            if command.get("more") is not True:  # the round's last part: apply the whole group once
                if round_parts:
                    zo.apply_updates(params, round_parts, zo_config)
                round_parts = []
        elif kind == "zo_go":
            round_index, seeds = command.get("round"), command.get("seeds")
            if type(round_index) is not int or round_index < 0 or not isinstance(seeds, list) or not seeds:
                raise ipc.IpcError("zo_go needs a round and a list of seeds")
            if len(seeds) > 4096 or not all(type(s) is int and 0 <= s < 1 << 64 for s in seeds):
                raise ipc.IpcError("zo_go seeds must be 64-bit integers (at most 4096)")
            ipc.write_blocking(replies, "zo_step", **_zo_step(trainer, params, zo_config, round_index, seeds))
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
            ipc.write_blocking(replies, "zo_loaded", **_zo_load(params, command))
        elif kind == "zo_finish":
            ipc.write_blocking(replies, "zo_done", param_hash=zo.param_hash(params), val_loss=trainer.val_loss())
        else:
            raise ipc.IpcError(f"{kind!r} in zo mode")


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s worker %(levelname)s %(message)s")
    config = WorkerConfig.from_json(sys.argv[1])
    try:
        run(config, sys.stdin.buffer, sys.stdout.buffer)
    except ipc.IpcError as exc:
        logger.info("daemon went away or misbehaved: %s", exc)


if __name__ == "__main__":
    main()
