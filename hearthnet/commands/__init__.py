"""Command-line command groups."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """argparse type of a count that must be ≥ 1 (tokens, runs, threads, shards): a bad one
    is argparse's one-line usage error before anything starts, not a node refusing its
    config after the mesh was launched."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, not {n}")
    return n
