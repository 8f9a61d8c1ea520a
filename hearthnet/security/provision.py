"""Key and member-list provisioning for a folder of node configs (never by hand).

`provision(folder)` gives every node TOML in `folder` a key (created in that node's data
directory if missing) and rewrites the ``[[community.members]]`` tables of every TOML so
each lists every node with its public key. It edits the text: only the member tables
change, comments and layout elsewhere stay, and the result is re-parsed and compared with
the original before it is written, so a file is never left half-edited or reinterpreted.
Used by `make demo`, the `config/` examples and ``scripts/gen_mesh_keys.py``.

A node that a file does not list yet (its own entry, above all) gets the trust the folder's
other files give it — the lowest, where they differ — and only a node no file lists gets the
default: the files of one folder then agree on who is what, so the node whose peers name it
the community's ``steward`` is one in its own member list too (its own trust is what lets
it edit the served-model list, DESIGN.md decision 14).

``provision(folder, in_place=False)`` (what ``hearthnet keys provision`` does) leaves the
TOMLs alone and writes each node's complete member list to ``<data_dir>/members.toml``
instead (`MEMBERS_FILE`); `hearthnet.config.load_config` fills in the public keys (and
adds members) from that file, so provisioning the example configs of a checkout keeps
``git status`` clean.

Where a node's data directory is: ``[node] data_dir`` (relative paths are relative to the
TOML's folder), else (unset or ``""``) ``<HEARTHNET_DATA_DIR>/nodes/<node id>`` — the same
rule as `hearthnet.config.NodeConfig.effective_data_dir`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet import paths
from hearthnet.config import MEMBERS_FILE  # the provisioned member list in a data dir
from hearthnet.errors import ConfigError
from hearthnet.security.keys import KEY_FILE_NAME, NodeKey, check_node_id
from hearthnet.security.members import Trust, parse_members

MEMBERS_HEADER = "[[community.members]]"
_HEADER_RE = re.compile(r"^\s*\[")
_MEMBERS_RE = re.compile(r"^\s*\[\[\s*community\s*\.\s*members\s*\]\]\s*(#.*)?$")
_MARKER = "# community members: written by hearthnet (scripts/gen_mesh_keys.py)"


@dataclass(frozen=True)
class NodeConfig:
    """The few node settings security needs, read from a node TOML."""

    path: Path
    node_id: str
    data_dir: Path


@dataclass(frozen=True)
class ProvisionedNode:
    """What `provision` did for one node."""

    config: Path
    node_id: str
    data_dir: Path
    public_key: str
    fingerprint: str
    key_created: bool


def load_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file. Raises `ConfigError` naming the file."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}", file=str(path),
                          reason="unreadable") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}", file=str(path),
                          reason="invalid TOML") from e


def default_node_data_dir(node_id: str) -> Path:
    """``<HEARTHNET_DATA_DIR>/nodes/<node_id>`` — a node's data dir when none is set."""
    return paths.data_dir() / "nodes" / check_node_id(node_id)


def read_node_config(path: str | os.PathLike[str]) -> NodeConfig:
    """Read ``[node] id`` and ``[node] data_dir`` from a node TOML.

    Raises:
        ConfigError: unreadable, invalid TOML, or no valid ``[node] id``.
    """
    p = Path(path)
    doc = load_toml(p)
    node = doc.get("node")
    if not isinstance(node, dict) or "id" not in node:
        raise ConfigError(f"{p} has no [node] id", file=str(p), key="node.id",
                          reason="missing")
    node_id = node["id"]
    try:
        check_node_id(node_id)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e.message}", file=str(p), key="node.id",
                          reason="invalid node id") from e
    raw_dir = node.get("data_dir", "")
    if raw_dir == "":  # unset or "" both mean the default, as in hearthnet.config
        data_dir = default_node_data_dir(node_id)
    elif isinstance(raw_dir, str):
        d = Path(raw_dir).expanduser()
        data_dir = d if d.is_absolute() else (p.parent / d)
    else:
        raise ConfigError(f"{p}: [node] data_dir must be a path string", file=str(p),
                          key="node.data_dir", reason="not a string")
    return NodeConfig(p, node_id, data_dir.resolve())


# --- rendering and editing member tables ------------------------------------------

def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML
    raise ConfigError(f"cannot rewrite member field {where}: only strings, numbers and "
                      "booleans are supported", key="community.members",
                      reason="unsupported value")


