"""The boundary rule, in one place: whatever a peer's bytes do to a handler, the node goes on.

Every handler of peer input (our stream protocols, libp2p's own pubsub, Kademlia,
identify, relay and DCUtR streams, gossip messages, CRDT updates) runs inside
``Guard.run``. Whatever escapes the handler becomes a verdict, never a crash:

    escaped                              penalty   log
    StreamError (reset, closed, EOF)     none      debug: networks break
    UnsupportedVersion                   none      info: one clear refusal, not an attack
    BadMessage                           1 point   info: the peer sent what we refuse
    trio.TooSlowError (a deadline,       1 point   info: it held our resources
    the peer sent nothing)
    Overdue (a deadline after the        none      info: we, or the link, were slow
    peer's request: protocol/net/hostlike.py)
    any other ProtocolError              none      info
    any other exception, or a panic      1 point   warning with traceback: a bug of ours
    from a native library (pycrdt's                 that a peer's bytes reached, or an
    ``PanicException`` is a                         attack; either way the node goes on
    ``BaseException``)

Only what must end the program or the task passes through: ``KeyboardInterrupt``,
``SystemExit``, ``GeneratorExit`` and trio's ``Cancelled`` (a cancellation is how trio
stops tasks; swallowing it would hang shutdown). An exception group is split: the fatal
part goes on up, the rest is judged like a single exception.

Penalties add up in the ``PeerTable``; a peer that reaches the ban threshold is banned,
its connections are closed and new ones refused (``on_ban``: protocol/net/host.py).
"""

import logging
from collections.abc import Awaitable, Callable
from typing import ParamSpec

import trio

from protocol.errors import BadMessage, ProtocolError, StreamError, UnsupportedVersion
from protocol.net.peers import PeerTable

logger = logging.getLogger(__name__)

FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit, trio.Cancelled)
# Log lines quote at most this much of an exception's text (it may carry peer bytes).
MAX_REASON_CHARS = 200

P = ParamSpec("P")


def split_fatal(exc: BaseException) -> tuple[BaseException | None, BaseException | None]:
    """(what must propagate, what the guard judges); either may be None."""
    if isinstance(exc, BaseExceptionGroup):
        fatal, rest = exc.split(FATAL)
        return fatal, rest
    if isinstance(exc, FATAL):
        return exc, None
    return None, exc


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def verdict(exc: BaseException) -> tuple[int, int, str]:
    """(penalty points, log level, reason) for what escaped a handler."""
    leaves = _leaves(exc)
    points, level = 0, logging.DEBUG
    reasons = []
    for leaf in leaves:
        if isinstance(leaf, StreamError):
            leaf_points, leaf_level = 0, logging.DEBUG
        elif isinstance(leaf, UnsupportedVersion):
            leaf_points, leaf_level = 0, logging.INFO
        elif isinstance(leaf, BadMessage | trio.TooSlowError):
            leaf_points, leaf_level = 1, logging.INFO
        elif isinstance(leaf, ProtocolError):
            leaf_points, leaf_level = 0, logging.INFO
        else:
            leaf_points, leaf_level = 1, logging.WARNING
        points, level = max(points, leaf_points), max(level, leaf_level)
        text = str(leaf) or type(leaf).__name__
        if isinstance(leaf, trio.TooSlowError):
            text = "too slow (a deadline passed)"
        reasons.append(text if isinstance(leaf, ProtocolError) else f"{type(leaf).__name__}: {text}")
    return points, level, "; ".join(reasons)[:MAX_REASON_CHARS]


class Guard:
    """Runs peer-input handlers so that nothing a peer sends can take the node down."""

    def __init__(self, peers: PeerTable) -> None:
        self.peers = peers
        self.on_ban: Callable[[str], Awaitable[None]] | None = None
        """Called once a peer is banned (the host closes its connections)."""
        self.num_faults = 0
        """Exceptions and panics that escaped a handler (not counting ordinary refusals)."""

    def banned(self, peer_id: str) -> bool:
        return self.peers.is_banned(peer_id)

    async def punish(self, peer_id: str, reason: str, *, points: int = 1) -> bool:
        """Penalize ``peer_id``; a peer that earns a ban loses its connections. True if banned."""
        banned = False
        for _ in range(points):
            banned = self.peers.penalize(peer_id, reason) or banned
        if banned and self.on_ban is not None:
            await self.on_ban(peer_id)
        return banned

    async def judge(self, peer_id: str, what: str, exc: BaseException) -> None:
        """The verdict on an exception that escaped a handler of ``peer_id``'s input
        (``exc`` holds no fatal part: see ``split_fatal``)."""
        points, level, reason = verdict(exc)
        if level >= logging.WARNING:
            self.num_faults += 1
            logger.warning("%s from %s failed: %s", what, peer_id, reason, exc_info=exc)
        else:
            logger.log(level, "%s from %s: %s", what, peer_id, reason)
        if points:
            with trio.CancelScope(shield=True):  # the verdict stands even if we are being cancelled
                await self.punish(peer_id, f"{what}: {reason}", points=points)

    async def run(
        self, peer_id: str, what: str, handler: Callable[P, Awaitable[None]], *args: P.args, **kwargs: P.kwargs
    ) -> bool:
        """Run ``handler``; True if it returned, False if something escaped (already judged)."""
        try:
            await handler(*args, **kwargs)
        except BaseException as exc:  # the boundary: panics are BaseExceptions
            fatal, rest = split_fatal(exc)
            if rest is not None:
                await self.judge(peer_id, what, rest)
            if fatal is exc:
                raise
            if fatal is not None:
                raise fatal from None
            return False
        return True
