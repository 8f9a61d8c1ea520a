"""The placement events and their read model (issue 17), and mDNS peer parsing."""

from __future__ import annotations

import pytest

from hearthnet.config import parse_config
from hearthnet.distributed_inference.placement.community import (
    CAPACITY,
    CLAIM,
    SERVED_MODELS,
    PlacementView,
    ServedModel,
    capacity_payload,
    claim_payload,
    served_payload,
)
from hearthnet.errors import ConfigError
from hearthnet.mesh.discovery import peer_from_service
from hearthnet.mesh.eventlog import EventLog

SHA = "ab" * 32


@pytest.fixture
def clock():
    return [1000.0]


@pytest.fixture
def log(tmp_path, clock):
    def make(node: str) -> EventLog:
        return EventLog(tmp_path / f"{node}.sqlite3", node, clock=lambda: clock[0])
    return make


def _claim(lo: int, hi: int, **kw):
    return claim_payload(model_id="m", weights_sha256=SHA, lo=lo, hi=hi, speed=2.0,
                         max_layers=10, reason=kw.pop("reason", "initial"), **kw)


def test_only_a_stewards_served_list_counts(log):
    view = PlacementView(lambda origin: origin == "steward")
    served = served_payload([ServedModel("org/m", SHA, "m")])
    assert not view.apply(log("mallory").append(SERVED_MODELS, served))
    assert view.served() == []
    assert view.apply(log("steward").append(SERVED_MODELS, served))
    assert view.served() == [ServedModel("org/m", SHA, "m")]
    assert view.served_meta()["set_by"] == "steward"


def test_newest_served_list_wins(log, clock):
    view = PlacementView(lambda origin: True)
    s = log("steward")
    view.apply(s.append(SERVED_MODELS, served_payload([ServedModel("a", SHA, "a")])))
    clock[0] += 1
    view.apply(s.append(SERVED_MODELS, served_payload([])))
    assert view.served() == []


def test_malformed_events_are_ignored(log):
    view = PlacementView(lambda origin: True)
    x = log("x")
    assert not view.apply(x.append(SERVED_MODELS, {"models": [{"model_id": "a"}]}))
    assert not view.apply(x.append(CLAIM, {**_claim(0, 3), "layer_range": [5, 1]}))
    assert not view.apply(x.append(CLAIM, {**_claim(0, 3), "reason": "because"}))
    assert not view.apply(x.append(CAPACITY, {"models": {"m": {"speed": -1}}}))
    assert view.claims("m") == [] and view.served() == []


def test_claims_pending_cancelled_and_expiring(log, clock):
    view = PlacementView(lambda origin: True, clock=lambda: clock[0])
    a, b = log("a"), log("b")
    view.apply(a.append(CLAIM, _claim(0, 9)))
    view.apply(b.append(CLAIM, _claim(10, 19, reason="rehost")))
    assert [(c.origin, c.lo) for c in view.pending("m", 60)] == [("a", 0), ("b", 10)]
    view.apply(a.append(CLAIM, _claim(0, 9, state="cancelled")))
    assert [c.origin for c in view.pending("m", 60)] == ["b"]
    assert view.last("rehost").origin == "b"
    clock[0] += 61
    assert view.pending("m", 60) == []


def test_capacities_are_fresh_only(log, clock):
    view = PlacementView(lambda origin: True, clock=lambda: clock[0])
    view.apply(log("a").append(CAPACITY, capacity_payload({"m": (3.0, 12)})))
    caps = view.capacities("m", 30)
    assert caps["a"].speed == 3.0 and caps["a"].max_layers == 12
    clock[0] += 31
    assert view.capacities("m", 30) == {}


def test_peer_from_service():
    props = {b"id": b"node-b", b"scheme": b"wss"}
    assert peer_from_service(props, ["10.0.0.2"], 7700) == ("node-b", "wss://10.0.0.2:7700")
    assert peer_from_service(props, ["fe80::1"], 7700) == ("node-b", "wss://[fe80::1]:7700")
    assert peer_from_service({b"id": b"Bad Id"}, ["10.0.0.2"], 7700) is None
    assert peer_from_service({b"id": b"b", b"scheme": b"http"}, ["10.0.0.2"], 1) is None
    assert peer_from_service(props, [], 7700) is None


def test_auto_shards_config():
    cfg = parse_config('shards = "auto"\n[node]\nid = "a"\ndiscovery = "mdns"\n'
                       "[research]\nenable = true\n[research.distributed_inference]\n"
                       "enabled = true\n[research.distributed_inference.host]\n"
                       "serve_shards = true\n[research.distributed_inference.auto]\n"
                       "memory_mb = 300\nbalance_quality = 0.8\n")
    assert cfg.auto_hosting and cfg.hosted_shards() == [] and cfg.warnings() == []
    assert cfg.di.auto.memory_mb == 300 and cfg.node.discovery == "mdns"
    with pytest.raises(ConfigError, match='shards: must be "auto"'):
        parse_config('shards = "some"\n[node]\nid = "a"\n')
    with pytest.raises(ConfigError, match="balance_quality"):
        parse_config('[node]\nid = "a"\n[research.distributed_inference.auto]\n'
                     "balance_quality = 2\n")
    off = parse_config('shards = "auto"\n[node]\nid = "a"\n')
    assert not off.auto_hosting and "serves no shards" in off.warnings()[0]
