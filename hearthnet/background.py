"""Fire-and-forget coroutines that are not garbage-collected mid-flight.

`detach(coro)` schedules `coro` on the running loop and keeps a reference until it ends
(asyncio holds only weak references to tasks). For closing connections from synchronous
code (a reload closing what removed members hold open); exceptions are retrieved, never raised.
`cancel_and_wait(tasks, timeout_s)` stops background tasks within a bound (node shutdown).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

_RUNNING: set[asyncio.Task[Any]] = set()


def detach(coro: Coroutine[Any, Any, Any]) -> None:
    """Run `coro` in the background; its result or exception is discarded."""
    task = asyncio.get_running_loop().create_task(coro)
    _RUNNING.add(task)

    def done(t: asyncio.Task[Any]) -> None:
        _RUNNING.discard(t)
        if not t.cancelled():
            t.exception()  # retrieved: no "never retrieved" warning

    task.add_done_callback(done)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout_s: float
                          ) -> list[asyncio.Task[Any]]:
    """Cancel `tasks` and wait up to `timeout_s` for them to end; returns those still
    running (a task that swallowed its cancellation), for the caller to log and leave.

    Shutdown must be bounded (a node told to stop exits within its drain timeout): unlike
    ``gather`` or ``suppress(CancelledError): await t``, a task that ignores the cancel
    cannot hold the caller, and a cancellation of the caller itself is never swallowed.
    """
    tasks = list(tasks)
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, timeout_s))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: ended with an error while stopping, nobody waits
    return [t for t in pending if not t.done()]
