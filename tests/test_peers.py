"""Liveness and penalties, on virtual time."""

import trio

from protocol.net.peers import BAN_POINTS, BAN_S, FORGET_S, PENALTY_DECAY_S, PeerTable


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


async def test_a_peer_that_announced_rarer_heartbeats_stays_live_that_long(
    autojump_clock: trio.testing.MockClock,
) -> None:
    table = PeerTable(ttl_s=3.0)
    table.seen("a", ttl_s=10.0)
    await trio.sleep(9.9)
    assert table.is_live("a")
    table.seen("a")  # a sync, say: the announced TTL holds until a heartbeat says otherwise
    await trio.sleep(9.9)
    assert table.is_live("a")
    await trio.sleep(0.2)
    assert table.expire() == ["a"]


async def test_silent_peers_are_forgotten_but_not_their_penalties(autojump_clock: trio.testing.MockClock) -> None:
    """Under churn the table met every peer of days of a run: it keeps the live, the
    penalized and the banned, not the rest."""
    table = PeerTable(ttl_s=3.0)
    for peer in ("quiet", "penalized", "banned"):
        table.seen(peer)
    await trio.sleep(FORGET_S)
    table.penalize("penalized", "garbage")  # silent since, their points and ban still count
    for _ in range(BAN_POINTS):
        table.penalize("banned", "garbage")
    await trio.sleep(4.0)
    table.expire()
    assert table.num_known() == 2 and table.penalty("penalized") == 1 and table.is_banned("banned")
    await trio.sleep(BAN_S)  # the point forgiven, the ban over: nothing left to keep
    table.expire()
    assert table.num_known() == 0


async def test_a_goodbye_or_a_ban_ends_an_announced_ttl(autojump_clock: trio.testing.MockClock) -> None:
    table = PeerTable(ttl_s=3.0)
    for end in (table.gone, lambda peer: [table.penalize(peer, "garbage") for _ in range(BAN_POINTS)]):
        table.seen("a", ttl_s=100.0)
        end("a")
        await trio.sleep(BAN_S + 1)  # past a ban
        table.seen("a")  # a sync, not a heartbeat: the table's TTL again, not the one announced before
        await trio.sleep(3.1)
        assert not table.is_live("a")
