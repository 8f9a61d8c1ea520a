"""`TestMesh`: a `LocalMesh` for the test suite — fault injection and member helpers.

Nodes run `tests.helpers.testnode` (the production daemon with faults wrapped around its
shards), and the test acts as a member of the mesh with the keys `provision` made:
`client_ssl`, `sign_open`, `key`, `directory`.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
from pathlib import Path
from typing import Any

from hearthnet.config import load_config
from hearthnet.mesh.launcher import LocalMesh, NodeProc, NodeSpec
from hearthnet.security import MemberDirectory, NodeKey, client_context, sign_open
from hearthnet.security.keys import KEY_FILE_NAME

REPO = Path(__file__).resolve().parents[2]


class TestMesh(LocalMesh):
    """`LocalMesh` plus ``faults={node_id: spec}`` and helpers to act as a member."""

    __test__ = False  # not a pytest test class

    def __init__(self, specs: list[NodeSpec], *, faults: dict[str, dict[str, Any]] | None = None,
                 **kw: Any) -> None:
        super().__init__(specs, **kw)
        self.faults = faults or {}

    def node_argv(self, n: NodeProc) -> list[str]:
        return [sys.executable, "-m", "tests.helpers.testnode", "--config", str(n.config),
                "--faults", json.dumps(self.faults.get(n.spec.node_id, {}))]

    def node_env(self, n: NodeProc) -> dict[str, str]:
        env = super().node_env(n)
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([path] if path else []))
        return env

    # ---- acting as a member ----

    def key(self, node_id: str) -> NodeKey:
        """The node key `provision` made for `node_id`."""
        return NodeKey.load(self.root / node_id / KEY_FILE_NAME)

    def directory(self, node_id: str) -> MemberDirectory:
        """The member list in `node_id`'s config file, as it is now."""
        cfg = load_config(self.nodes[node_id].config)
        return MemberDirectory.from_dicts([m.model_dump() for m in cfg.community.members])

    def client_ssl(self, as_node: str, expect: str | None = None) -> ssl.SSLContext:
        """A TLS context presenting `as_node`'s certificate, pinned to `expect` (or any)."""
        return client_context(self.key(as_node), as_node, self.directory(as_node),
                              expect=expect)

    def sign_open(self, as_node: str, params: dict[str, Any],
                  now: float | None = None) -> dict[str, Any]:
        """Session OPEN fields signed by `as_node`."""
        return sign_open(self.key(as_node), as_node, params, now)
