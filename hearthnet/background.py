"""Fire-and-forget coroutines that are not garbage-collected mid-flight.

`detach(coro)` schedules `coro` on the running loop and keeps a reference until it ends
(asyncio holds only weak references to tasks). For closing connections from synchronous
code (a reload closing what removed members hold open); exceptions are retrieved, never raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
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
