"""Waiting for a condition that changes only when some event fires (no polling)."""

from collections.abc import Callable

import trio


async def until(predicate: Callable[[], bool], events: Callable[[], list[trio.Event]]) -> None:
    """Re-check ``predicate`` at every change until it holds (bound it with a cancel scope).

    The events are taken before the check, so a change between check and wait still wakes us.
    """
    while True:
        pending = events()
        if predicate():
            return
        async with trio.open_nursery() as nursery:

            async def wake(event: trio.Event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            for event in pending:
                nursery.start_soon(wake, event)
