"""Writing a file so that a crash or a full disk never leaves half of one (torch-free: the
daemon's saved run state and the worker's checkpoints both use it)."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function writing them to the open file) to a temporary
    file beside ``path``, fsync, then rename over ``path``: a crash leaves the old file or
    the new one. On ``OSError`` (a full disk, a read-only mount) the old file stays whole,
    the temporary one is removed, and the error is raised."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, or the writer's own refusal: no half file left behind
        tmp.unlink(missing_ok=True)
        raise
