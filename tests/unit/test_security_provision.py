"""Keys and member lists for a folder of node TOMLs (hearthnet/security/provision.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hearthnet.errors import ConfigError
from hearthnet.security.keys import NodeKey
from hearthnet.security.members import MemberDirectory, Trust
from hearthnet.security.provision import provision, read_node_config, replace_member_tables

REPO = Path(__file__).resolve().parents[2]

NODE_A = """# node A: the orchestrator
[node]
id = "node-a"
data_dir = "data/a"   # relative to this file
listen = "127.0.0.1:7401"

[community]
name = "hearth"

[[shards]]
model = "smollm2"
layers = [0, 14]
"""

NODE_B = """[node]
id = "node-b"
data_dir = ""  # the default

[[community.members]]
node_id = "laptop"
public_key = "{laptop}"
trust = "guest"

# peers of B
[[peers]]
url = "wss://127.0.0.1:7401"
"""


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HEARTHNET_DATA_DIR", str(tmp_path / "hn"))
    cfg = tmp_path / "config"
    cfg.mkdir()
    (cfg / "a.toml").write_text(NODE_A)
    (cfg / "b.toml").write_text(NODE_B.format(laptop=NodeKey.generate().public_key_b64))
    (cfg / "prometheus.toml").write_text('[global]\nscrape_interval = "5s"\n')
    return cfg


def members_of(path: Path) -> MemberDirectory:
    return MemberDirectory.from_dicts(tomllib.loads(path.read_text())["community"]["members"])


def test_every_node_gets_a_key_and_every_member_list_lists_all(folder: Path) -> None:
    done = provision(folder)
    assert [n.node_id for n in done] == ["node-a", "node-b"]
    a_key = NodeKey.load(folder / "data" / "a" / "node.key")
    b_key = NodeKey.load(folder.parent / "hn" / "nodes" / "node-b" / "node.key")
    assert all(n.key_created for n in done)
    for toml in ("a.toml", "b.toml"):
        d = members_of(folder / toml)
        assert d.get("node-a").public_key_raw == a_key.public_key_raw  # type: ignore[union-attr]
        assert d.get("node-b").public_key_raw == b_key.public_key_raw  # type: ignore[union-attr]
        assert d.trust_of("node-a") is Trust.TRUSTED
    assert members_of(folder / "b.toml").trust_of("laptop") is Trust.GUEST  # kept
    assert "laptop" not in members_of(folder / "a.toml")
    assert (folder / "prometheus.toml").read_text() == '[global]\nscrape_interval = "5s"\n'


def test_the_rest_of_each_file_is_unchanged(folder: Path) -> None:
    provision(folder)
    a = (folder / "a.toml").read_text()
    assert a.startswith(NODE_A)  # appended after the original text, comments kept
    b = (folder / "b.toml").read_text()
    assert b.endswith('# peers of B\n[[peers]]\nurl = "wss://127.0.0.1:7401"\n')
    doc = tomllib.loads(b)
    assert doc["node"] == {"id": "node-b", "data_dir": ""} and doc["peers"] == [{"url": "wss://127.0.0.1:7401"}]


def test_provision_is_idempotent_and_keeps_keys_and_edited_trust(folder: Path) -> None:
    provision(folder)
    first = {p.name: p.read_text() for p in folder.glob("*.toml")}
    again = provision(folder)
    assert not any(n.key_created for n in again)
    assert {p.name: p.read_text() for p in folder.glob("*.toml")} == first
    # a person demotes node-b in a.toml; re-provisioning keeps that choice
    a = folder / "a.toml"
    text = a.read_text()
    i = text.index('node_id = "node-b"')
    a.write_text(text[:i] + text[i:].replace('trust = "trusted"', 'trust = "member"', 1))
    provision(folder)
    assert members_of(a).trust_of("node-b") is Trust.MEMBER


def test_a_new_node_is_added_everywhere(folder: Path) -> None:
    provision(folder)
    (folder / "c.toml").write_text('[node]\nid = "node-c"\ndata_dir = "data/c"\n')
    provision(folder)
    for toml in ("a.toml", "b.toml", "c.toml"):
        assert {m.node_id for m in members_of(folder / toml)} >= {"node-a", "node-b", "node-c"}
    assert (folder / "a.toml").read_text().count("[[community.members]]") == 3


def test_duplicate_node_ids_are_refused_before_any_write(folder: Path) -> None:
    (folder / "z.toml").write_text('[node]\nid = "node-a"\n')
    before = (folder / "b.toml").read_text()
    with pytest.raises(ConfigError, match="both use node id node-a"):
        provision(folder)
    assert (folder / "b.toml").read_text() == before


def test_inline_member_arrays_are_not_rewritten(folder: Path) -> None:
    (folder / "b.toml").write_text('[node]\nid = "node-b"\n[community]\nmembers = []\n')
    with pytest.raises(ConfigError, match="cannot edit the member list"):
        provision(folder)


def test_replace_member_tables_keeps_following_comments() -> None:
    text = ('[node]\nid = "x"\n\n[[community.members]]\nnode_id = "old"\n'
            'public_key = "k"\n\n# shards this node hosts\n[[shards]]\nmodel = "m"\n')
    new = replace_member_tables(text, [{"node_id": "x", "public_key": "p", "trust": "trusted"}])
    assert "old" not in new and "# shards this node hosts\n[[shards]]" in new
    assert tomllib.loads(new)["community"]["members"] == [
        {"node_id": "x", "public_key": "p", "trust": "trusted"}]
    assert replace_member_tables(new, tomllib.loads(new)["community"]["members"]) == new


def test_read_node_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[node\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_node_config(bad)
    bad.write_text('[node]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"no \[node\] id"):
        read_node_config(bad)
    bad.write_text('[node]\nid = "no spaces"\n')
    with pytest.raises(ConfigError, match="invalid node id"):
        read_node_config(bad)


def test_gen_mesh_keys_script(folder: Path) -> None:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_mesh_keys.py"), str(folder)],
                       capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "node-a" in r.stdout and "new key" in r.stdout
    assert "node-b" in members_of(folder / "a.toml")


# ---- `hearthnet keys provision` leaves the TOMLs alone (issue 15 §6) ----

def test_cli_provision_keeps_tomls_and_config_loading_finds_the_keys(
        repo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README step on the shipped examples: git status stays clean, nodes still start."""
    import shutil

    from hearthnet.config import load_config
    from hearthnet.node.guard import member_rows

    data = tmp_path / "hn"
    monkeypatch.setenv("HEARTHNET_DATA_DIR", str(data))
    folder = tmp_path / "mesh3"
    shutil.copytree(repo_root / "config" / "mesh3", folder)
    before = {p.name: p.read_bytes() for p in folder.glob("*.toml")}
    env = {"HEARTHNET_DATA_DIR": str(data), "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-m", "hearthnet.cli", "keys"]
    r = subprocess.run([*cli, "provision", str(folder)], capture_output=True, text=True,
                       env={**env, "PYTHONPATH": str(repo_root)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_bytes() for p in folder.glob("*.toml")} == before
    keys = {n: NodeKey.load(data / "nodes" / n / "node.key").public_key_b64
            for n in ("mesh3-a", "mesh3-b", "mesh3-c")}
    for name in keys:
        cfg = load_config(folder / f"node-{name.removeprefix('mesh3-')}.toml")
        rows = member_rows(cfg, NodeKey.load(data / "nodes" / name / "node.key"))
        assert {r["node_id"]: r["public_key"] for r in rows} == keys
    # `keys show` without --config finds the provisioned keys instead of steering to `init`
    r = subprocess.run([*cli, "show"], capture_output=True, text=True,
                       env={**env, "PYTHONPATH": str(repo_root)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert all(k in r.stdout for k in keys.values()) and "node_id     mesh3-b" in r.stdout


def test_keys_show_says_where_provisioned_keys_live(repo_root: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "keys", "show"],
                       capture_output=True, text=True, timeout=120,
                       env={"HEARTHNET_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": str(repo_root)})
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert str(tmp_path / "nodes") in line and "keys provision" in line


# ---- a folder's files agree on each node's trust; folders provisioned together stay apart ----

STEWARDED = {  # b and c name node-a the steward; node-a's own file does not list itself
    "a.toml": '[node]\nid = "node-a"\n\n[[community.members]]\nnode_id = "node-b"\n'
              'trust = "trusted"\n',
    "b.toml": '[node]\nid = "node-b"\n\n[[community.members]]\nnode_id = "node-a"\n'
              'trust = "steward"\n',
    "c.toml": '[node]\nid = "node-c"\n\n[[community.members]]\nnode_id = "node-a"\n'
              'trust = "steward"\n\n[[community.members]]\nnode_id = "node-b"\n'
              'trust = "member"\n',
}


@pytest.mark.parametrize("in_place", [True, False])
def test_a_node_gets_the_trust_its_folder_gives_it_in_its_own_list(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool) -> None:
    """The steward its peers name is a steward in its own member list too, so its own
    `models serve` is accepted (the shipped config/auto3 relies on this)."""
    from hearthnet.config import load_config
    from hearthnet.node.guard import member_rows

    monkeypatch.setenv("HEARTHNET_DATA_DIR", str(tmp_path / "hn"))
    folder = tmp_path / "cfg"
    folder.mkdir()
    for name, text in STEWARDED.items():
        (folder / name).write_text(text)
    provision(folder, in_place=in_place)
    for name in STEWARDED:
        cfg = load_config(folder / name)
        key = NodeKey.load(tmp_path / "hn" / "nodes" / cfg.node.id / "node.key")
        trust = {r["node_id"]: r["trust"] for r in member_rows(cfg, key)}
        assert trust["node-a"] == "steward", (name, trust)
        # a file's own word is kept; where the others differ (a: trusted, c: member), the
        # lowest of them
        assert trust["node-b"] == ("trusted" if name == "a.toml" else "member")
        assert trust["node-c"] == "trusted"  # no file lists it: the default
    # and again: nothing changes (idempotent), a person's choice in a file is kept
    before = {p: p.read_bytes() for p in (tmp_path / "hn").rglob("members.toml")}
    before.update({p: p.read_bytes() for p in folder.glob("*.toml")})
    provision(folder, in_place=in_place)
    after = {p: p.read_bytes() for p in (tmp_path / "hn").rglob("members.toml")}
    after.update({p: p.read_bytes() for p in folder.glob("*.toml")})
    assert after == before


def test_folders_sharing_a_node_id_or_data_dir_are_refused_before_any_key(
        tmp_path: Path, repo_root: Path) -> None:
    """`make keys` provisions several folders into one data dir: a node id (or a data dir)
    in two of them would leave only the last one's key and member list there."""
    one, two, three = (tmp_path / n for n in ("one", "two", "three"))
    for d in (one, two, three):
        d.mkdir()
    (one / "a.toml").write_text('[node]\nid = "node-a"\n')
    (two / "a.toml").write_text('[node]\nid = "node-a"\n')
    (three / "x.toml").write_text(
        f'[node]\nid = "node-x"\ndata_dir = "{tmp_path / "hn" / "nodes" / "node-a"}"\n')
    env = {"HEARTHNET_DATA_DIR": str(tmp_path / "hn"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(repo_root)}
    for other, what in ((two, "node id node-a"), (three, "data dir")):
        r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "keys", "provision",
                            str(one), str(other)], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert what in line and str(one / "a.toml") in line and str(other) in line, line
        assert not (tmp_path / "hn" / "nodes").exists()  # nothing written
    # the same folder twice is one folder
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "keys", "provision", str(one),
                        str(one) + "/"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.count("node-a ") == 1, (r.stdout, r.stderr)
