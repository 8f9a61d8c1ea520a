"""Marks shared by the suite's modules."""

from __future__ import annotations

import os

import pytest

IN_MAKE_BENCH = pytest.mark.skipif(
    os.environ.get("HEARTHNET_BENCH_TESTS") != "1",
    reason="a long run: `make bench` runs it (HEARTHNET_BENCH_TESTS=1), keeping `make test` "
           "within its 15 minutes on 2 cores")