def member_block(member: Mapping[str, Any]) -> str:
    """One ``[[community.members]]`` table (node_id, public_key, trust first)."""
    order = ["node_id", "public_key", "trust"]
    keys = order + sorted(k for k in member if k not in order)
    lines = [MEMBERS_HEADER]
    for k in keys:
        if k in member:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", k):
                raise ConfigError(f"cannot rewrite member field {k!r}",
                                  key="community.members", reason="unsupported key")
            lines.append(f"{k} = {_toml_value(member[k], k)}")
    return "\n".join(lines) + "\n"


def render_members(members: Iterable[Mapping[str, Any]]) -> str:
    """All member tables, preceded by a marker comment."""
    return _MARKER + "\n" + "\n".join(member_block(m) for m in members)


def replace_member_tables(text: str, members: Sequence[Mapping[str, Any]]) -> str:
    """`text` with its ``[[community.members]]`` tables replaced by `members`.

    The new tables go where the first old one was, else at the end. Everything else is
    kept byte for byte, which the result's re-parse checks.

    Raises:
        ConfigError: the file defines members in a form this cannot edit (e.g. an inline
            ``members = [...]``) or the edit would change anything else.
    """
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    insert_at: int | None = None
    i = 0
    while i < len(lines):
        if not _MEMBERS_RE.match(lines[i]):
            kept.append(lines[i])
            i += 1
            continue
        if kept and kept[-1].strip() == _MARKER:
            kept.pop()
        if insert_at is None:
            insert_at = len(kept)
        end = i + 1
        while end < len(lines) and not _HEADER_RE.match(lines[end]):
            end += 1
        body_end = max([j for j in range(i + 1, end) if _is_content(lines[j])], default=i)
        i = body_end + 1  # trailing comments/blank lines belong to what follows
    block = render_members(members)
    if insert_at is None:
        prefix = "".join(kept).rstrip("\n")
        new_text = (prefix + "\n\n" if prefix else "") + block
    else:
        before = "".join(kept[:insert_at])
        after = "".join(kept[insert_at:]).lstrip("\n")
        new_text = before + block + ("\n" + after if after else "")
    _check_only_members_changed(text, new_text, members)
    return new_text


