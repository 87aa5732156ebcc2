"""The upload cap, in trio's virtual time (an autojump clock: no real waiting)."""

import pytest
import trio
import trio.testing

from protocol.ratelimit import RateLimit

MB = 1_000_000


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_long_send_averages_the_rate_after_a_one_second_burst(autojump_clock: trio.testing.MockClock) -> None:
    limit = RateLimit.from_mbps(80)  # 10 MB/s
    started = trio.current_time()
    for _ in range(50):
        await limit.take(MB)
    # 50 MB at 10 MB/s, less the first second's burst.
    assert trio.current_time() - started == pytest.approx(4.0)


async def test_concurrent_senders_share_the_rate(autojump_clock: trio.testing.MockClock) -> None:
    limit = RateLimit(1 * MB)
    finished: list[float] = []

    async def sender() -> None:
        for _ in range(10):
            await limit.take(MB // 10)
        finished.append(trio.current_time())

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(sender)
    assert max(finished) - started == pytest.approx(2.0)  # 3 MB in all at 1 MB/s, one of them free


async def test_no_limit_never_waits(autojump_clock: trio.testing.MockClock) -> None:
    limit = RateLimit.from_mbps(0)
    started = trio.current_time()
    await limit.take(10**12)
    assert trio.current_time() == started


def test_a_bad_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="> 0"):
        RateLimit(-1.0)
    with pytest.raises(ValueError, match="> 0"):
        RateLimit(float("nan"))
