"""The formats and wire protocol versions peers of one run must share (protocol/runstate/info.py
sends them; a joiner refuses a run whose versions differ, naming both sides')."""

from node.algorithms import savedstate
from node.algorithms.noloco import pairing
from node.algorithms.zo import zolog, zosync
from protocol.net import exchange
from protocol.runstate import sync
from protocol.runstate.state import FORMAT_VERSION


def our_versions() -> dict[str, int]:
    return {
        "run-document": FORMAT_VERSION,
        "state-sync": sync.VERSION,
        "exchange": exchange.VERSION,
        "pairing": pairing.VERSION,
        "zo-log": zolog.VERSION,
        "zo-log-sync": zosync.VERSION,
        "zo-checkpoint": savedstate.VERSION,
    }
