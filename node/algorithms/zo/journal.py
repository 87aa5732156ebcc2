"""Our own ZO batches, written to disk before anyone sees them.

A node killed right after it published a batch may come back before any peer it can
reach holds that batch. Starting its chain again from what it can pull, it would sign a
second batch for the same sequence numbers: equivocation, which excludes and bans it
everywhere (node/algorithms/zo/zolog.py). So each batch we sign is appended here (and synced to
disk) before it is added to our log or gossiped, and a restarted node takes its chain
back from this file first: nothing it published is lost, and no sequence number is
signed twice.

Format: records of a 4-byte big-endian length and a batch as on the wire
(``zolog.Batch.encode``). A record cut short by a crash ends the file (ignored, and
overwritten by the next append); the batches are verified like any peer's.
"""

import logging
import os
from pathlib import Path

import trio

from node.algorithms.zo import zolog
from protocol.errors import BadMessage

logger = logging.getLogger(__name__)

LENGTH_NBYTES = 4
MAX_RECORD_NBYTES = 1 << 20


class Journal:
    def __init__(self, path: Path, run_id: str) -> None:
        self.path = path
        self._run_id = run_id
        self._end: int | None = None
        """Where the next record goes (after the last whole one), once read."""

    async def read(self) -> list[zolog.Batch]:
        """Our batches, oldest first (none if there is no journal yet)."""
        batches, self._end = await trio.to_thread.run_sync(self._read)
        return batches

    def _read(self) -> tuple[list[zolog.Batch], int]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], 0
        batches: list[zolog.Batch] = []
        offset = 0
        while offset + LENGTH_NBYTES <= len(data):
            nbytes = int.from_bytes(data[offset : offset + LENGTH_NBYTES], "big")
            record = data[offset + LENGTH_NBYTES : offset + LENGTH_NBYTES + nbytes]
            if nbytes > MAX_RECORD_NBYTES or len(record) < nbytes:
                break
            try:
                batches.append(zolog.decode_batch(record, self._run_id))
            except BadMessage as exc:
                logger.warning("zo journal %s: a record is unreadable (%s); the rest is ignored", self.path, exc)
                break
            offset += LENGTH_NBYTES + nbytes
        if offset < len(data):
            logger.info("zo journal %s: %d bytes of a cut-short record ignored", self.path, len(data) - offset)
        return batches, offset

    async def append(self, batch: zolog.Batch) -> None:
        """Write ``batch`` and sync it to disk; ``OSError`` (a full disk) if it could not be."""
        if self._end is None:
            await self.read()
        assert self._end is not None
        record = batch.encode()
        self._end = await trio.to_thread.run_sync(self._append, len(record).to_bytes(LENGTH_NBYTES, "big") + record)

    def _append(self, record: bytes) -> int:
        assert self._end is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, self._end)  # drop a record a crash cut short
            os.lseek(fd, self._end, os.SEEK_SET)
            view = memoryview(record)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return self._end + len(record)
