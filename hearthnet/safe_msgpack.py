"""msgpack decoding with limits for every peer-supplied message (issue 14 §8).

`unpackb(data, max_depth=...)` is `msgpack.unpackb(raw=False, strict_map_key=True)` plus a
nesting-depth check, so a 600-deep payload is refused with a `ValueError` at the door
instead of raising `RecursionError` in whatever walks it later (canonical encoding,
signature checks). The walk is iterative: it cannot overflow the stack itself.
"""

from __future__ import annotations

from typing import Any

import msgpack

MAX_DEPTH = 32
"""Deepest nesting of maps and arrays any HearthNet message needs (events, bus calls)."""


def unpackb(data: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Decode one msgpack object; `ValueError` when malformed or nested over `max_depth`."""
    obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    check_depth(obj, max_depth)
    return obj


def check_depth(obj: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise `ValueError` when `obj` nests maps/arrays deeper than `max_depth`."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > max_depth:
            raise ValueError(f"nesting deeper than {max_depth} levels")
        stack.extend((c, depth + 1) for c in children)
