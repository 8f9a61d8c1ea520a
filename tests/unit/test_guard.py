"""`NodeGuard`: the membership policy the daemon consults before any work (issue 7,
issue 10 §7): who is a member, which events are admitted and why not, who may call what,
TLS contexts per member-list version, reloads that apply or leave everything as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from hearthnet.config import load_config, parse_config
from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    ShardDescriptor,
    advertisement_payload,
)
from hearthnet.distributed_inference.placement.community import SERVED_MODELS
from hearthnet.errors import AuthError, ConfigError
from hearthnet.mesh.eventlog import Event, EventLog
from hearthnet.node.guard import NodeGuard, member_rows, read_state, remove_state, write_state
from hearthnet.observability import Metrics
from hearthnet.security import NodeKey

PEER, STRANGER = NodeKey.generate(), NodeKey.generate()


def _toml(data_dir: Path, *, members: str = "", extra: str = "", plaintext: bool = True) -> str:
    return (f'[node]\nid = "node-a"\ndata_dir = "{data_dir}"\n'
            f"[security]\ninsecure_plaintext = {str(plaintext).lower()}\n"
            f'[community]\nmin_trust = "trusted"\n{extra}'
            f'[[community.members]]\nnode_id = "node-b"\npublic_key = "{PEER.public_key_b64}"\n'
            f'trust = "trusted"\n{members}')


def _guard(tmp_path: Path, **kw: object) -> NodeGuard:
    path = tmp_path / "node-a.toml"
    path.write_text(_toml(tmp_path / "data", **kw))  # type: ignore[arg-type]
    return NodeGuard(load_config(path), Metrics())


def _event(tmp_path: Path, key: NodeKey, origin: str, type: str, payload: dict,
           sign: bool = True) -> Event:
    log = EventLog(tmp_path / f"{origin}-{type}.sqlite3", origin,
                   signer=key.sign if sign else None)
    try:
        return log.append(type, payload)
    finally:
        log.close()


def _ad(host: str) -> dict:
    d = ShardDescriptor.create(model_id="m", weights_sha256="ab" * 32, layer_range=(0, 3),
                               host=host, endpoint="wss://127.0.0.1:1", max_concurrent_streams=8)
    return advertisement_payload(d)


def test_the_node_itself_is_a_steward_member_and_bad_member_lists_are_config_errors(
        tmp_path: Path) -> None:
    key = NodeKey.generate()
    cfg = parse_config(_toml(tmp_path))
    rows = member_rows(cfg, key)
    assert [(r["node_id"], r["trust"]) for r in rows] == [("node-b", "trusted"),
                                                          ("node-a", "steward")]
    assert rows[1]["public_key"] == key.public_key_b64
    no_key = parse_config(_toml(tmp_path, members='[[community.members]]\nnode_id = "node-c"\n'))
    with pytest.raises(ConfigError, match="keys provision"):
        member_rows(no_key, key)
    wrong_own = parse_config(_toml(tmp_path, members=(
        f'[[community.members]]\nnode_id = "node-a"\npublic_key = "{PEER.public_key_b64}"\n')))
    with pytest.raises(ConfigError, match="not this node's key"):
        member_rows(wrong_own, key)


def test_admit_event_names_why_an_event_is_dropped(tmp_path: Path) -> None:
    g = _guard(tmp_path)
    own = g.key
    assert g.admit_event(_event(tmp_path, PEER, "node-b", ADVERTISED, _ad("node-b"))) is None
    assert g.admit_event(_event(tmp_path, PEER, "node-b", ADVERTISED, _ad("node-b"),
                                sign=False)) == "unsigned"
    assert g.admit_event(_event(tmp_path, STRANGER, "node-x", ADVERTISED,
                                _ad("node-x"))) == "unknown_origin"
    assert g.admit_event(_event(tmp_path, STRANGER, "node-b", ADVERTISED,
                                _ad("node-b"))) == "bad_signature"  # node-b's name, not key
    assert g.admit_event(_event(tmp_path, PEER, "node-b", ADVERTISED,
                                _ad("node-a"))) == "host_not_signer"
    assert g.admit_event(_event(tmp_path, PEER, "node-b", "experimental.nope",
                                {})) == "unknown_type"
    served = {"models": ["smollm2"]}
    assert g.admit_event(_event(tmp_path, PEER, "node-b", SERVED_MODELS,
                                served)) == "not_steward"
    g.stored_count = lambda origin, type: 10**9  # over any per-origin quota
    assert g.admit_event(_event(tmp_path, own, "node-a", ADVERTISED, _ad("node-a"))) == "quota"


def test_bus_calls_need_the_capabilitys_trust_and_refusals_are_counted(
        tmp_path: Path) -> None:
    g = _guard(tmp_path, members=(f'[[community.members]]\nnode_id = "node-g"\n'
                                  f'public_key = "{STRANGER.public_key_b64}"\n'
                                  f'trust = "guest"\n'),
               extra='bus_min_trust = { "status" = "guest" }\n')
    g.authorize_bus("chat", None)  # the local CLI
    g.authorize_bus("chat", "node-b")  # trusted >= min_trust
    g.authorize_bus("status", "node-g")  # the capability's own lower minimum
    with pytest.raises(AuthError) as e:
        g.authorize_bus("chat", "node-g")
    assert e.value.details["reason"] == "insufficient_trust" and "trusted" in e.value.message
    refused = g.metrics.registry.get_sample_value("hearthnet_auth_failures_total",
                                                  {"reason": "insufficient_trust"})
    assert refused == 1.0
    assert g.host_allowed("node-b") and not g.host_allowed("node-g")
    assert not g.host_allowed("node-x")


def test_tls_contexts_are_cached_per_member_list_version(tmp_path: Path) -> None:
    plain = _guard(tmp_path)
    assert plain.server_ssl() is None and plain.client_ssl("node-b") is None
    assert plain.gate() is None and plain.peer_of(object()) is None
    g = _guard(tmp_path, plaintext=False)
    first = g.client_ssl("node-b")
    assert first is not None and g.client_ssl("node-b") is first
    assert g.server_ssl() is g.server_ssl()
    with pytest.raises(AuthError):
        g.client_ssl("node-x")  # not a member: refused before dialling
    g.directory.replace([m.to_dict() for m in g.directory])  # a new member-list version
    assert g.client_ssl("node-b") is not first


def test_reload_applies_members_or_leaves_everything_as_it_was(tmp_path: Path) -> None:
    g = _guard(tmp_path)
    effects: list[int] = []
    g.on_reload.append(lambda: effects.append(len(g.directory)))
    path = tmp_path / "node-a.toml"
    good = path.read_text()
    path.write_text(good + f'[[community.members]]\nnode_id = "node-c"\n'
                           f'public_key = "{STRANGER.public_key_b64}"\ntrust = "member"\n')
    assert g.reload() and "node-c" in g.directory and effects == [3]
    path.write_text(good.replace('id = "node-a"', 'id = "node-z"'))  # another node's file
    assert not g.reload() and "node-c" in g.directory
    path.write_text("[node\n")  # not TOML
    assert not g.reload() and "node-c" in g.directory and effects == [3]


def test_state_file_round_trips_and_is_removed(tmp_path: Path) -> None:
    assert read_state(tmp_path) is None
    write_state(tmp_path, {"pid": 7, "admin": "ws://127.0.0.1:1"})
    assert read_state(tmp_path) == {"pid": 7, "admin": "ws://127.0.0.1:1"}
    (tmp_path / "node.json").write_text("[1, 2]")
    assert read_state(tmp_path) is None  # not a map: no state
    remove_state(tmp_path)
    remove_state(tmp_path)  # idempotent
    assert not (tmp_path / "node.json").exists()
