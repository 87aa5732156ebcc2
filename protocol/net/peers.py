"""What we know about other peers that is not replicated: liveness and misbehaviour.

Liveness is ephemeral on purpose (see protocol/runstate/state.py): a peer is live while we heard
from it (a heartbeat, a sync, any valid message) within ``ttl_s``. Misbehaviour adds
penalty points; at ``BAN_POINTS`` the peer is banned for ``BAN_S`` and its streams and
gossip are ignored.
"""

import logging
import math
from dataclasses import dataclass

import trio

logger = logging.getLogger(__name__)

# One malformed message may be a bug on their side; five is a pattern.
PENALTY_POINTS = 1
BAN_POINTS = 5
BAN_S = 600.0
# A point is forgiven after this long: an honest peer's rare slip (a crash mid-round, a
# timeout on a bad link) never adds up to a ban over a long run; a pattern still does.
PENALTY_DECAY_S = 300.0
# A peer silent this long, holding no penalty and no ban, is forgotten: under churn the
# table would otherwise keep an entry for every peer ever met.
FORGET_S = 3600.0


@dataclass(slots=True)
class PeerStatus:
    last_seen: float = -math.inf
    first_seen: float = -math.inf
    penalty: int = 0
    penalized_at: float = -math.inf
    banned_until: float = -math.inf
    digest: str = ""
    role: str = ""
    ttl_s: float = 0.0
    """How long it is live after it was last heard; 0: the table's ``ttl_s`` (a heartbeat
    announcing a longer interval sets more: protocol/runstate/run.py)."""


class PeerTable:
    def __init__(self, *, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._peers: dict[str, PeerStatus] = {}
        self._changed = trio.Event()
        self.penalties_total = 0
        """Penalty points given since start (metrics)."""
        self.bans_total = 0
        """Bans since start (metrics)."""

    def _info(self, peer_id: str) -> PeerStatus:
        return self._peers.setdefault(peer_id, PeerStatus())

    def seen(
        self, peer_id: str, *, digest: str | None = None, role: str | None = None, ttl_s: float | None = None
    ) -> bool:
        """Record that ``peer_id`` is alive; True if it was not live before. ``ttl_s``: live
        this long from now on (its heartbeats come that rarely), until said otherwise."""
        now = trio.current_time()
        info = self._info(peer_id)
        was_live = self._is_live(info, now)
        if not was_live:
            info.first_seen = now
        info.last_seen = now
        if ttl_s is not None:
            info.ttl_s = ttl_s
        if digest is not None:
            info.digest = digest
        if role is not None:
            info.role = role
        if not was_live:
            self._notify()
        return not was_live

    def gone(self, peer_id: str) -> None:
        """The peer said goodbye: stop counting it as live right away."""
        info = self._peers.get(peer_id)
        if info is None:
            return
        info.ttl_s = 0.0  # its next heartbeat says again how long
        if info.last_seen > -math.inf:
            info.last_seen = -math.inf
            self._notify()

    def live(self) -> dict[str, PeerStatus]:
        now = trio.current_time()
        return {p: i for p, i in self._peers.items() if self._is_live(i, now)}

    def is_live(self, peer_id: str) -> bool:
        info = self._peers.get(peer_id)
        return info is not None and self._is_live(info, trio.current_time())

    def expire(self) -> list[str]:
        """Peers that fell silent since the last call (for logging and notification)."""
        now = trio.current_time()
        expired = [
            p
            for p, i in self._peers.items()
            if i.last_seen > -math.inf and not self._is_live(i, now) and i.first_seen > -math.inf
        ]
        for peer_id in expired:
            self._peers[peer_id].first_seen = -math.inf
        forgotten = [
            p
            for p, i in self._peers.items()
            if now - i.last_seen > FORGET_S + i.ttl_s and i.banned_until <= now and not self.penalty(p)
        ]
        for peer_id in forgotten:
            del self._peers[peer_id]
        if expired:
            self._notify()
        return expired

    def num_known(self) -> int:
        """Peers the table holds an entry for (live, silent, penalized or banned)."""
        return len(self._peers)

    def penalize(self, peer_id: str, reason: str) -> bool:
        """Add a penalty for bad input; True if the peer is now banned."""
        info = self._info(peer_id)
        now = trio.current_time()
        self._decay(info, now)
        info.penalty += PENALTY_POINTS
        info.penalized_at = now
        self.penalties_total += PENALTY_POINTS
        logger.warning("peer %s misbehaved (%s); penalty %d/%d", peer_id, reason, info.penalty, BAN_POINTS)
        if info.penalty >= BAN_POINTS:
            info.banned_until = trio.current_time() + BAN_S
            self.bans_total += 1
            info.penalty = 0
            info.last_seen = -math.inf
            info.ttl_s = 0.0
            logger.warning("peer %s banned for %.0f s", peer_id, BAN_S)
        self._notify()
        return info.banned_until > trio.current_time()

    def is_banned(self, peer_id: str) -> bool:
        info = self._peers.get(peer_id)
        return info is not None and info.banned_until > trio.current_time()

    def penalty(self, peer_id: str) -> int:
        info = self._peers.get(peer_id)
        if info is None:
            return 0
        self._decay(info, trio.current_time())
        return info.penalty

    @staticmethod
    def _decay(info: PeerStatus, now: float) -> None:
        if info.penalty and now > info.penalized_at:
            forgiven = int((now - info.penalized_at) // PENALTY_DECAY_S)
            if forgiven:
                info.penalty = max(0, info.penalty - forgiven)
                info.penalized_at += forgiven * PENALTY_DECAY_S

    @property
    def changed(self) -> trio.Event:
        """Set at the next change: take it before checking a condition, then wait on it."""
        return self._changed

    def _is_live(self, info: PeerStatus, now: float) -> bool:
        return now - info.last_seen <= max(self.ttl_s, info.ttl_s) and info.banned_until <= now

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
