"""Liveness and penalties, on virtual time."""

import trio

from protocol.net.peers import BAN_POINTS, BAN_S, PENALTY_DECAY_S, PeerTable


async def test_peer_expires_after_ttl(autojump_clock: trio.testing.MockClock) -> None:
    table = PeerTable(ttl_s=3.0)
    assert table.seen("a") is True
    assert table.seen("a") is False
    await trio.sleep(2.9)
    assert table.is_live("a")
    assert table.expire() == []
    await trio.sleep(0.2)
    assert not table.is_live("a")
    assert table.expire() == ["a"]
    assert table.expire() == []  # reported once
    assert table.seen("a") is True  # back again


async def test_goodbye_ends_liveness_at_once(autojump_clock: trio.testing.MockClock) -> None:
    table = PeerTable(ttl_s=3.0)
    table.seen("a")
    table.gone("a")
    assert table.live() == {}


async def test_repeated_misbehaviour_bans_for_a_while(autojump_clock: trio.testing.MockClock) -> None:
    table = PeerTable(ttl_s=3.0)
    table.seen("a")
    for _ in range(BAN_POINTS - 1):
        assert table.penalize("a", "garbage") is False
    assert not table.is_banned("a")
    assert table.penalize("a", "garbage") is True
    assert table.is_banned("a")
    table.seen("a")
    assert not table.is_live("a")  # a banned peer is not counted, even if it keeps talking
    await trio.sleep(BAN_S + 1)
    assert not table.is_banned("a")


async def test_changes_wake_waiters(autojump_clock: trio.testing.MockClock) -> None:
    table = PeerTable(ttl_s=3.0)
    woke = trio.Event()

    async def waiter() -> None:
        await table.changed.wait()
        woke.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        table.seen("a")
    assert woke.is_set()


async def test_penalties_are_forgiven_slowly_so_rare_slips_never_ban(autojump_clock: trio.testing.MockClock) -> None:
    table = PeerTable(ttl_s=3.0)
    for _ in range(3 * BAN_POINTS):  # a slip every decay period: never a ban
        assert table.penalize("a", "timed out") is False
        await trio.sleep(PENALTY_DECAY_S)
    assert table.penalty("a") == 0
    for _ in range(BAN_POINTS - 1):  # a burst still bans
        table.penalize("a", "garbage")
    await trio.sleep(PENALTY_DECAY_S / 2)
    assert table.penalize("a", "garbage") is True
