"""Logging, configured once, in the entry point: every line names this node's peer."""

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)-7s [%(peer)s] %(name)s: %(message)s"


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


def setup(level: str, peer_id: str) -> None:
    """Send our logs (and libp2p's, which does not propagate) to stderr with the peer id."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_PeerFilter(short_peer(peer_id)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # libp2p logs expected teardown and dial noise at ERROR; show it only when debugging.
    # Its child loggers set their own levels, so the filter sits on a handler of its own.
    libp2p_handler = logging.StreamHandler(sys.stderr)
    libp2p_handler.setFormatter(handler.formatter)
    libp2p_handler.addFilter(_PeerFilter(short_peer(peer_id)))
    libp2p_handler.setLevel(logging.DEBUG if level == "debug" else logging.CRITICAL)
    libp2p_logger = logging.getLogger("libp2p")
    libp2p_logger.handlers[:] = [libp2p_handler]
