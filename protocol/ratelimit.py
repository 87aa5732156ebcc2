"""An upload cap shared by every bulk send of a node (a token bucket in trio time).

Volunteers' uplinks are often slow and shared with everything else they do; a node can be
told to send tensors at most so fast (``network.upload_limit_mbps``). Control traffic is
not limited: it is tiny, and delaying it would only delay pairing.

Each ``take(n)`` spends n tokens, refilled at ``bytes_per_s`` up to a one-second burst; a
taker that overdraws sleeps until its debt is paid, so concurrent senders share the rate
(each waits for the debt before it, in the order they came).
"""

import trio


class RateLimit:
    def __init__(self, bytes_per_s: float | None) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"a rate limit must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._tokens = bytes_per_s or 0.0
        self._last: float | None = None

    @classmethod
    def from_mbps(cls, mbps: float) -> "RateLimit":
        """Megabits per second as people quote their links; 0 means no limit."""
        return cls(mbps * 1e6 / 8 if mbps > 0 else None)

    async def take(self, nbytes: int) -> None:
        rate = self.bytes_per_s
        if rate is None:
            return
        now = trio.current_time()
        if self._last is not None:
            self._tokens = min(rate, self._tokens + (now - self._last) * rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await trio.sleep(-self._tokens / rate)


UNLIMITED = RateLimit(None)


class ChainedLimit(RateLimit):
    """Each take spends on every limit in turn: the tightest sets the pace."""

    def __init__(self, *limits: RateLimit) -> None:
        super().__init__(None)
        self._limits = limits

    async def take(self, nbytes: int) -> None:
        for limit in self._limits:
            await limit.take(nbytes)
