"""Node config: every example loads; bad files are refused naming file, key and reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from hearthnet.config import (
    NodeConfig,
    check_shard_layers,
    config_from_dict,
    load_config,
    parse_config,
)
from hearthnet.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "config").rglob("*.toml"))
MINIMAL = '[node]\nid = "node-x"\n'


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_config_loads(path: Path) -> None:
    cfg = load_config(path)
    # node-b.toml of a folder the machine runs is node <folder>-b: each folder has its own
    # ids (and so its own data dirs); compose's ids are its service names, one per container
    folder, letter = path.parent.name, path.stem.removeprefix("node-")
    assert cfg.node.id == (path.stem if folder == "compose" else f"{folder}-{letter}")
    assert cfg.source == path.resolve()


def test_examples_exist() -> None:
    names = {str(p.relative_to(REPO / "config")) for p in EXAMPLES}
    assert {"mesh3/node-a.toml", "mesh3/node-b.toml", "mesh3/node-c.toml",
            "mesh4/node-a.toml", "mesh4/node-b.toml", "mesh4/node-c.toml",
            "mesh4/node-d.toml"} <= names


def test_mesh3_layout() -> None:
    a, b, c = (load_config(REPO / "config" / "mesh3" / f"node-{n}.toml") for n in "abc")
    assert [x.node.listen_port for x in (a, b, c)] == [7701, 7702, 7703]
    assert a.hosted_shards() == [] and a.distributed_enabled
    assert [(s.model, s.layers) for s in b.hosted_shards()] == [("smollm2", (0, 14))]
    assert [(s.model, s.layers) for s in c.hosted_shards()] == [("smollm2", (15, 29))]
    # gossip chain A - B - C: A and C dial B
    assert a.node.peers == ["wss://127.0.0.1:7702"] == c.node.peers
    assert b.endpoint() == "wss://127.0.0.1:7702"  # secure by default (issue 7)
    d = load_config(REPO / "config" / "mesh4" / "node-d.toml")
    assert [s.layers for s in d.hosted_shards()] == [(10, 29)]


def test_defaults_are_the_spec_section_7_values() -> None:
    cfg = parse_config(MINIMAL)
    di = cfg.research.distributed_inference
    assert (di.enabled, di.max_shards_per_request,
            di.shard_health_timeout_seconds, di.fallback_to_local, di.activation_dtype,
            di.allow_self_as_shard, di.max_concurrent_pipelines) == \
        (False, 16, 30, True, "auto", False, 4)  # auto: issue 11 §2
    assert di.activation_wide_dtype == "bf16"
    assert (di.fallback_after_failures, di.flow_control_window, di.chunk_bytes) == \
        (2, 16, 1048576)
    assert (di.host.serve_shards, di.host.shard_eviction_idle_seconds,
            di.host.shard_max_vram_mb) == (False, 600, 20000)
    assert di.advertisement_expiry_s == 120 and di.heartbeat_interval_s == 15
    assert cfg.research.enable is False and not cfg.distributed_enabled
    assert not cfg.security.insecure_plaintext
    assert cfg.community.min_trust == "trusted"


@pytest.mark.parametrize("value", ["auto", "fp16", "bf16", "fp32"])
def test_activation_dtype_accepts_auto_and_every_wire_dtype(value: str) -> None:
    section = f'\n[research.distributed_inference]\nactivation_dtype = "{value}"\n'
    cfg = parse_config(MINIMAL + section)
    assert cfg.research.distributed_inference.activation_dtype == value


def test_activation_dtype_refuses_others() -> None:
    with pytest.raises(ConfigError):
        parse_config(MINIMAL + '\n[research.distributed_inference]\nactivation_dtype = "int8"\n')


BAD = [
    # (toml, key in message, words of the reason)
    ('[node]\nid = "node-x"\nlisten_prot = 1\n', "node.listen_prot", "unknown key"),
    ('[node]\nid = "Node X"\n', "node.id", "pattern"),
    ("[research]\nenable = true\n", "node", "required key is missing"),
    (MINIMAL + "[research.distributed_inference]\nactivation_dtype = 'bf8'\n",
     "research.distributed_inference.activation_dtype", "'bf16' or 'fp32'"),
    # the dead `backend` setting is gone (issue 10 §5): it selected nothing
    (MINIMAL + "[research.distributed_inference]\nbackend = 'small_model_layered'\n",
     "research.distributed_inference.backend", "unknown key"),
    (MINIMAL + "[research.distributed_inference]\nshard_health_timeout_seconds = 0\n",
     "research.distributed_inference.shard_health_timeout_seconds", "greater than 0"),
    (MINIMAL + "[research.distributed_inference.host]\nserve_shard = true\n",
     "research.distributed_inference.host.serve_shard", "allowed: compile_decode, compute_dtype"),
    (MINIMAL + "[[shards]]\nmodel = 'smollm2'\nlayers = [14, 0]\n", "shards[0].layers",
     "after last layer"),
    (MINIMAL + "[[shards]]\nmodel = 'smollm2'\nlayers = [-1, 3]\n", "shards[0].layers",
     ">= 0"),
    (MINIMAL + "[[shards]]\nmodel = 'smollm2'\nlayers = [0, 1, 2]\n", "shards[0].layers",
     "[first, last]"),
    (MINIMAL + "[[shards]]\nmodel = 'smollm2'\n", "shards[0].layers", "missing"),
    (MINIMAL + "[[shards]]\nmodel = 's'\nlayers = [0, 3]\n[[shards]]\nmodel = 's'\n"
     "layers = [0, 3]\n", "shards[1]", "listed twice"),
    ('[node]\nid = "node-x"\nlisten_port = 65536\n', "node.listen_port", "65535"),
    ('[node]\nid = "node-x"\nmetrics_port = -1\n', "node.metrics_port", "0"),
    ('[node]\nid = "node-x"\nlisten_port = "7701"\n', "node.listen_port", "integer"),
    ('[node]\nid = "node-x"\npeers = ["http://127.0.0.1:7702"]\n', "node.peers",
     "ws://host:port"),
    ('[node]\nid = "node-x"\npeers = ["ws://127.0.0.1"]\n', "node.peers", "port"),
    ('[node]\nid = "node-x"\nlisten_port = 7701\npeers = ["ws://127.0.0.1:7701"]\n',
     "node.peers[0]", "this node itself"),
    ('[node]\nid = "node-x"\nadvertise_host = "ws://10.0.0.2:7701"\n',
     "node.advertise_host", "bare host"),
    ('[node]\nid = "node-x"\nlan_networks = ["10.0.0.0/33"]\n', "node.lan_networks",
     "not a network"),
    ('[node]\nid = "node-x"\nlog_level = "loud"\n', "node.log_level", "info"),
    # two listeners of one node on one port: refused before the second bind fails mid-start
    ('[node]\nid = "node-x"\nlisten_port = 7701\nmetrics_port = 7701\n', "node.metrics_port",
     "also node.listen_port"),
    ('[node]\nid = "node-x"\nlisten_host = "0.0.0.0"\nlisten_port = 7701\n[api]\n'
     "listen_port = 7701\n", "api.listen_port", "also node.listen_port"),
    ('[node]\nid = "node-x"\nlisten_host = "0.0.0.0"\n[research]\nenable = true\n'
     "[research.distributed_inference]\nenabled = true\n"
     "[research.distributed_inference.host]\nserve_shards = true\n"
     "[[shards]]\nmodel = 's'\nlayers = [0, 3]\n", "node.advertise_host", "wildcard"),
    (MINIMAL + "[[community.members]]\nnode_id = 'node-b'\ntrust = 'boss'\n",
     "community.members[0].trust", "steward"),
    (MINIMAL + "[security]\ninsecure_plaintext = 'yes'\n", "security.insecure_plaintext",
     "boolean"),
    (MINIMAL + "[testing]\nfault = 1\n", "testing", "unknown key"),
    # fault injection lives under tests/ now: the old test-only table is an unknown key
    (MINIMAL + "[testing.faults]\nmode = 'nan'\n", "testing", "unknown key"),
    ("node = 3\n", "node", "must be a table"),
]


@pytest.mark.parametrize(("text", "key", "reason"), BAD, ids=[b[1] for b in BAD])
def test_bad_config_names_file_key_and_reason(tmp_path: Path, text: str, key: str,
                                              reason: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    err = ei.value
    assert err.code == "bad_config"
    assert err.file == str(path) and str(path) in err.message
    assert err.key == key and f"{key}:" in err.message
    assert err.reason is not None and reason in err.reason and reason in err.message


def test_invalid_toml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('[node]\nid = "node-x"\nlisten_port = = 1\n')
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert str(path) in ei.value.message
    assert "invalid TOML" in ei.value.message and "line 3" in ei.value.message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found") as ei:
        load_config(tmp_path / "nope.toml")
    assert ei.value.file == str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory


def test_declared_shards_are_inert_unless_every_switch_is_on() -> None:
    base = {"node": {"id": "node-b"},
            "shards": [{"model": "smollm2", "layers": [0, 14]}],
            "research": {"enable": True, "distributed_inference": {
                "enabled": True, "host": {"serve_shards": True}}}}
    assert len(config_from_dict(base).hosted_shards()) == 1
    assert config_from_dict(base).warnings() == []
    for path, why in ((("research", "enable"), "research.enable"),
                      (("research", "distributed_inference", "enabled"), "enabled"),
                      (("research", "distributed_inference", "host", "serve_shards"),
                       "serve_shards")):
        data = _with(base, path, False)
        cfg = config_from_dict(data)
        assert cfg.hosted_shards() == []
        assert any(why in w and "not served" in w for w in cfg.warnings())
    none = config_from_dict(_with(base, ("shards",), []))
    assert any("no [[shards]]" in w for w in none.warnings())


def _with(d: dict[str, Any], path: tuple[str, ...], value: object) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(d)
    cur = out
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return out


def test_effective_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTHNET_DATA_DIR", str(tmp_path / "data"))
    cfg = parse_config(MINIMAL)
    assert cfg.effective_data_dir() == tmp_path / "data" / "nodes" / "node-x"
    assert cfg.effective_models_dir() == tmp_path / "data" / "models"
    assert cfg.event_log_path() == tmp_path / "data" / "nodes" / "node-x" / "events.sqlite3"
    path = tmp_path / "etc" / "node.toml"
    path.parent.mkdir()
    path.write_text('[node]\nid = "node-x"\ndata_dir = "state"\nmodels_dir = "/srv/models"\n')
    cfg = load_config(path)
    assert cfg.effective_data_dir() == path.parent.resolve() / "state"
    assert cfg.effective_models_dir() == Path("/srv/models")


def test_endpoint() -> None:
    cfg = parse_config('[node]\nid = "node-x"\nlisten_host = "0.0.0.0"\nlisten_port = 0\n'
                       'advertise_host = "192.168.1.5"\n[security]\ninsecure_plaintext = false\n')
    assert cfg.endpoint(41000) == "wss://192.168.1.5:41000"
    v6 = parse_config('[node]\nid = "node-x"\nlisten_host = "::1"\n')
    assert v6.endpoint() == "wss://[::1]:7700"
    plain = parse_config('[node]\nid = "node-x"\npeers = ["wss://10.0.0.2:7701"]\n'
                         '[security]\ninsecure_plaintext = true\n')
    assert plain.endpoint() == "ws://127.0.0.1:7700"
    assert plain.peer_uris() == ["ws://10.0.0.2:7701"]


def test_config_is_immutable() -> None:
    cfg = parse_config(MINIMAL)
    with pytest.raises(ValueError):
        cfg.node.listen_port = 1
    assert isinstance(cfg, NodeConfig)


@pytest.mark.skipif(importlib.util.find_spec("hearthnet.commands.node") is None,
                    reason="the node command is not built yet")
def test_node_command_refuses_a_bad_config_with_exit_code_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hearthnet.cli import main

    path = tmp_path / "bad.toml"
    path.write_text('[node]\nid = "node-x"\nlisten_prot = 1\n')
    assert main(["node", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "node.listen_prot" in err and "unknown key" in err


def test_listeners_on_different_addresses_may_share_a_port() -> None:
    cfg = parse_config('[node]\nid = "node-x"\nlisten_host = "10.0.0.2"\nlisten_port = 7701\n'
                       '[api]\nlisten_port = 7701\n[security]\nadmin_port = -1\n')
    assert cfg.api.listen_port == cfg.node.listen_port == 7701
    off = parse_config('[node]\nid = "node-x"\nlisten_port = 7701\n[api]\nenabled = false\n'
                       "listen_port = 7701\n")
    assert not off.api.enabled


SERVING = ('[node]\nid = "node-b"\n[research]\nenable = true\n[research.distributed_inference]\n'
           "enabled = true\n[research.distributed_inference.host]\nserve_shards = true\n")


def test_a_shard_range_past_the_models_last_layer_names_file_key_and_layers(
        tmp_path: Path) -> None:
    """Only the model knows its layer count: checked by the node before it serves."""
    path = tmp_path / "node-b.toml"
    path.write_text(SERVING + "[[shards]]\nmodel = 'smollm2'\nlayers = [0, 14]\n"
                    "[[shards]]\nmodel = 'smollm2'\nlayers = [0, 99]\n")
    cfg = load_config(path)
    layers = {"smollm2": 30}.get
    with pytest.raises(ConfigError) as ei:
        check_shard_layers(cfg, layers, name="config/x/node-b.toml")
    err = ei.value
    assert err.message == ("config/x/node-b.toml: shards[1] = [0, 99]: smollm2 has 30 layers "
                           "(0-29)")
    assert err.file == "config/x/node-b.toml" and err.key == "shards[1].layers"
    with pytest.raises(ConfigError, match=str(path)):  # by default: the file it came from
        check_shard_layers(cfg, layers)
    fits = SERVING + "[[shards]]\nmodel = 'smollm2'\nlayers = [15, 29]\n"
    check_shard_layers(parse_config(fits), layers)
    # a model the store lacks is the node's own error (it names the models there)
    check_shard_layers(parse_config(fits.replace("smollm2", "other")), layers)
    # shards declared but not served are inert (see `warnings()`), so not checked either
    inert = fits.replace("serve_shards = true", "serve_shards = false").replace("29", "99")
    check_shard_layers(parse_config(inert), layers)


def test_api_is_loopback_by_default_and_needs_a_key_elsewhere(tmp_path: Path) -> None:
    """[api] (issue 15 §2): no key on loopback; on a LAN address a key or key file."""
    cfg = config_from_dict({"node": {"id": "node-a"}})
    assert cfg.api.enabled and cfg.api.loopback and cfg.api_keys() == []
    with pytest.raises(ConfigError) as e:
        config_from_dict({"node": {"id": "node-a"}, "api": {"listen_host": "0.0.0.0"}})
    assert e.value.key == "api.keys"
    with pytest.raises(ConfigError):  # a short key is refused
        config_from_dict({"node": {"id": "node-a"},
                          "api": {"listen_host": "192.168.1.5", "keys": ["short"]}})
    (tmp_path / "keys.txt").write_text("# household keys\n" + "k" + "1" * 20 + "\n\n")
    f = tmp_path / "n.toml"
    f.write_text('[node]\nid = "node-a"\n[api]\nlisten_host = "0.0.0.0"\n'
                 'keys = ["0123456789abcdef0123"]\nkey_file = "keys.txt"\n')
    cfg = load_config(f)
    assert not cfg.api.loopback
    assert cfg.api_keys() == ["0123456789abcdef0123", "k" + "1" * 20]
    (tmp_path / "keys.txt").unlink()
    with pytest.raises(ConfigError) as e:
        cfg.api_keys()
    assert e.value.key == "api.key_file"
