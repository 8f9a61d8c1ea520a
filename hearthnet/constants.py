"""Facts more than one part of HearthNet relies on, each defined once so no copies disagree.

Only plain values live here (no torch, no I/O), so the config loader, the mesh and the
transport can all import it cheaply:

- `DEFAULT_TIMEOUT_S`: the one 30 s default — a step's deadline (M26 §6 ``timeout_s``), a
  tensor stream's default deadline, and the shard health timeout (M26 §5.4).
- `WIRE_DTYPES` / `WIDE_WIRE_DTYPES`: the names of the dtypes hidden states may have on the
  wire (docs/protocol.md §4; `transport.codec.WireDtype` carries the same names), and those a
  call may widen to when fp16 overflows.
- `DEFAULT_LAN_NETWORKS`: the CIDRs counted as this LAN (config ``[node] lan_networks``).
- `CloseCode`: the WebSocket close codes HearthNet sends (RFC 6455 §7.4.1, docs/protocol.md §7).
- `TENSOR_CHUNK_BYTES` / `MAX_TENSOR_BYTES` / `TENSOR_FLOW_CONTROL_WINDOW`: the tensor
  transport's defaults (M26 §5.5, docs/protocol.md §3–4), also the config's defaults.
- `TRANSPORT_IDLE_GAP_MS`: the idle gap before each step `bench transport` also times (the
  benchmark's and its command line's default).
- `DEFAULT_GGUF_DTYPE`: how a GGUF is imported (DESIGN.md decisions 10 and 15): `gguf`
  keeps its own quantised blocks (a store of the file's size; Q4 blocks are held as they
  are by default, `formats.default_held`), or a float dtype to de-quantise to; the
  importer's default and the `models import --dtype` default.
"""

from __future__ import annotations

import enum
from typing import Literal, get_args

DEFAULT_TIMEOUT_S = 30.0
"""Seconds: a step's deadline, a stream's default deadline, the shard health timeout."""

WireName = Literal["fp16", "bf16", "fp32"]
WideWireName = Literal["bf16", "fp32"]
# a call's choice: auto = fp32, what the layers compute (lossless); compact = fp16 per stage
# where calibration says it fits, the wide dtype elsewhere (lossy: asked for, never a default)
CallWireName = Literal["auto", "compact", WireName]
WIRE_DTYPES: tuple[str, ...] = get_args(WireName)
WIDE_WIRE_DTYPES: tuple[str, ...] = get_args(WideWireName)
CALL_WIRE_DTYPES: tuple[str, ...] = get_args(CallWireName)

DEFAULT_LAN_NETWORKS: tuple[str, ...] = (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
    "::1/128", "fc00::/7", "fe80::/10")
"""Loopback, the RFC 1918 ranges, IPv4 link-local, and IPv6 loopback, ULA and link-local."""

TENSOR_CHUNK_BYTES = 1 << 20
"""Default largest payload of one data frame (M26 §5.5, docs/protocol.md §4)."""

MAX_TENSOR_BYTES = 256 << 20
"""Default largest tensor a stream accepts (docs/protocol.md §3)."""

TENSOR_FLOW_CONTROL_WINDOW = 16
"""Default credit window in chunks (M26 §5.5)."""

TRANSPORT_IDLE_GAP_MS = 5.0
"""`bench transport` also times decode round trips each after this long idle, as a
pipeline's hop follows the other stages' compute: about one SmolLM2 shard's step on one
thread."""

DEFAULT_GGUF_DTYPE = "gguf"  # its own blocks kept: the GGUF's size, held exactly
"""A GGUF is imported to bf16 unless `--dtype` says otherwise: half fp32's size."""


class CloseCode(enum.IntEnum):
    """WebSocket close codes HearthNet sends (RFC 6455 §7.4.1, docs/protocol.md §7)."""

    NORMAL = 1000
    PROTOCOL_ERROR = 1002
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013