def _is_content(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith("#")


def _without_members(doc: dict[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    community = out.get("community")
    if isinstance(community, dict):
        community = {k: v for k, v in community.items() if k != "members"}
        if community:
            out["community"] = community
        else:
            out.pop("community")
    return out


def _check_only_members_changed(old: str, new: str,
                                members: Sequence[Mapping[str, Any]]) -> None:
    try:
        before, after = tomllib.loads(old), tomllib.loads(new)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot edit the member list in this file safely: {e}",
                          key="community.members", reason="unsafe edit") from e
    got = after.get("community", {}).get("members")
    if _without_members(before) != _without_members(after) or got != [dict(m)
                                                                      for m in members]:
        raise ConfigError("cannot edit the member list in this file safely (members "
                          "defined inline or mixed with other tables?); write "
                          "[[community.members]] tables instead", key="community.members",
                          reason="unsafe edit")


def _existing_members(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    community = doc.get("community")
    rows = community.get("members", []) if isinstance(community, dict) else []
    return [dict(r) for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def folder_trust(member_lists: Iterable[Iterable[Mapping[str, Any]]]) -> dict[str, Trust]:
    """{node id: the lowest trust any of `member_lists` gives it} — what a folder's files
    say of each node they list. Raises `ConfigError` for an unknown trust level."""
    out: dict[str, Trust] = {}
    for rows in member_lists:
        for r in rows:
            node_id, trust = str(r.get("node_id")), Trust.parse(r.get("trust", "member"))
            out[node_id] = min(trust, out.get(node_id, trust))
    return out


def merge_members(existing: Iterable[Mapping[str, Any]],
                  nodes: Iterable[tuple[str, str]], default_trust: Trust,
                  listed: Mapping[str, Trust] | None = None) -> list[dict[str, Any]]:
    """The member list for one file: every provisioned node (its current key; the trust
    this file lists for it, else the trust `listed` — the folder's other files, see
    `folder_trust` — gives it, else `default_trust`), then members listed by hand and not
    provisioned, unchanged."""
    old = {str(r.get("node_id")): r for r in existing}
    provisioned = sorted(nodes)
    ids = {node_id for node_id, _ in provisioned}
    out: list[dict[str, Any]] = []
    for node_id, public_key in provisioned:
        row = dict(old.get(node_id, {}))
        row.update(node_id=node_id, public_key=public_key)
        row.setdefault("trust", (listed or {}).get(node_id, default_trust).label)
        out.append(row)
    out.extend(dict(r) for nid, r in old.items() if nid not in ids)
    parse_members(out)  # refuse to write a list the daemon would refuse to load
    return out


def write_atomic(path: Path, text: str) -> None:
    """Replace `path`'s content with `text` atomically, keeping its mode."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def provision(folder: str | os.PathLike[str], *, trust: Trust = Trust.TRUSTED,
              pattern: str = "*.toml", in_place: bool = True) -> list[ProvisionedNode]:
    """Create missing node keys and write every node into every node TOML's members.

    A node a file does not list gets the trust the folder's other files give it, else
    `trust` (see the module docstring). Files matching `pattern` without a ``[node] id``
    are left alone. Idempotent: running it again changes nothing. With ``in_place=False``
    the TOMLs are not touched: each node's member list goes to ``<data_dir>/members.toml``.

    Raises:
        ConfigError: two files claim one node id, a file cannot be edited safely, or a
            key file is unusable. No TOML is written unless every one can be.
    """
    configs = _node_configs(Path(folder), pattern)
    done: list[ProvisionedNode] = []
    for c in configs:
        existed = (c.data_dir / KEY_FILE_NAME).exists()
        key = NodeKey.load_or_create(c.data_dir)
        done.append(ProvisionedNode(c.path, c.node_id, c.data_dir, key.public_key_b64,
                                    key.fingerprint, not existed))
    nodes = [(n.node_id, n.public_key) for n in done]
    texts = {c.path: c.path.read_text(encoding="utf-8") for c in configs}
    existing = {p: _existing_members(tomllib.loads(text)) for p, text in texts.items()}
    for path, rows in existing.items():
        try:
            folder_trust([rows])
        except ConfigError as e:
            raise ConfigError(f"{path}: {e.message}", file=str(path),
                              key="community.members.trust", reason=e.reason) from e
    listed = folder_trust(existing.values())
    edits: list[tuple[Path, str]] = []
    for c in configs:
        text = texts[c.path]
        members = merge_members(existing[c.path], nodes, trust, listed)
        try:
            new_text = replace_member_tables(text, members)
        except ConfigError as e:
            raise ConfigError(f"{c.path}: {e.message}", file=str(c.path),
                              key="community.members", reason=e.reason) from e
        if not in_place:
            c.data_dir.mkdir(parents=True, exist_ok=True)
            edits.append((c.data_dir / MEMBERS_FILE, f"# generated by `hearthnet keys "
                          f"provision` for {c.path}\n" + render_members(members)))
        elif new_text != text:
            edits.append((c.path, new_text))
    for path, new_text in edits:
        write_atomic(path, new_text)
    return done


def check_folders_apart(folders: Iterable[str | os.PathLike[str]], *,
                        pattern: str = "*.toml") -> None:
    """Refuse folders provisioned together whose nodes would share a node id or a data
    directory: the folder provisioned last would overwrite the other's key and member
    list there, and one node would read the other's event log.

    Raises:
        ConfigError: naming both files, before anything is written.
    """
    ids: dict[str, Path] = {}
    dirs: dict[Path, Path] = {}
    for folder in dict.fromkeys(Path(f).resolve() for f in folders):
        for c in _node_configs(folder, pattern):
            other = ids.setdefault(c.node_id, c.path)
            if other == c.path:
                other = dirs.setdefault(c.data_dir, c.path)
                what, key = f"data dir {c.data_dir}", "node.data_dir"
            else:
                what, key = f"node id {c.node_id}", "node.id"
            if other != c.path:
                raise ConfigError(
                    f"{c.path} and {other} both use {what}: provisioning both would leave "
                    "only one node's key and member list there; give each folder its own "
                    "node ids and data dirs", file=str(c.path), key=key,
                    reason="shared between folders")


def _node_configs(folder: Path, pattern: str) -> list[NodeConfig]:
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder of node configs", file=str(folder),
                          reason="not a folder")
    configs: list[NodeConfig] = []
    seen: dict[str, Path] = {}
    for path in sorted(folder.glob(pattern)):
        node = load_toml(path).get("node")
        if not isinstance(node, dict) or "id" not in node:
            continue
        c = read_node_config(path)
        if c.node_id in seen:
            raise ConfigError(f"{path} and {seen[c.node_id]} both use node id {c.node_id}",
                              file=str(path), key="node.id", reason="duplicate node id")
        seen[c.node_id] = path
        configs.append(c)
    return configs
