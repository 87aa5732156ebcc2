"""The data dir: identity, control socket, lock, and saved run state.

<data dir>/            mode 0700
├── identity.key       ed25519 seed, 0600 (node/identity.py)
├── lock               held (flock) by the running daemon: one daemon per data dir
├── api.sock           control API (node/api.py)
├── runs/<run id>.crdt the run's document, rewritten atomically after changes
├── runs/<run id>.ckpt the worker's training state, saved after an outer step (the rounds
│                      that find the last write done; training/saver.py)
└── runs/<run id>.tokenizer.json   the run's BPE tokenizer, when it has one
"""

import fcntl
import os
from pathlib import Path

from node.errors import DataDirError
from training.files import write_atomic


class DataDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None

    def open(self) -> None:
        """Create the dir if needed and take its lock; ``DataDirError`` if another daemon holds it."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.path / "runs").mkdir(mode=0o700, exist_ok=True)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise DataDirError(f"cannot use data dir {self.path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DataDirError(
                f"another daemon (pid {holder}) is using data dir {self.path}; stop it or pass another --data-dir"
            ) from exc
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def identity_file(self) -> Path:
        return self.path / "identity.key"

    def run_file(self, run_id: str) -> Path:
        return self.path / "runs" / f"{run_id}.crdt"

    def checkpoint_file(self, run_id: str) -> Path:
        """The worker's training state in this run (training/checkpoint.py)."""
        return self.path / "runs" / f"{run_id}.ckpt"

    def tokenizer_file(self, run_id: str) -> Path:
        """The run's BPE tokenizer, trained by this node (training/tokenizer.py)."""
        return self.path / "runs" / f"{run_id}.tokenizer.json"

    def load_run(self, run_id: str) -> bytes | None:
        try:
            return self.run_file(run_id).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DataDirError(f"cannot read saved run state {self.run_file(run_id)}: {exc.strerror}") from exc

    def save_run(self, run_id: str, data: bytes) -> None:
        """Write atomically: a crash leaves the old file or the new one, never half of one."""
        write_atomic(self.run_file(run_id), data)
