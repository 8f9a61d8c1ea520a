"""Node keys (hearthnet/security/keys.py) and `hearthnet keys init|show` (issue 7 item 1)."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError

from hearthnet.cli import main
from hearthnet.config import NodeConfig
from hearthnet.errors import ConfigError
from hearthnet.security.keys import (
    NodeKey,
    check_node_id,
    decode_public_key,
    fingerprint,
    valid_node_id,
    verify_signature,
)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_sign_and_verify_round_trip() -> None:
    key = NodeKey.generate()
    sig = key.sign(b"hello")
    assert len(sig) == 64
    assert verify_signature(key.public_key, b"hello", sig)
    assert not verify_signature(key.public_key, b"hellO", sig)
    assert not verify_signature(NodeKey.generate().public_key, b"hello", sig)
    assert not verify_signature(key.public_key, b"hello", sig[:-1])
    assert not verify_signature(key.public_key, b"hello", "not bytes")  # type: ignore[arg-type]


def test_public_key_b64_is_the_raw_32_bytes() -> None:
    key = NodeKey.generate()
    raw = base64.b64decode(key.public_key_b64)
    assert raw == key.public_key_raw and len(raw) == 32
    assert decode_public_key(key.public_key_b64) == key.public_key
    assert key.fingerprint == fingerprint(raw) and key.fingerprint.startswith("SHA256:")


def test_load_or_create_makes_a_0600_key_and_reuses_it(tmp_path: Path) -> None:
    old = os.umask(0)  # even with a permissive umask the file is private
    try:
        key = NodeKey.load_or_create(tmp_path / "data")
    finally:
        os.umask(old)
    path = tmp_path / "data" / "node.key"
    assert key.path == path and _mode(path) == 0o600
    assert NodeKey.load_or_create(tmp_path / "data").public_key_raw == key.public_key_raw
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp files left


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_group_or_world_readable_key_is_refused(tmp_path: Path, mode: int) -> None:
    key = NodeKey.load_or_create(tmp_path)
    assert key.path is not None
    os.chmod(key.path, mode)
    with pytest.raises(ConfigError, match="chmod 600") as e:
        NodeKey.load(key.path)
    assert e.value.reason == "insecure permissions"


def test_missing_symlinked_or_foreign_key_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keys init"):
        NodeKey.load(tmp_path / "nope.key")
    real = NodeKey.load_or_create(tmp_path / "real")
    assert real.path is not None
    link = tmp_path / "link.key"
    link.symlink_to(real.path)
    with pytest.raises(ConfigError):
        NodeKey.load(link)
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    garbage.chmod(0o600)
    with pytest.raises(ConfigError, match="not a PEM private key"):
        NodeKey.load(garbage)
    ec_key = tmp_path / "ec.key"
    ec_key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    ec_key.chmod(0o600)
    with pytest.raises(ConfigError, match="not an Ed25519 key"):
        NodeKey.load(ec_key)


def test_save_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    first = NodeKey.generate().save(path)
    with pytest.raises(FileExistsError):
        NodeKey.generate().save(path)
    assert NodeKey.load(path).public_key_raw == first.public_key_raw


@pytest.mark.parametrize("text", ["", "!!!", base64.b64encode(b"x" * 31).decode(),
                                  base64.b64encode(b"x" * 33).decode()])
def test_bad_public_keys_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        decode_public_key(text)


@pytest.mark.parametrize("node_id,ok", [
    ("node-a", True), ("a", True), ("9-x", True), ("x" * 63, True), ("x" * 64, False),
    # one rule everywhere (keys, config, event origins, shard hosts): no upper case, '.', '_'
    ("A.b_c-9", False), ("Node-a", False), ("a.b", False), ("a_b", False),
    ("", False), ("-a", False), ("a b", False), ("a/b", False), ("é", False), (7, False)])
def test_node_id_rules(node_id: object, ok: bool) -> None:
    assert valid_node_id(node_id) is ok
    if not ok:
        with pytest.raises(ConfigError, match="lowercase"):
            check_node_id(node_id)
    if isinstance(node_id, str):  # the config and the event log agree with the keys
        assert (NodeConfig.model_validate({"node": {"id": node_id}}).node.id == node_id) \
            if ok else not _config_accepts(node_id)
        assert _event_log_accepts(node_id) is ok


# --- CLI ---------------------------------------------------------------------------

def test_keys_init_prints_id_key_and_member_block(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "init", "--data-dir", str(tmp_path), "--node-id", "node-a"]) == 0
    out = capsys.readouterr().out
    key = NodeKey.load(tmp_path / "node.key")
    assert _mode(tmp_path / "node.key") == 0o600
    assert "node_id     node-a" in out and key.public_key_b64 in out and "(created)" in out
    assert ('[[community.members]]\nnode_id = "node-a"\n'
            f'public_key = "{key.public_key_b64}"\ntrust = "trusted"\n') in out
    # init again keeps the key; show remembers the node id without --node-id
    assert main(["keys", "init", "--data-dir", str(tmp_path)]) == 0
    assert "(existing)" in capsys.readouterr().out
    assert main(["keys", "show", "--data-dir", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["node_id"] == "node-a" and shown["public_key"] == key.public_key_b64
    assert shown["created"] is False and "trust = \"trusted\"" in shown["member_toml"]


def test_keys_with_config_uses_node_id_and_data_dir(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text('[node]\nid = "node-b"\ndata_dir = "state/b"\n')
    assert main(["keys", "init", "--config", str(cfg), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["node_id"] == "node-b" and out["created"] is True
    assert Path(out["key_file"]) == (tmp_path / "state" / "b" / "node.key").resolve()
    assert main(["keys", "show", "--config", str(cfg), "--node-id", "node-x"]) == 2
    assert "differs" in capsys.readouterr().err


def test_keys_show_without_a_key_says_how_to_make_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "show", "--data-dir", str(tmp_path / "empty")]) == 2
    assert "hearthnet keys init" in capsys.readouterr().err


def test_keys_default_to_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HEARTHNET_DATA_DIR", str(tmp_path))
    assert main(["keys", "init"]) == 0
    out = capsys.readouterr().out
    assert "(unknown: pass --node-id or --config)" in out
    assert (tmp_path / "node.key").exists() and "[[community.members]]" not in out


def _config_accepts(node_id: str) -> bool:
    try:
        NodeConfig.model_validate({"node": {"id": node_id}})
    except ValidationError:
        return False
    return True


def _event_log_accepts(node_id: str) -> bool:
    from hearthnet.errors import PeerDataError
    from hearthnet.mesh.eventlog import Event

    try:  # the origin is checked first; a good one fails later on the made-up id
        Event("0" * 32, node_id, 1, "t", {}, 1.0).check()
    except PeerDataError as e:
        return "origin" not in e.message
    return True
