"""msgpack in and out: the one encoder, the one canonical form, the one guarded decoder.

- `packb(obj)`: msgpack with ``use_bin_type=True``, as every HearthNet message is sent.
- `canonical(obj)` / `canonical_packb(obj)`: the deterministic form that is hashed and
  signed (event ids, event and OPEN signatures): maps with sorted ``str`` keys, tuples as
  lists, finite floats only, at most `MAX_DEPTH` deep. Both ends derive the same bytes
  whatever a dict's insertion order or a tuple-vs-list round trip: signatures check anywhere.
- `unpackb(data, max_depth=...)`, for peer input: `msgpack.unpackb(raw=False,
  strict_map_key=True)` plus a nesting-depth check, so a 600-deep payload is refused with a
  `ValueError` at the door instead of raising `RecursionError` in whatever walks it later.
  The walk is iterative: it cannot overflow the stack itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgpack

MAX_DEPTH = 32
"""Deepest nesting of maps and arrays any HearthNet message needs (events, bus calls)."""


def packb(obj: Any) -> bytes:
    """`obj` as msgpack (``bin`` for bytes, ``str`` for text)."""
    out = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def canonical(obj: Any, max_depth: int = MAX_DEPTH) -> Any:
    """`obj` with maps' keys sorted and tuples as lists, so msgpack encodes it one way.

    Raises:
        ValueError: a value msgpack cannot carry portably (only None, bool, int, finite
            float, str, bytes, lists/tuples and str-keyed maps are allowed), or nesting
            deeper than `max_depth`.
    """
    return _canonical(obj, 1, max_depth)


def canonical_packb(obj: Any) -> bytes:
    """The canonical msgpack bytes of `obj` (what is hashed and signed); `ValueError` as
    `canonical`, `OverflowError` for an int msgpack cannot hold."""
    return packb(canonical(obj))


def _canonical(obj: Any, depth: int, max_depth: int) -> Any:
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError("a non-finite float has no canonical form")
        return obj
    if depth > max_depth:
        raise ValueError(f"nesting deeper than {max_depth} levels")
    if isinstance(obj, (list, tuple)):
        return [_canonical(x, depth + 1, max_depth) for x in obj]
    if isinstance(obj, Mapping):
        if not all(isinstance(k, str) for k in obj):
            raise ValueError("map keys must be strings")
        return {k: _canonical(obj[k], depth + 1, max_depth) for k in sorted(obj)}
    raise ValueError(f"a {type(obj).__name__} has no canonical msgpack form")


def unpackb(data: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Decode one msgpack object; `ValueError` when malformed or nested over `max_depth`
    (and never anything else: msgpack's own `UnpackException`s are ValueErrors here)."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except msgpack.UnpackException as e:
        raise ValueError(f"malformed msgpack: {e}") from e
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
