"""argparse types shared by the CLI's commands and the benchmarks (which sit below the
CLI and may not import it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """argparse type of a count that must be ≥ `low` (tokens, runs, threads, shards): a bad
    one is argparse's one-line usage error before anything starts, not a node refusing its
    config after the mesh was launched."""
    def count(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be ≥ {low}, not {n}")
        return n
    return count


def number_in(low: float, high: float, unit: str = "") -> Callable[[str], float]:
    """argparse type of a number in (`low`, `high`] (a fraction, a duration in `unit`): a
    bad one is a usage error before anything starts."""
    suffix = f" {unit}" if unit else ""

    def number(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number"
                                             + (f" of {unit}" if unit else "")) from None
        if not low < v <= high:
            raise argparse.ArgumentTypeError(f"must be in ({low:g}, {high:g}]{suffix}, "
                                             f"not {v:g}")
        return v
    return number


positive = at_least(1)
decode_tokens = at_least(2)  # a decode rate is measured between the first and a later token
