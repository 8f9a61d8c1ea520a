"""`run(main)`: the event loop every HearthNet process runs on — uvloop where installed.

No torch here: the command line's calls to a node start their loop without loading it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` on uvloop when it is installed, else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main)
    return uvloop.run(main)
