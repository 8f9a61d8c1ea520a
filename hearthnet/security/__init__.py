"""Membership and trust (M26 §5.8, §5.9).

- `keys`: the node's Ed25519 key (``<data_dir>/node.key``, mode 0600).
- `members`: `Trust`, `Member`, `MemberDirectory` — who is in the community, at what trust;
  verifies event signatures.
- `auth`: signed session opens (`make_open_auth`, `OpenAuthVerifier`), rate and connection
  limits.
- `tls`: mutual TLS pinned to member keys (`server_context`, `client_context`,
  `peer_node_id`).
- `provision`: keys and member lists for a folder of node configs.
- `joining`: one-time invite codes and the SPAKE2 exchange that admits a new node
  (`hearthnet invite`, `hearthnet join`).

See docs/security.md for the model: what is protected and what is not.
"""

from hearthnet.ids import valid_node_id
from hearthnet.security.auth import (
    AuthReason,
    ConnectionLimiter,
    NonceCache,
    OpenAuthVerifier,
    RateLimiter,
    make_open_auth,
    note_refusal,
    reason_of,
    sign_open,
    split_open,
)
from hearthnet.security.keys import NodeKey, fingerprint
from hearthnet.security.members import Member, MemberDirectory, Trust
from hearthnet.security.tls import (
    client_context,
    member_gate,
    peer_node_id,
    server_context,
    warn_insecure_plaintext,
)

__all__ = [
    "AuthReason",
    "ConnectionLimiter",
    "Member",
    "MemberDirectory",
    "NodeKey",
    "NonceCache",
    "OpenAuthVerifier",
    "RateLimiter",
    "Trust",
    "client_context",
    "fingerprint",
    "make_open_auth",
    "member_gate",
    "note_refusal",
    "peer_node_id",
    "reason_of",
    "server_context",
    "sign_open",
    "split_open",
    "valid_node_id",
    "warn_insecure_plaintext",
]
