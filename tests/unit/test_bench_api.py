"""`hearthnet bench api`'s figures from token arrival times (the mesh run is `make bench`)."""

from __future__ import annotations

import pytest

from hearthnet.bench.api import _figures
from hearthnet.errors import HearthNetError


def test_figures_from_arrivals():
    f = _figures(10.0, [10.5, 10.6, 10.7, 11.0])
    assert f["first_token_ms"] == pytest.approx(500.0)
    assert f["tokens_per_second"] == pytest.approx(3 / 0.5)
    assert f["gap_p50_ms"] == pytest.approx(100.0) and f["gap_p95_ms"] == pytest.approx(300.0)
    with pytest.raises(HearthNetError):
        _figures(0.0, [1.0])
