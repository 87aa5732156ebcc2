"""Named tensors and a little metadata in one safetensors file: no pickle, no decoder of ours.

Format: safetensors (an 8-byte header length, a JSON header of each tensor's dtype, shape
and byte range, then the raw little-endian bytes), with our metadata in its
``__metadata__``:

    "format"      FORMAT ("swarmtrain-ckpt/2")
    "meta"        JSON of the caller's metadata (round, step, settings fingerprint...)
    "sha256"      hex SHA-256 of every tensor's bytes, tensors sorted by name

Why safetensors (issue 12): checkpoints travel between strangers (a ZO joiner fetches one,
node/algorithms/savedstate.py), and its reader is made for untrusted files, bounds its header, never
executes anything, and is maintained by others: we keep no binary decoder to fuzz. A file
fetched from a peer is checked against the hash its holder announced *before* it is
parsed; ``sha256`` then catches a damaged local file.

A worker saves one after every outer step (atomically: a crash leaves the old file or the
new one) and resumes from it after a restart. Anything wrong raises ``CheckpointError``
with the reason, and the caller starts over without it.
"""

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from training.files import write_atomic
from training.finite import all_finite

FORMAT = "swarmtrain-ckpt/2"
DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8})
# Our metadata is a few settings; a larger header is not one of ours.
MAX_META_NBYTES = 1 << 20


class CheckpointError(Exception):
    """The file is missing pieces, damaged, or not a checkpoint of ours."""


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        # The array's buffer itself: ``tobytes()`` copied every byte first (52 MB for tiny).
        digest.update(tensors[name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _parse(data: bytes) -> dict[str, torch.Tensor]:
    """safetensors' Rust reader: whatever it raises on a hostile file, a panic included
    (pyo3's ``PanicException`` is a ``BaseException``), is a ``CheckpointError``."""
    try:
        tensors: dict[str, torch.Tensor] = load_bytes(data)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # the boundary with a native library
        raise CheckpointError(f"unreadable checkpoint: {type(exc).__name__}: {str(exc)[:200]}") from exc
    return tensors


def encode(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """The file's bytes."""
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{name}: cannot store dtype {tensor.dtype}")
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ValueError(f"{name}: refusing to save non-finite values")
    plain = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    metadata = {"format": FORMAT, "meta": json.dumps(dict(meta), sort_keys=True), "sha256": _digest(plain)}
    data: bytes = save_bytes(plain, metadata=metadata)
    return data


def save(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Write atomically: tmp file, fsync, rename. ``OSError`` (a full disk...) leaves the old file."""
    write_atomic(path, encode(tensors, meta))


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parse and check a checkpoint's bytes; ``CheckpointError`` says what is wrong."""
    if len(data) < 8:
        raise CheckpointError("truncated: not a safetensors file")
    header_nbytes = int.from_bytes(data[:8], "little")
    if header_nbytes > len(data) - 8:
        raise CheckpointError(f"header of {header_nbytes} bytes does not fit the file")
    try:
        header = json.loads(data[8 : 8 + header_nbytes])
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"undecodable header: {exc}") from exc
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"not a {FORMAT} checkpoint")
    meta_text, expected = metadata.get("meta"), metadata.get("sha256")
    if not isinstance(meta_text, str) or len(meta_text) > MAX_META_NBYTES or not isinstance(expected, str):
        raise CheckpointError("checkpoint metadata is missing or too large")
    try:
        meta = json.loads(meta_text)
    except ValueError as exc:
        raise CheckpointError(f"undecodable checkpoint metadata: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointError("checkpoint metadata is not a map")
    tensors = _parse(data)
    if _digest(tensors) != expected:
        raise CheckpointError("tensors do not match their hash (damaged or truncated)")
    return {name: tensors[name] for name in sorted(tensors)}, meta


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from exc
    return decode(data)
