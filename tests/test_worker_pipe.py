"""The daemon's end of a worker's pipe (node/supervisor.py WorkerConnection): checkpoint
``saved`` messages taken while a round's exchange goes on, nothing lost, one reader at a time."""

from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from node.supervisor import WorkerConnection
from training import ipc


def connection() -> tuple[WorkerConnection, trio.abc.SendStream, list[dict[str, Any]], trio.Event]:
    send, receive = trio.testing.memory_stream_one_way_pair()
    worker = WorkerConnection(SimpleNamespace(stdout=receive))  # type: ignore[arg-type]
    offered: list[dict[str, Any]] = []
    got_one = trio.Event()

    async def on_saved(message: dict[str, Any]) -> None:
        offered.append(message)
        got_one.set()

    worker.on_saved = on_saved
    return worker, send, offered, got_one


async def test_a_checkpoint_saved_during_an_exchange_is_taken_at_once_and_the_next_message_kept() -> None:
    """Before, a ``saved`` that came after a round's ``round_done`` waited behind that round's
    exchange (pairing may wait seconds): a joiner waiting for that offer waited with it."""
    worker, send, offered, got_one = connection()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.saved_meanwhile)
        await send.send_all(ipc.encode("saved", {"round": 2, "save_error": None}))
        with trio.fail_after(5):
            await got_one.wait()  # while the "exchange" (this test) has not read a thing
        assert [m["round"] for m in offered] == [2]
        await send.send_all(ipc.encode("outer_done", {"round": 3}))
    with trio.fail_after(5):  # saved_meanwhile ended at it, and kept it
        assert (await worker.receive())["t"] == "outer_done"


async def test_an_exchange_may_receive_while_saved_messages_are_taken_and_a_cancel_loses_nothing() -> None:
    worker, send, offered, _ = connection()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.saved_meanwhile)
        await trio.testing.wait_all_tasks_blocked()
        got: list[dict[str, Any]] = []

        async def exchange_receives() -> None:  # as DiLoCo's exchange reads "accumulated"
            got.append(await worker.receive())

        nursery.start_soon(exchange_receives)
        await trio.testing.wait_all_tasks_blocked()
        await send.send_all(ipc.encode("accumulated", {"round": 3}))
    assert [m["t"] for m in got] == ["accumulated"] and offered == []
    # Cancelled while waiting for bytes: what comes later is all there for ``receive``.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.saved_meanwhile)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    await send.send_all(ipc.encode("saved", {"round": 3, "save_error": None}) + ipc.encode("round_done", {"round": 4}))
    with trio.fail_after(5):
        assert (await worker.receive())["t"] == "round_done"
    assert [m["round"] for m in offered] == [3]


async def test_what_an_exchange_raises_beside_the_taking_comes_out_as_itself() -> None:
    """The supervisor catches ``WorkerGone`` and ``RestartWorker`` by type: an exception group
    around them (trio's nurseries make one) would take the daemon down instead."""
    from node.supervisor import RestartWorker, WorkerGone

    worker, send, _, _ = connection()
    for raised in (WorkerGone("worker's pipe broke"), RestartWorker("drifted")):

        async def exchange(raised: Exception = raised) -> None:
            await trio.testing.wait_all_tasks_blocked()
            raise raised

        try:
            await worker.while_taking_saved(exchange)
        except (WorkerGone, RestartWorker) as exc:
            assert exc is raised
        else:
            raise AssertionError("nothing raised")
    # The pipe breaking while only the taking reads: raised where the session reads next.
    await send.aclose()
    await worker.while_taking_saved(trio.testing.wait_all_tasks_blocked)
    try:
        await worker.receive()
    except WorkerGone as exc:
        assert "exited" in str(exc)
    else:
        raise AssertionError("nothing raised")


async def test_a_cancel_from_outside_comes_out_as_one_cancelled() -> None:
    """It reaches the exchange and the taking both: one ``Cancelled`` comes out, as from a
    lone task, not a group an ``except trio.Cancelled`` above would miss."""
    worker, _, _, _ = connection()
    caught: list[BaseException] = []
    with trio.CancelScope() as scope:

        async def cancelled_from_outside() -> None:
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await trio.sleep_forever()

        try:
            await worker.while_taking_saved(cancelled_from_outside)
        except trio.Cancelled as exc:
            caught.append(exc)
            raise
    assert scope.cancelled_caught and len(caught) == 1


async def test_an_offer_that_fails_during_an_exchange_is_raised_at_the_next_receive() -> None:
    """The exchange ends as it would (a partner waits on it); the offer's error comes out
    where the session reads next."""
    worker, send, _, _ = connection()
    broken = PermissionError("an offer's link")

    async def offer_fails(message: dict[str, Any]) -> None:
        raise broken

    worker.on_saved = offer_fails
    exchanged = []

    async def exchange_goes_on() -> None:
        await send.send_all(ipc.encode("saved", {"round": 5, "save_error": None}))
        await trio.testing.wait_all_tasks_blocked()
        exchanged.append(True)

    await worker.while_taking_saved(exchange_goes_on)
    assert exchanged
    try:
        await worker.receive()
    except PermissionError as exc:
        assert exc is broken
    else:
        raise AssertionError("nothing raised")
