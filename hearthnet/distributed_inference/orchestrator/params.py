"""A chat call's spec parameters (M26 §4.3): each one's exact JSON type and range.

Checked at the door (M26 §6 ``bad_request``), naming the field: ``"fallback_to_local": "no"``
is not true, ``"max_shards": 0`` is not a pipeline, ``"timeout_s": true`` is not a number.
A bool is only ``true``/``false``; an integer is never a bool or a float; a number is an
integer or a finite float. JSON ``null`` means "the node's default".

No torch: the HTTP API (`hearthnet.api.openai_compat`) checks a call's ``hearthnet`` field
with this table before any work, and the node checks the bus arguments with it again
(`request.DistributedChatParams.from_dict`). Names are checked by their owners
(`wire.check_wire_names`, `formats.check_policy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hearthnet.errors import BadRequest


@dataclass(frozen=True, slots=True)
class Rule:
    """One parameter's JSON type (``bool``, ``int``, ``float`` = any number, ``str``) and
    inclusive range."""

    kind: type
    lo: float | None = None
    hi: float | None = None

    def describe(self) -> str:
        what = {bool: "true or false", int: "an integer", float: "a number",
                str: "a string"}[self.kind]
        return what if self.lo is None else f"{what} in {self.lo:g}..{self.hi:g}"


MAX_NAME_CHARS = 64  # the longest wire dtype / weights policy name is far shorter

CALL_PARAMS: dict[str, Rule] = {
    "fallback_to_local": Rule(bool),
    "wire_dtype": Rule(str),
    "wire_wide_dtype": Rule(str),
    # the range of [research.distributed_inference] max_shards_per_request
    "max_shards": Rule(int, 1, 256),
    "timeout_s": Rule(float, 0.1, 600),
    "fallback_after_failures": Rule(int, 1, 256),
    "weights": Rule(str),
    "speculate": Rule(str),
}


def _typed(v: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(v, bool)
    if isinstance(v, bool):  # bool is an int subclass in Python, never in JSON
        return False
    if kind is int:
        return isinstance(v, int)
    if kind is float:
        return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))
    return isinstance(v, str) and len(v) <= MAX_NAME_CHARS


def check_value(name: str, v: Any, rule: Rule) -> Any:
    """`v` if it has `rule`'s exact type and range (an int as a float for ``float``).

    Raises:
        BadRequest: naming `name` (also as ``details["param"]``).
    """
    ok = _typed(v, rule.kind)
    if ok and rule.lo is not None and rule.hi is not None:
        ok = rule.lo <= v <= rule.hi
    if not ok:
        raise BadRequest(f"{name} must be {rule.describe()}, got {v!r}"[:200], param=name)
    return float(v) if rule.kind is float else v


def check_params(d: dict[str, Any], *, prefix: str) -> dict[str, Any]:
    """The spec parameters of `d`, each checked; ``null`` ones are left out (the default).

    Args:
        d: a map of parameter names to values, none of them unknown (the caller's check:
            the bus and the HTTP API accept different sets).
        prefix: how the caller's document names the map (``"params."``, ``"hearthnet."``).
    """
    return {k: check_value(prefix + k, v, CALL_PARAMS[k]) for k, v in d.items()
            if v is not None}


def unknown_keys(d: dict[Any, Any], known: set[str] | frozenset[str]) -> list[str]:
    """The keys of `d` not in `known`, as sorted strings (a map's keys may be of any type)."""
    return sorted(str(k)[:64] for k in d if k not in known)
