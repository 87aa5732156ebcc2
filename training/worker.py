"""The worker process: trains, and talks to its daemon only through training/ipc.py.

    python -m training.worker CONFIG_JSON

It never touches the network. It builds the model and its data shard, then hands over to
the run's algorithm (training/algorithms/: the φ/Δ round loop of local, NoLoCo and DiLoCo,
which resumes from its checkpoint; or ZO's log replay). stdout carries control messages
only; logs go to stderr.
"""

import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from training import algorithms, corpus, data, ipc, tokenizer
from training.models import GPT, configured
from training.trainer import Trainer
from training.worker_config import WorkerConfig

logger = logging.getLogger("training.worker")


WorkerMain = Callable[[WorkerConfig, Trainer, BinaryIO, BinaryIO], None]


def worker_main(name: str) -> WorkerMain:
    """The worker's loop for algorithm ``name`` (a name the settings already checked):
    ``run`` of its module in training/algorithms/."""
    main: WorkerMain = importlib.import_module(algorithms.MODULES[name]).run
    return main


def resolve_device(setting: str) -> str:
    """Where to train for a device setting (training/worker_config.py DEVICES): auto is a GPU
    when this torch sees one; a GPU this machine lacks (a CPU build of torch, an index past
    the last GPU) means the CPU, said in the worker log (the daemon says it on the console:
    node/supervisor.py), since a crash would only loop."""
    if setting == "cpu":
        return "cpu"
    available = torch.cuda.is_available()
    if setting == "auto":
        return "cuda" if available else "cpu"
    if not available:
        logger.warning("device %s asked for, but this torch sees no CUDA device: training on the CPU", setting)
        return "cpu"
    index = torch.device(setting).index
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        logger.warning(
            "device %s asked for, but this machine has %d CUDA device(s): training on the CPU", setting, count
        )
        return "cpu"
    if index is not None:
        torch.cuda.set_device(index)  # Triton kernels and allocations without an index go there too
    return setting


def build_trainer(config: WorkerConfig) -> Trainer:
    torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    model_config = configured(config.run.model, config.model_overrides)
    torch.manual_seed(config.seed + config.run.seed)
    model = GPT(model_config)
    text = corpus.read_corpus(None if config.data_path is None else Path(config.data_path))
    codec = tokenizer.Codec.load(None if config.tokenizer_path is None else Path(config.tokenizer_path))
    tokens = data.tokens_of(text, codec)
    shard = data.make_shard(
        tokens, context_len=model_config.context_len, node_index=config.node_index, num_nodes=config.num_nodes
    )
    common: dict[str, Any] = {
        "inner": config.run.inner,
        "outer": config.run.outer,
        # Batches: this node's stream, moved by the run's seed (a prime apart: no overlap).
        "seed": (config.node_index if config.batch_seed is None else config.batch_seed) + 1_000_003 * config.run.seed,
        "compression": config.run.compression,
        "device": device,
        "compile_model": config.compile == "on" or (config.compile == "auto" and device != "cpu"),
    }
    # An algorithm with a trainer of its own (SPES) names it ``make_trainer`` in its module.
    make = getattr(importlib.import_module(algorithms.MODULES[config.run.algorithm]), "make_trainer", None)
    trainer: Trainer = Trainer(model, shard, **common) if make is None else make(model, shard, config.run, **common)
    trainer.slowdown = config.slowdown
    return trainer


def run(config: WorkerConfig, commands: BinaryIO, replies: BinaryIO) -> None:
    worker_main(config.run.algorithm)(config, build_trainer(config), commands, replies)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s worker %(levelname)s %(message)s")
    config = WorkerConfig.from_json(sys.argv[1])
    # Unbuffered: a thread reads the commands (ipc.CommandReader) and is still blocked in a
    # read when the worker exits; a buffered stdin's lock held then aborts the interpreter.
    commands = open(sys.stdin.fileno(), "rb", buffering=0, closefd=False)  # noqa: SIM115
    try:
        run(config, commands, sys.stdout.buffer)
    except ipc.IpcError as exc:
        logger.info("daemon went away or misbehaved: %s", exc)


if __name__ == "__main__":
    main()
