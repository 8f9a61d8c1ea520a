"""Waiting on state, not on time: the timeout only bounds a broken run (issue 10 §7).

On a loaded 2-core machine any fixed sleep is either too short (a flake) or too long (a
slow suite); these poll a condition and return as soon as it holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_until(cond: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Poll `cond` on the event loop until it is truthy; `TimeoutError` naming `what`."""
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise TimeoutError(f"not within {timeout:g} s: {what}") from None


def wait_for(probe: Callable[[], T | None], what: str, timeout: float = 60.0,
             every: float = 0.05) -> T:
    """Call `probe` until it returns something other than None/False; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None and got is not False:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {what}")
        time.sleep(every)
