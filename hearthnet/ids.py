"""The node-id pattern: the one definition every layer checks against, so no two copies disagree.

A node id is 1–63 of ``[a-z0-9-]``, a letter or digit first: safe in file names, TOML,
certificate names, metric labels, shard ids (``…@<node id>``) and event origins.
"""

from __future__ import annotations

import re

NODE_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
NODE_ID_RE = re.compile(NODE_ID_PATTERN)
NODE_ID_RULE = "1-63 lowercase letters, digits or '-', starting with a letter or digit"


def valid_node_id(node_id: object) -> bool:
    """Whether `node_id` is a legal node id."""
    return isinstance(node_id, str) and NODE_ID_RE.fullmatch(node_id) is not None
