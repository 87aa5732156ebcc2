"""libp2p's relay client renews our relay slots (protocol/net/libp2p_fixes.py, fix 9): with
pauses between the tries of a failing renewal, on virtual time."""

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2 import transport as relay_transport

from protocol import keys
from protocol.net import libp2p_fixes

START = 1_000_000.0  # the wall clock at the test's start (a slot's expiry is wall time)
TTL_S = 900.0


class Transport:
    """What the refresher touches of a ``CircuitV2Transport``."""

    def __init__(self, relays: dict[ID, float], renew: Any) -> None:
        self._reservations = dict(relays)
        self._reservation_proofs = {r: object() for r in relays}
        self._refreshing = True
        self.tries: list[tuple[ID, float]] = []
        self._renew = renew
        self.stop_after: tuple[int, trio.CancelScope] | None = None

        async def new_stream(relay: ID, protocols: list[str]) -> Any:
            self.tries.append((relay, trio.current_time()))
            if self.stop_after is not None and len(self.tries) >= self.stop_after[0]:
                self.stop_after[1].cancel()
            return await self._renew(self, relay)

        self.host = SimpleNamespace(new_stream=new_stream)

    async def _make_reservation(self, stream: Any, relay: ID) -> bool:
        self._reservations[relay] = wall() + TTL_S
        return True


def wall() -> float:
    return START + trio.current_time()


def relay(n: int) -> ID:
    return ID.from_base58(keys.peer_id_of(bytes([n]) * 32))


@pytest.fixture(autouse=True)
def virtual_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both libp2p's refresher and ours read the wall clock: make it follow trio's.
    monkeypatch.setattr(relay_transport, "time", SimpleNamespace(time=wall))
    monkeypatch.setattr(libp2p_fixes, "_wall", wall)


async def refresh_until(transport: Transport, stop_at_s: float, *, most_tries: int) -> None:
    """Run the refresher until ``stop_at_s`` (virtual) or its ``most_tries``-th try (a
    refresher trying again without a pause never lets virtual time move)."""
    with trio.move_on_after(stop_at_s) as scope:
        transport.stop_after = (most_tries, scope)
        await relay_transport.CircuitV2Transport._refresh_reservations_worker(transport)  # type: ignore[arg-type]


async def test_a_failing_renewal_is_tried_again_after_a_pause_until_the_slot_expires(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Seen before the fix: 9,945 tries in the last 30 s of a slot whose relay was gone."""
    gone = relay(1)

    async def refused(transport: Transport, relay: ID) -> Any:
        raise OSError("connection refused")

    transport = Transport({gone: START + 60.0}, refused)
    await refresh_until(transport, 120.0, most_tries=1000)
    times = [t for _, t in transport.tries]
    # Due at 30 s (the 30 s margin); then 1, 2, 4, 8, 8 ... s apart until it expires at 60 s.
    assert times == pytest.approx([30.0, 31.0, 33.0, 37.0, 45.0, 53.0])
    assert gone not in transport._reservations and gone not in transport._reservation_proofs
    assert not transport._refreshing  # the last slot gone: it stopped (libp2p restarts it at the next)


async def test_renewals_are_spaced_even_where_a_relay_grants_slots_shorter_than_the_margin(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A relay answering each renewal with a 10 s slot would get renewals back to back."""
    short = relay(2)

    async def granted(transport: Transport, relay: ID) -> Any:
        transport._reservations[relay] = wall() + 10.0
        return SimpleNamespace(close=trio.lowlevel.checkpoint)

    async def make(stream: Any, relay: ID) -> bool:
        return True

    transport = Transport({short: START + 10.0}, granted)
    transport._make_reservation = make  # type: ignore[method-assign]
    await refresh_until(transport, 60.0, most_tries=1000)
    assert len(transport.tries) <= 1 + 60 // libp2p_fixes.MIN_RENEW_GAP_S, len(transport.tries)
    assert short in transport._reservations  # renewed all along


async def test_a_slot_added_while_it_sleeps_is_renewed_in_time(autojump_clock: trio.testing.MockClock) -> None:
    """The refresher slept until the soonest slot it had: a shorter slot reserved meanwhile
    expired unrenewed."""
    long_slot, short_slot = relay(3), relay(4)

    async def granted(transport: Transport, relay: ID) -> Any:
        return SimpleNamespace(close=trio.lowlevel.checkpoint)

    transport = Transport({long_slot: START + TTL_S}, granted)

    async def reserve_later() -> None:
        await trio.sleep(5.0)
        transport._reservations[short_slot] = wall() + 60.0  # as libp2p's reserve() writes it

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reserve_later)
        await refresh_until(transport, 120.0, most_tries=1000)
    assert [r for r, _ in transport.tries][:1] == [short_slot]
    assert transport._reservations[short_slot] > wall()  # renewed before it expired


async def test_a_slot_forgotten_while_another_is_renewed_is_not_renewed_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """protocol/net/nat.py forgets a slot on a relay we lost; a renewal then wrote it back."""
    first, lost = relay(5), relay(6)

    async def slow(transport: Transport, relay: ID) -> Any:
        if relay == first:
            transport._reservations.pop(lost, None)  # forgotten while this renewal runs
            transport._reservation_proofs.pop(lost, None)
            await trio.sleep(3.0)
        return SimpleNamespace(close=trio.lowlevel.checkpoint)

    transport = Transport({first: START + 60.0, lost: START + 60.0}, slow)
    await refresh_until(transport, 40.0, most_tries=1000)
    assert [r for r, _ in transport.tries] == [first]
    assert lost not in transport._reservations


async def test_a_renewal_that_hangs_is_given_up_and_its_stream_reset(autojump_clock: trio.testing.MockClock) -> None:
    """A relay that takes the stream and never answers: libp2p's read would time out at
    15 s; ours cuts the renewal first, and left the stream open (a yamux stream slot each)."""
    hanging = relay(7)
    streams: list[Any] = []

    async def stream_of(transport: Transport, relay: ID) -> Any:
        async def reset() -> None:
            streams[-1].reset_called = True

        streams.append(SimpleNamespace(close=trio.lowlevel.checkpoint, reset=reset, reset_called=False))
        return streams[-1]

    async def never(stream: Any, relay: ID) -> bool:
        await trio.sleep_forever()
        return True

    transport = Transport({hanging: START + 60.0}, stream_of)
    transport._make_reservation = never  # type: ignore[method-assign]
    await refresh_until(transport, 50.0, most_tries=1000)
    times = [t for _, t in transport.tries]
    assert times == pytest.approx([30.0, 30.0 + libp2p_fixes.RENEW_TIMEOUT_S + libp2p_fixes.RENEW_RETRY_S[0]])
    assert all(s.reset_called for s in streams[:1]), streams
