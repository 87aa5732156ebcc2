"""The boundary rule: what escapes a handler is judged; only what must end the program passes."""

import pytest
import trio

from protocol.errors import BadMessage, StreamError, UnsupportedVersion
from protocol.net.guard import Guard, split_fatal
from protocol.net.peers import BAN_POINTS, PeerTable

PEER = "12D3KooWRQR6dEJXaYFpJcVNJ2gCWNScK5th5Cp4oFTyJnM2bvKx"


class NativePanic(BaseException):
    """Like pyo3's PanicException: a BaseException, not an Exception."""


def raising(exc: BaseException):  # type: ignore[no-untyped-def]
    async def handler() -> None:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("exc", "points"),
    [
        (BadMessage("bad"), 1),
        (trio.TooSlowError(), 1),
        (NativePanic("yrs panicked"), 1),
        (ValueError("a bug a peer's bytes reached"), 1),
        (StreamError("reset by peer"), 0),
        (UnsupportedVersion("v2, we speak v1"), 0),
        (ExceptionGroup("two", [StreamError("a"), BadMessage("b")]), 1),
    ],
)
async def test_what_escapes_is_judged_and_swallowed(exc: BaseException, points: int) -> None:
    guard = Guard(PeerTable(ttl_s=10))
    assert await guard.run(PEER, "test", raising(exc)) is False
    assert guard.peers.penalty(PEER) == points


async def test_a_handler_that_returns_is_not_judged() -> None:
    guard = Guard(PeerTable(ttl_s=10))

    async def fine() -> None:
        await trio.lowlevel.checkpoint()

    assert await guard.run(PEER, "test", fine) is True
    assert guard.peers.penalty(PEER) == 0


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)])
async def test_what_must_end_the_program_passes_through(exc: BaseException) -> None:
    guard = Guard(PeerTable(ttl_s=10))
    with pytest.raises(type(exc)):
        await guard.run(PEER, "test", raising(exc))
    assert guard.peers.penalty(PEER) == 0


async def test_cancellation_passes_through_and_the_peer_is_not_blamed() -> None:
    guard = Guard(PeerTable(ttl_s=10))
    with trio.move_on_after(0.01) as scope:
        await guard.run(PEER, "test", trio.sleep_forever)
    assert scope.cancelled_caught
    assert guard.peers.penalty(PEER) == 0


async def test_a_group_is_split_the_fatal_part_goes_on_the_rest_is_judged() -> None:
    guard = Guard(PeerTable(ttl_s=10))
    with pytest.raises(BaseExceptionGroup) as caught:
        await guard.run(PEER, "test", raising(BaseExceptionGroup("mixed", [KeyboardInterrupt(), NativePanic("p")])))
    assert [type(e) for e in caught.value.exceptions] == [KeyboardInterrupt]
    assert guard.peers.penalty(PEER) == 1


def test_split_fatal_of_a_plain_exception() -> None:
    panic = NativePanic("p")
    assert split_fatal(panic) == (None, panic)
    interrupt = KeyboardInterrupt()
    assert split_fatal(interrupt) == (interrupt, None)


async def test_the_ban_hook_runs_once_the_threshold_is_reached() -> None:
    guard = Guard(PeerTable(ttl_s=10))
    banned: list[str] = []

    async def on_ban(peer_id: str) -> None:
        banned.append(peer_id)

    guard.on_ban = on_ban
    for _ in range(BAN_POINTS):
        await guard.run(PEER, "test", raising(BadMessage("bad")))
    assert banned == [PEER] and guard.banned(PEER)


def test_peers_compare_the_versions_that_must_match() -> None:
    from node.versions import our_versions
    from protocol.runstate.info import NodeInfo

    ours = our_versions()
    older = NodeInfo("p", "trainer", (), "swarmtrain/0.0.9", {**ours, "run-document": 2})
    assert older.incompatible(ours) == [f"run-document: theirs 2, ours {ours['run-document']}"]
    assert NodeInfo("p", "trainer", (), "swarmtrain/0.0.1").incompatible(ours) == []  # says nothing: no verdict
