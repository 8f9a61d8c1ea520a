"""A node for tests: ``python -m tests.helpers.testnode --config FILE [--faults JSON]``.

The production daemon (`hearthnet.node.daemon.Node`) with fault injection wrapped around
its shards from the outside (`tests.helpers.faults`): nothing in `hearthnet/` knows about
it. `tests.helpers.mesh.TestMesh` starts nodes this way.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hearthnet.commands.node import run_node
from hearthnet.config import load_config
from hearthnet.distributed_inference.shard.server import ShardServer
from hearthnet.node.daemon import Node
from hearthnet.observability import configure_logging
from tests.helpers.faults import install_faults


class FaultyNode(Node):
    """A `Node` whose shards misbehave as `faults` says (see `tests.helpers.faults`)."""

    def __init__(self, *args: Any, faults: dict[str, Any], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.faults = faults

    async def _host_shard(self, *args: Any, **kw: Any) -> ShardServer:
        shard = await super()._host_shard(*args, **kw)
        install_faults(shard, self.faults)  # before any session: no await since the ad
        return shard


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.helpers.testnode")
    ap.add_argument("--config", required=True)
    ap.add_argument("--faults", default="{}", help="a fault spec as JSON")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    configure_logging(cfg.node.log_level, node=cfg.node.id)
    run_node(FaultyNode(cfg, faults=json.loads(args.faults)))


if __name__ == "__main__":
    main()
