"""`hearthnet keys init|show|provision`: the node's identity (M26 §5.8).

``keys init`` creates ``<data_dir>/node.key`` (mode 0600) if it does not exist and prints
the node id, the public key and a ``[[community.members]]`` block to paste into every
member's config; ``keys show`` prints the same for an existing key. The node id comes from
``--node-id``, else the config's ``[node] id``, else the id remembered by ``keys init``.
``keys provision FOLDER...`` creates the key of every node config in the folders (in each
node's data directory, so: nodes of one machine) and writes every node into every
config's member list.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet import paths
from hearthnet.config import MEMBERS_FILE
from hearthnet.errors import ConfigError
from hearthnet.security.keys import KEY_FILE_NAME, NodeKey, check_node_id
from hearthnet.security.members import Trust
from hearthnet.security.provision import member_block, read_node_config

NODE_ID_FILE = "node.id"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="this node's identity key")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    init = ksub.add_parser("init", help="create the node key (if missing) and print it")
    _common(init)
    init.set_defaults(func=_init)
    show = ksub.add_parser("show", help="print the node id and public key")
    _common(show)
    show.set_defaults(func=_show)
    prov = ksub.add_parser(
        "provision", help="give every node config in folders a key and the full member list")
    prov.add_argument("folders", nargs="+", help="folders of node TOMLs (e.g. config/mesh3)")
    prov.add_argument("--trust", default="trusted", help="trust given to new entries")
    prov.add_argument("--pattern", default="*.toml", help="which files (default *.toml)")
    prov.add_argument("--in-place", action="store_true",
                      help="rewrite the TOMLs' member tables (default: leave them as they "
                           "are and write <data_dir>/members.toml for each node)")
    prov.set_defaults(func=_provision)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="node TOML: use its [node] id and data_dir")
    p.add_argument("--data-dir", default=None, help="data directory (default: HEARTHNET_DATA_DIR)")
    p.add_argument("--node-id", default=None, help="this node's id, as in the member list")
    p.add_argument("--trust", default="trusted",
                   help="trust level in the printed member block (default: trusted)")
    p.add_argument("--json", action="store_true", help="print JSON")


@dataclass(frozen=True)
class _Target:
    data_dir: Path
    node_id: str | None


def _target(args: argparse.Namespace) -> _Target:
    node_id: str | None = args.node_id
    data_dir: Path | None = Path(args.data_dir).expanduser() if args.data_dir else None
    if args.config:
        cfg = read_node_config(args.config)
        if node_id is not None and node_id != cfg.node_id:
            raise ConfigError(f"--node-id {node_id} differs from [node] id {cfg.node_id} in "
                              f"{args.config}", file=args.config, key="node.id",
                              reason="conflict")
        node_id = cfg.node_id
        data_dir = data_dir or cfg.data_dir
    if data_dir is None:
        data_dir = paths.data_dir()
    if node_id is not None:
        check_node_id(node_id)
    else:
        node_id = _remembered_id(data_dir)
    return _Target(data_dir, node_id)


def _remembered_id(data_dir: Path) -> str | None:
    f = data_dir / NODE_ID_FILE
    try:
        text = f.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return check_node_id(text)


def _init(args: argparse.Namespace) -> int:
    t = _target(args)
    created = not (t.data_dir / KEY_FILE_NAME).exists()
    key = NodeKey.load_or_create(t.data_dir)
    if t.node_id is not None:
        (t.data_dir / NODE_ID_FILE).write_text(t.node_id + "\n", encoding="utf-8")
    _print(key, t.node_id, Trust.parse(args.trust), created=created, as_json=args.json)
    return 0


def _show(args: argparse.Namespace) -> int:
    t = _target(args)
    path = t.data_dir / KEY_FILE_NAME
    if not path.exists() and not (args.config or args.data_dir):
        provisioned = sorted((t.data_dir / "nodes").glob(f"*/{KEY_FILE_NAME}"))
        if provisioned:  # `keys provision` keeps each node's key in its own data dir
            if args.json:
                print(json.dumps([_describe(NodeKey.load(p), p.parent.name,
                                            Trust.parse(args.trust), created=False)
                                  for p in provisioned], indent=2))
                return 0
            for i, p in enumerate(provisioned):
                print("\n" * bool(i), end="")
                _print(NodeKey.load(p), p.parent.name, Trust.parse(args.trust),
                       created=False, as_json=False)
            return 0
    if not path.exists():
        raise ConfigError(f"no node key at {path}. Keys made by `hearthnet keys provision` "
                          f"are in {t.data_dir / 'nodes'}/<node id>/{KEY_FILE_NAME} (see "
                          f"`keys show --config FILE`); `hearthnet keys init` makes a single "
                          f"node's key here",
                          file=str(path), reason="missing")
    _print(NodeKey.load(path), t.node_id, Trust.parse(args.trust), created=False,
           as_json=args.json)
    return 0


def _describe(key: NodeKey, node_id: str | None, trust: Trust, *, created: bool
              ) -> dict[str, Any]:
    block = (member_block({"node_id": node_id, "public_key": key.public_key_b64,
                           "trust": trust.label}) if node_id else None)
    return {"node_id": node_id, "public_key": key.public_key_b64,
            "fingerprint": key.fingerprint, "key_file": str(key.path), "created": created,
            "member_toml": block}


def _print(key: NodeKey, node_id: str | None, trust: Trust, *, created: bool,
           as_json: bool) -> None:
    out = _describe(key, node_id, trust, created=created)
    block = out["member_toml"]
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print(f"node_id     {node_id or '(unknown: pass --node-id or --config)'}")
    print(f"public_key  {key.public_key_b64}")
    print(f"fingerprint {key.fingerprint}")
    print(f"key_file    {key.path} ({'created' if created else 'existing'})")
    if block:
        print("\n# add this node to every member's config:")
        sys.stdout.write(block)


def _provision(args: argparse.Namespace) -> int:
    """`hearthnet keys provision FOLDER...` — `provision.provision` on each folder, once
    no two of the folders' nodes share a node id or data dir (`check_folders_apart`)."""
    from hearthnet.security.provision import check_folders_apart, provision

    check_folders_apart(args.folders, pattern=args.pattern)
    seen: set[Path] = set()
    for folder in args.folders:
        if Path(folder).resolve() in seen:  # one folder named twice is provisioned once
            continue
        seen.add(Path(folder).resolve())
        for n in provision(folder, trust=Trust.parse(args.trust), pattern=args.pattern,
                           in_place=args.in_place):
            state = "new key" if n.key_created else "existing key"
            where = n.config if args.in_place else n.data_dir / MEMBERS_FILE
            print(f"{n.node_id:<12} {n.fingerprint}  {state:<12} {n.data_dir / KEY_FILE_NAME}"
                  f"  members: {where}")
    return 0
