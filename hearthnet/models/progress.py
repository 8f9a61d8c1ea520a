"""The progress bar of long store operations (import, synth): tqdm on stderr, in bytes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm


@contextmanager
def progress_bar(total_bytes: int, what: str) -> Iterator[Any]:
    """A byte-counting bar (hidden when stderr is not a terminal); `.update(n)` advances it."""
    with tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, disable=not sys.stderr.isatty(), dynamic_ncols=True) as bar:
        yield bar
