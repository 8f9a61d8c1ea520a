"""`Supervisor.stop` and `cancel_and_wait`: a node's shutdown is bounded even when a task
swallows its cancellation (it is logged and left, the node exits)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from structlog.testing import capture_logs

from hearthnet.background import cancel_and_wait
from hearthnet.node.supervise import Supervisor
from hearthnet.observability import Metrics


async def test_stop_ends_the_tasks_and_leaves_one_that_ignores_its_cancel():
    sup = Supervisor(Metrics())
    release = asyncio.Event()

    async def polite() -> None:
        await asyncio.Event().wait()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    sup.spawn("heartbeat", polite)
    sup.spawn("prepare", stubborn)
    await asyncio.sleep(0)  # both run up to their first await
    with capture_logs() as logs:
        stuck = await sup.stop(timeout_s=0.01)
    assert stuck == ["prepare"]
    (warned,) = [e for e in logs if e["event"] == "tasks_ignored_stop"]
    assert warned["tasks"] == ["prepare"]
    assert sup.health()["heartbeat"]["state"] == "stopped"
    release.set()
    assert await sup.stop() == []


async def test_cancel_and_wait_never_swallows_the_callers_own_cancel():
    async def deaf() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await asyncio.Event().wait()  # ignores the first cancel, not the second

    inner = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    waiting = asyncio.create_task(cancel_and_wait([inner], 3600))
    await asyncio.sleep(0)
    waiting.cancel()  # the stopping node itself is cancelled: it ends at once
    with pytest.raises(asyncio.CancelledError):
        await waiting
    inner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await inner
