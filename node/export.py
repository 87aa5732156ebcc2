"""``swarmtrain export`` and ``swarmtrain sample``: a run's trained model out of a data dir.

Both read the node's checkpoint of a run (``<data dir>/runs/<run id>.ckpt``, written
atomically after every outer step, so they work beside a running daemon) and leave the
maths to training/export.py. Without ``--run`` they take the run whose checkpoint was
written last and say which.
"""

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from node.config import RUN_ID_PATTERN
from node.datadir import DataDir
from node.errors import DataDirError, NodeError

if TYPE_CHECKING:
    from training.tokenizer import Codec


class ExportFailed(NodeError):
    """The model could not be read or written (with the reason)."""


def find_checkpoint(data_dir: Path, run_id: str | None) -> tuple[str, Path]:
    """The run and its checkpoint: ``run_id``'s, or the newest in the data dir."""
    runs = DataDir(data_dir)
    if run_id is not None:
        path = runs.checkpoint_file(run_id)
        if not path.is_file():
            raise DataDirError(f"no training checkpoint of run {run_id} in {data_dir} (looked for {path})")
        return run_id, path
    # A run's own checkpoint only (not the states it offers peers, <run>.state-N.ckpt).
    found = sorted(
        (p for p in (data_dir / "runs").glob("*.ckpt") if RUN_ID_PATTERN.fullmatch(p.stem)),
        key=lambda p: p.stat().st_mtime,
    )
    if not found:
        raise DataDirError(f"no training checkpoint in {data_dir}: has this node trained? (--data-dir: another)")
    newest = found[-1]
    if len(found) > 1:
        print(f"run {newest.stem}: the newest of {len(found)} runs here (--run ID for another)", file=sys.stderr)
    return newest.stem, newest


def _gathered(data_dir: Path) -> list[tuple[str, Path]]:
    """The run's live trainers' saved states, fetched by the running daemon (hashed as they
    arrive, as a joiner's are)."""
    import trio

    from node.api import SLOW_COMMANDS_S, call

    answer = trio.run(lambda: call(data_dir, "gather", timeout_s=SLOW_COMMANDS_S["gather"] + 10))
    states = answer.get("states")
    if not isinstance(states, list):
        raise ExportFailed("the daemon's answer names no states")
    return [(str(s["peer"]), Path(str(s["path"]))) for s in states if isinstance(s, dict)]


def _codec(data_dir: Path, run_id: str) -> "Codec":
    """The run's tokenizer: its trained BPE if this node keeps one, else bytes."""
    from training.tokenizer import Codec, TokenizerError

    path = DataDir(data_dir).tokenizer_file(run_id)
    try:
        return Codec.load(path if path.is_file() else None)
    except TokenizerError as exc:
        raise ExportFailed(str(exc)) from exc


def export_command(data_dir: Path, run_id: str | None, out_dir: Path, *, average: bool = False) -> int:
    from training.export import ExportError, export, load_trained
    from training.export import average as mean_of

    if out_dir.exists() and not out_dir.is_dir():
        raise ExportFailed(f"--out {out_dir} is a file, not a folder")
    run, path = find_checkpoint(data_dir, run_id)
    codec = _codec(data_dir, run)
    try:
        trained = load_trained(path)
        if average:
            replicas = [("this node", trained)]
            for peer, state in _gathered(data_dir):
                try:
                    replicas.append((peer, load_trained(state)))
                except ExportError as exc:
                    print(f"{peer}: left out ({exc})", file=sys.stderr)
            trained, members, mean_loss = mean_of(replicas, codec)
            for member in members:
                verdict = "" if member.used else "  (left out)"
                print(f"{member.name:54} round {member.round:5}  val loss {member.val_loss:.4f}{verdict}")
            print(f"{'the mean of ' + str(sum(m.used for m in members)):54} {'':11}  val loss {mean_loss:.4f}")
        written = export(trained, out_dir, codec)
    except ExportError as exc:
        raise ExportFailed(str(exc)) from exc
    except OSError as exc:
        raise ExportFailed(f"cannot write into {out_dir}: {exc.strerror or exc}") from exc
    print(
        f"wrote run {run}'s model ({trained.model_name}, after {trained.round} rounds) to {out_dir}: "
        + ", ".join(p.name for p in written)
    )
    print(f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(out_dir)!r})")
    return 0


def sample_command(
    data_dir: Path, run_id: str | None, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> int:
    from training.export import ExportError, load_trained, sample

    run, path = find_checkpoint(data_dir, run_id)
    try:
        trained = load_trained(path)
    except ExportError as exc:
        raise ExportFailed(str(exc)) from exc
    codec = _codec(data_dir, run)
    text = sample(
        trained.model,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        codec=codec,
    )
    print(prompt + text)
    return 0
