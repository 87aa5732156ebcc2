"""Named tensors and a little metadata in one file, checked on the way in; no pickle.

Layout (all integers big-endian):

    b"SWTCKPT1"                        magic and format version
    u32 header length, msgpack header  {"meta": {...}, "tensors": [{"name", "dtype",
                                        "shape", "nbytes"}, ...], "sha256": hex of the body}
    body                               each tensor's raw bytes (little-endian, C order),
                                        in header order

A worker saves one after every outer step (atomically: a crash leaves the old file or the
new one) and resumes from it after a restart. Loading checks everything before any tensor
is built: magic, sizes, dtypes, shapes, and the hash of the body; a damaged file raises
``CheckpointError`` with the reason and the caller starts over without it.
"""

import hashlib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import torch

MAGIC = b"SWTCKPT1"
MAX_HEADER_NBYTES = 16 << 20
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointError(Exception):
    """The file is missing pieces, damaged, or not a checkpoint."""


def encode(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[bytes]:
    """The file's bytes, in pieces (write them in order)."""
    specs, chunks = [], []
    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise ValueError(f"{name}: cannot store dtype {tensor.dtype}")
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        specs.append({"name": name, "dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "nbytes": len(raw)})
        digest.update(raw)
        chunks.append(raw)
    header: bytes = msgpack.packb(
        {"meta": dict(meta), "tensors": specs, "sha256": digest.hexdigest()}, use_bin_type=True
    )
    return [MAGIC, len(header).to_bytes(4, "big"), header, *chunks]


def save(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Write atomically: tmp file, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for piece in encode(tensors, meta):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parse and check a checkpoint's bytes; ``CheckpointError`` says what is wrong."""
    if not data.startswith(MAGIC):
        raise CheckpointError("not a swarmtrain checkpoint (bad magic)")
    offset = len(MAGIC) + 4
    if len(data) < offset:
        raise CheckpointError("truncated header")
    header_nbytes = int.from_bytes(data[len(MAGIC) : offset], "big")
    if header_nbytes > MAX_HEADER_NBYTES or offset + header_nbytes > len(data):
        raise CheckpointError(f"header of {header_nbytes} bytes does not fit the file")
    try:
        header = msgpack.unpackb(data[offset : offset + header_nbytes], raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"undecodable header: {exc}") from exc
    if not isinstance(header, dict) or set(header) != {"meta", "tensors", "sha256"}:
        raise CheckpointError("header has the wrong fields")
    meta, specs = header["meta"], header["tensors"]
    if not isinstance(meta, dict) or not isinstance(specs, list):
        raise CheckpointError("header has the wrong types")
    body = memoryview(data)[offset + header_nbytes :]
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise CheckpointError("body does not match its hash (damaged or truncated)")
    tensors: dict[str, torch.Tensor] = {}
    position = 0
    for spec in specs:
        name, dtype, shape, nbytes = _check_spec(spec)
        if name in tensors:
            raise CheckpointError(f"tensor {name!r} appears twice")
        if position + nbytes > len(body):
            raise CheckpointError(f"tensor {name!r} runs past the end of the file")
        chunk = bytearray(body[position : position + nbytes])  # a fresh, aligned copy
        tensors[name] = (
            torch.frombuffer(chunk, dtype=torch.uint8).view(dtype).reshape(shape)
            if nbytes
            else (torch.empty(shape, dtype=dtype))
        )
        position += nbytes
    if position != len(body):
        raise CheckpointError(f"{len(body) - position} bytes after the last tensor")
    return tensors, meta


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from exc
    return decode(data)


def _check_spec(spec: object) -> tuple[str, torch.dtype, list[int], int]:
    if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape", "nbytes"}:
        raise CheckpointError("a tensor entry has the wrong fields")
    name, dtype_name, shape, nbytes = spec["name"], spec["dtype"], spec["shape"], spec["nbytes"]
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise CheckpointError("a tensor has a bad name")
    if dtype_name not in DTYPES:
        raise CheckpointError(f"tensor {name!r} has unknown dtype {str(dtype_name)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
        raise CheckpointError(f"tensor {name!r} has a bad shape")
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if not isinstance(nbytes, int) or nbytes != expected:
        raise CheckpointError(f"tensor {name!r} declares {nbytes} bytes, its shape needs {expected}")
    return name, dtype, shape, nbytes
