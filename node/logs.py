"""Logging, configured once, in the entry point: every line names this node's peer."""

import logging
import sys
from pathlib import Path

# Milliseconds: pairing and round timings between nodes are read off these lines.
_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s [%(peer)s] %(name)s: %(message)s"


class _PeerFilter(logging.Filter):
    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer = peer

    def filter(self, record: logging.LogRecord) -> bool:
        record.peer = self.peer
        return True


def short_peer(peer_id: str) -> str:
    """The tail of a peer id: enough to tell peers apart in logs and tables."""
    return peer_id[-8:]


def _handler(handler: logging.Handler, peer_id: str, level: int) -> logging.Handler:
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_PeerFilter(short_peer(peer_id)))
    handler.setLevel(level)
    return handler


def _handlers(peer_id: str, console: int, log_file: Path | None, to_file: int) -> list[logging.Handler]:
    handlers = [_handler(logging.StreamHandler(sys.stderr), peer_id, console)]
    if log_file is not None:
        handlers.append(_handler(logging.FileHandler(log_file, encoding="utf-8"), peer_id, to_file))
    return handlers


def setup(level: str, peer_id: str, *, log_file: Path | None = None, file_level: str | None = None) -> None:
    """Send our logs (and libp2p's, which does not propagate) to stderr at ``level``, and
    with ``log_file`` also to that file (appended) at ``file_level`` (default ``level``)."""
    console = logging.getLevelName(level.upper())
    to_file = logging.getLevelName((file_level or level).upper())
    root = logging.getLogger()
    root.handlers[:] = _handlers(peer_id, console, log_file, to_file)
    root.setLevel(min(console, to_file))

    # libp2p logs expected teardown and dial noise at ERROR; show it only when debugging.
    # Its child loggers set their own levels, so the gate sits on handlers of its own.
    def gate(level: int) -> int:
        return logging.DEBUG if level == logging.DEBUG else logging.CRITICAL

    logging.getLogger("libp2p").handlers[:] = _handlers(peer_id, gate(console), log_file, gate(to_file))
