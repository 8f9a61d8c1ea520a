#!/usr/bin/env python3
"""Give every node config in a folder a key and a complete member list (M26 §5.8).

    python scripts/gen_mesh_keys.py config/ [--trust trusted] [--json]

For each TOML with a ``[node] id``: creates ``node.key`` in the node's data directory
(``[node] data_dir``, else ``$HEARTHNET_DATA_DIR/nodes/<id>``) if missing, then rewrites
the ``[[community.members]]`` tables of every TOML to list every node. Idempotent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    from hearthnet.errors import ConfigError
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from hearthnet.errors import ConfigError

from hearthnet.security.members import Trust
from hearthnet.security.provision import provision


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="folder of node TOMLs")
    parser.add_argument("--trust", default="trusted", help="trust given to new entries")
    parser.add_argument("--pattern", default="*.toml", help="which files (default *.toml)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        nodes = provision(args.folder, trust=Trust.parse(args.trust), pattern=args.pattern)
    except ConfigError as e:
        print(f"gen_mesh_keys: {e.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"config": str(n.config), "node_id": n.node_id,
                           "data_dir": str(n.data_dir), "public_key": n.public_key,
                           "fingerprint": n.fingerprint, "key_created": n.key_created}
                          for n in nodes], indent=2))
    else:
        for n in nodes:
            state = "new key" if n.key_created else "existing key"
            print(f"{n.node_id:<12} {n.fingerprint}  {state:<12} {n.config}")
        if not nodes:
            print(f"no node configs ([node] id) in {args.folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
