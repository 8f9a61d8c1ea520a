"""Node configuration: TOML (`tomllib`) validated by pydantic (DESIGN.md decision 8).

`load_config(path)` reads one node's file and returns a `NodeConfig`, or raises
`ConfigError` whose message names the file, the dotted key and the reason (the CLI turns
it into exit code 2). Unknown keys are errors everywhere.

Sections: ``[node]`` (identity, addresses, folders, peers), ``[research]`` with the M26 §7
``[research.distributed_inference]`` and ``[...host]`` tables, ``[[shards]]`` (the shards
this node hosts), ``[community]``, ``[security]`` and ``[api]``. See
``config/mesh3/*.toml`` for complete examples.

Decisions:

- ``[[shards]]`` are *declared* shards. They are served only when
  ``research.enable``, ``research.distributed_inference.enabled`` and
  ``research.distributed_inference.host.serve_shards`` are all true (`hosted_shards()`);
  otherwise they are inert and `warnings()` says so, so hosting can be switched off with
  one key without deleting the list.
- Relative ``data_dir``/``models_dir`` are resolved against the config file's folder;
  empty means ``<HEARTHNET_DATA_DIR>/nodes/<id>`` and ``<HEARTHNET_DATA_DIR>/models``.
- A node that serves shards and listens on a wildcard address (``0.0.0.0``/``::``) must
  set ``advertise_host``: others cannot dial a wildcard.
- Peers are base ``ws://`` / ``wss://`` URIs; the gossip feed is at ``<uri>/gossip``.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from hearthnet import paths
from hearthnet.constants import (
    DEFAULT_LAN_NETWORKS,
    DEFAULT_TIMEOUT_S,
    TENSOR_CHUNK_BYTES,
    TENSOR_FLOW_CONTROL_WINDOW,
    CallWireName,
    WideWireName,
)
from hearthnet.errors import ConfigError
from hearthnet.ids import NODE_ID_PATTERN

NodeId = Annotated[str, Field(pattern=NODE_ID_PATTERN)]
Port = Annotated[int, Field(ge=0, le=65535)]


COMPILE_ENV = "HEARTHNET_COMPILE"  # "0": no compiled decode steps in this process


def compile_decode_enabled() -> bool:
    """Whether this process compiles CPU decode steps at all (``HEARTHNET_COMPILE``; a
    node's ``compile_decode`` may further turn them off)."""
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _listen_host(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v.strip()


ListenHost = Annotated[str, AfterValidator(_listen_host)]
# a Host header value (RFC 9110 §7.2) and a browser's Origin (RFC 6454 §6.1)
_HOST_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?$"
_ORIGIN_PATTERN = r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?$"
Trust = Literal["guest", "member", "trusted", "steward"]
WeightFormat = Literal["native", "fp32", "bf16", "fp16", "int8", "int4"]  # formats.FORMATS
# formats.check_policy
CallWeights = Literal["lossless", "exact", "fp32", "bf16", "fp16", "int8", "int4"]
DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:[0-9]{1,3})?)$"
DeviceSpec = Annotated[str, Field(pattern=DEVICE_PATTERN)]
"""A device setting: auto | cpu | cuda | cuda:N | mps (DESIGN.md decision 11)."""
_WILDCARDS = {"0.0.0.0", "::", ""}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NodeSection(_Section):
    """``[node]``: who this node is and where it lives."""

    id: NodeId
    listen_host: ListenHost = "127.0.0.1"
    listen_port: Port = 7700  # 0 = pick a free port
    advertise_host: str = ""  # host others use to reach us; default listen_host
    data_dir: str = ""  # default <HEARTHNET_DATA_DIR>/nodes/<id>
    models_dir: str = ""  # default <HEARTHNET_DATA_DIR>/models
    metrics_port: Port = 0  # >0: also a plain-HTTP /metrics (only) on this port
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    torch_threads: Annotated[int, Field(ge=1, le=256)] = 1
    peers: list[str] = Field(default_factory=list)
    lan_networks: list[str] = Field(default_factory=lambda: list(DEFAULT_LAN_NETWORKS))
    # "mdns": announce this node and find peers on the LAN by mDNS/DNS-SD (DESIGN.md decision 14);
    # discovery only finds addresses, membership still comes from the member list
    discovery: Literal["off", "mdns"] = "off"
    # dial other known members (their advertised endpoints, discovered addresses) while
    # fewer than this many are linked: 2 survives any one link or node failure (mesh.links);
    # 0: only configured and discovered peers (and members whose heartbeats stopped)
    min_gossip_links: Annotated[int, Field(ge=0, le=16)] = 2
    # SIGTERM/SIGINT: open shard sessions and chats get this long to finish (new ones are
    # refused `shard_unavailable`, so orchestrators fail over), then the node exits
    drain_timeout_seconds: Annotated[float, Field(ge=0, le=600)] = 10.0

    @field_validator("advertise_host")
    @classmethod
    def _advertise(cls, v: str) -> str:
        v = v.strip()
        if any(c in v for c in "/ \t[]") or v.count(":") == 1:
            raise ValueError("must be a bare host name or IP address (no scheme or port)")
        return v

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        out = []
        for uri in v:
            try:
                parts = urlsplit(uri)
                port = parts.port
            except ValueError as e:
                raise ValueError(f"{uri!r} is not a URI: {e}") from None
            if parts.scheme not in ("ws", "wss") or not parts.hostname:
                raise ValueError(f"{uri!r} must look like ws://host:port")
            if port is None:
                raise ValueError(f"{uri!r} needs a port")
            if parts.query or parts.fragment:
                raise ValueError(f"{uri!r} must not have a query or fragment")
            out.append(uri.rstrip("/"))
        if len(set(out)) != len(out):
            raise ValueError("lists the same peer twice")
        return out

    @field_validator("lan_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for n in v:
            try:
                ipaddress.ip_network(n, strict=False)
            except ValueError as e:
                raise ValueError(f"{n!r} is not a network: {e}") from None
        return v


class HostSection(_Section):
    """``[research.distributed_inference.host]`` (M26 §7 plus session limits)."""

    serve_shards: bool = False
    shard_eviction_idle_seconds: Annotated[float, Field(ge=0)] = 600
    shard_max_vram_mb: Annotated[int, Field(ge=0)] = 20000
    session_idle_timeout_seconds: Annotated[float, Field(gt=0)] = 120
    max_session_tokens: Annotated[int, Field(ge=1)] = 8192
    compute_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"  # the default of `weights`
    # how hosted layers are held (DESIGN.md decision 10); unset: `compute_dtype`. Per shard:
    # `[[shards]] weights`.
    weights: WeightFormat | None = None
    # DESIGN.md decision 11: where hosted layers run (auto = CUDA, then MPS, then CPU; a [[shards]]
    # entry may override it) and whether CUDA decode steps replay a captured graph
    device: DeviceSpec = "auto"
    cuda_graphs: bool = True
    # M26 §5.7: on the CPU, decode steps run as one compiled function once it is built (in
    # the background; saved under <data_dir>/compiled and loaded after a restart)
    compile_decode: bool = True


class AutoSection(_Section):
    """``[research.distributed_inference.auto]``: automatic hosting (``shards = "auto"``).

    See `hearthnet.distributed_inference.placement.planner` for the rules and
    `hearthnet.distributed_inference.placement.autohost` for the daemon's side
    (DESIGN.md decision 14).
    """

    memory_mb: Annotated[int, Field(ge=0)] = 0  # layer budget; 0 = host.shard_max_vram_mb
    speed: Annotated[float, Field(ge=0)] = 0.0  # layer steps/s; 0 = measure at start
    start_jitter_s: Annotated[float, Field(ge=0, le=600)] = 2.0  # before each placement
    settle_s: Annotated[float, Field(ge=0, le=600)] = 1.0  # claim -> re-check
    claim_ttl_s: Annotated[float, Field(gt=0)] = 60.0  # a claim counts this long unloaded
    rebalance_interval_s: Annotated[float, Field(gt=0)] = 60.0  # jittered ±50 %
    balance_quality: Annotated[float, Field(gt=0, le=1)] = 0.75  # Petals' margin


class DistributedInferenceSection(_Section):
    """``[research.distributed_inference]`` — exactly M26 §7, plus transport knobs."""

    enabled: bool = False
    max_shards_per_request: Annotated[int, Field(ge=1, le=256)] = 16
    shard_health_timeout_seconds: Annotated[float, Field(gt=0)] = DEFAULT_TIMEOUT_S
    # every node probes the listener of every advertising host this often; after
    # `host_probe_failures` refusals in a row the host is down: its shards are shown offline
    # and never routed to, long before the health timeout (so automatic hosts re-host them soon)
    host_probe_interval_seconds: Annotated[float, Field(gt=0, le=600)] = 2.0
    host_probe_failures: Annotated[int, Field(ge=1, le=100)] = 2
    fallback_to_local: bool = True
    # wire dtype of hidden states (M26 §5.3): auto = fp32, lossless (orchestrator/wire.py);
    # compact = fp16 where the calibrated magnitude fits, activation_wide_dtype where not
    activation_dtype: CallWireName = "auto"
    activation_wide_dtype: WideWireName = "bf16"
    # DESIGN.md decision 10: how this node's orchestrator holds the head (and the local engine);
    # `weights` is the default policy of the shards a call accepts: lossless (formats that
    # keep the stored weights), exact, or a minimum format (formats.py)
    head_weights: WeightFormat = "fp32"
    weights: CallWeights = "lossless"
    # load every stored model's head (+ calibration) at start, so the first call does not
    # wait; false on a host that only serves shards of a large model: its memory is for its
    # layers (a 7B head in fp32 is 4.4 GB), and a call through it still loads the head then
    prepare_heads_at_start: bool = True
    allow_self_as_shard: bool = False
    max_concurrent_pipelines: Annotated[int, Field(ge=1)] = 4
    fallback_after_failures: Annotated[int, Field(ge=1)] = 2  # M26 §5.4
    flow_control_window: Annotated[int, Field(ge=1, le=1024)] = TENSOR_FLOW_CONTROL_WINDOW
    chunk_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = TENSOR_CHUNK_BYTES
    # what one call may ask for, checked before any work (mesh and local path alike), so
    # one huge prompt cannot wedge the node
    max_prompt_bytes: Annotated[int, Field(ge=1, le=16 * 1024 * 1024)] = 32 * 1024
    max_prompt_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = 4096
    max_completion_tokens: Annotated[int, Field(ge=1, le=8192)] = 2048
    # a long prefill runs in chunks of this many positions (orchestrator and shards)
    prefill_chunk_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = 256
    # DESIGN.md decision 12: a shard's decode steps (and an orchestrator's heads) from concurrent
    # sessions run as one batched forward; a round waits up to this long for the other
    # sessions' steps (0: batch only what is already queued)
    batch_window_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    # mixed rounds (DESIGN.md decision 12): prefill positions a shard's round takes (at least
    # one piece); a prompt that arrives while other sessions decode goes in pieces of this
    # size. Small keeps decoding chats' gaps short on compute-bound CPUs, and lets the next
    # stage start on the first of several prompts while this one computes the others
    mixed_prefill_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = 32
    # micro-batch lanes of this node's concurrent chats (DESIGN.md decision 12): 1 batches
    # every chat together; 0 is one lane per stage of a chat's pipeline, so the stages
    # compute different chats' rows at once (opt-in: on one 2-core machine it lowered the
    # inter-token p50 at 8 chats by ~20 % but not the aggregate, docs/benchmarks.md)
    pipeline_lanes: Annotated[int, Field(ge=0, le=8)] = 1
    # a chat whose prompt begins as another running chat's through the same shards (the
    # system prompt, a shared document) has its stages copy those positions' keys and
    # values from that chat's sessions instead of computing them; only this node's own
    # sessions, never another member's (docs/operations.md, "Shared prompt prefixes")
    prefix_sharing: bool = True
    # DESIGN.md decision 11: the orchestrator's head (embeddings, norm, lm_head) and local fallback
    head_device: DeviceSpec = "auto"
    # DESIGN.md decision 16: the default proposer of a call (its `speculate` param): lookup
    # (prompt lookup, no model), draft (the model's draft model below) or off; at most
    # speculate_max_tokens proposals per pass
    speculate: Literal["lookup", "draft", "off"] = "lookup"
    speculate_max_tokens: Annotated[int, Field(ge=1, le=32)] = 8
    # a model's draft model, by alias: `"qwen2.5-7b" = "qwen2.5-0.5b"` (same tokenizer)
    draft_models: dict[str, str] = Field(default_factory=dict)
    host: HostSection = Field(default_factory=HostSection)
    auto: AutoSection = Field(default_factory=AutoSection)

    @property
    def advertisement_expiry_s(self) -> float:
        """4 × the health timeout (M26 §5.1)."""
        return 4 * self.shard_health_timeout_seconds

    @property
    def heartbeat_interval_s(self) -> float:
        """Re-advertise every health timeout / 2, well before ads expire (M26 §5.1)."""
        return self.shard_health_timeout_seconds / 2


class ResearchSection(_Section):
    """``[research]``: the spec's ``policy.research.enable`` switch."""

    enable: bool = False
    distributed_inference: DistributedInferenceSection = Field(
        default_factory=DistributedInferenceSection)


class ShardSection(_Section):
    """One ``[[shards]]`` entry: a layer range of a model this node hosts."""

    model: Annotated[str, Field(min_length=1, max_length=256)]  # alias or model_id
    layers: tuple[int, int]  # inclusive
    max_concurrent_streams: Annotated[int, Field(ge=1, le=4096)] = 8
    weights: WeightFormat | None = None  # how the layers are held; unset: the host's
    device: DeviceSpec | None = None  # default: [research.distributed_inference.host] device

    @field_validator("layers", mode="before")
    @classmethod
    def _as_tuple(cls, v: Any) -> Any:
        if not (isinstance(v, (list, tuple)) and len(v) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
            raise ValueError("must be [first, last]: two integers, an inclusive range")
        return tuple(v)

    @field_validator("layers")
    @classmethod
    def _range(cls, v: tuple[int, int]) -> tuple[int, int]:
        lo, hi = v
        if lo < 0:
            raise ValueError(f"first layer {lo} must be >= 0")
        if lo > hi:
            raise ValueError(f"first layer {lo} is after last layer {hi} (inclusive range)")
        return v


class MemberSection(_Section):
    node_id: NodeId
    public_key: str = ""
    trust: Trust = "member"


class CommunitySection(_Section):
    """``[community]``: who is in the community and how far each is trusted (M26 §5.9).

    ``min_trust`` is the lowest trust a caller needs to open sessions on this node's
    shards; ``route_min_trust`` the lowest trust of a shard host this node sends
    activations to (M26 §5.9: both default to ``trusted``).
    """

    min_trust: Trust = "trusted"
    route_min_trust: Trust = "trusted"
    # lowest trust of a member calling a capability over /bus, per capability name (else a
    # guest chats under this node's identity); a capability not listed needs `min_trust`
    bus_min_trust: dict[str, Trust] = Field(default_factory=dict)
    members: list[MemberSection] = Field(default_factory=list)

    @field_validator("members")
    @classmethod
    def _unique(cls, v: list[MemberSection]) -> list[MemberSection]:
        ids = [m.node_id for m in v]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"lists node {dup[0]!r} twice")
        return v


class SecuritySection(_Section):
    """``[security]``: transport security and hostile-input limits (M26 §5.8).

    Node links are ``wss://`` with mutual TLS unless ``insecure_plaintext = true``. The
    loopback-only plaintext admin listener (``admin_port``; 0 = any free port, -1 = off)
    serves the local CLI: ``/bus``, ``/status``, ``/health`` and ``/metrics``; its address
    is written to ``<data_dir>/node.json`` while the node runs.
    """

    insecure_plaintext: bool = False
    admin_port: Annotated[int, Field(ge=-1, le=65535)] = 0
    max_connections_per_peer: Annotated[int, Field(ge=1)] = 64
    max_connections_total: Annotated[int, Field(ge=1)] = 512
    max_sessions_per_caller: Annotated[int, Field(ge=1)] = 64
    connection_rate: Annotated[float, Field(gt=0)] = 50.0  # new connections/s per peer
    connection_burst: Annotated[float, Field(ge=1)] = 100.0
    message_rate: Annotated[float, Field(gt=0)] = 200.0  # gossip messages/s per peer
    message_burst: Annotated[float, Field(ge=1)] = 400.0


class ApiSection(_Section):
    """``[api]``: the OpenAI-compatible HTTP API and the web status page (DESIGN.md decision 13).

    Bound to loopback by default (``listen_port = 0`` picks a free port; the address is in
    the ``node_ready`` line and ``<data_dir>/node.json``). On any other address every
    ``/v1`` and ``/api`` call needs ``Authorization: Bearer <key>`` with a key from
    ``keys`` or ``key_file`` (one key a line). Bodies, message counts and ``max_tokens`` are
    bounded before any work.

    Which web pages may use it: every request's ``Host`` must name this listener (its
    address and port; ``localhost``/``127.0.0.1``/``[::1]`` on a loopback or wildcard bind;
    any IP address on a wildcard bind) or an ``allowed_hosts`` entry, so a DNS-rebinding
    page is refused with 403; an ``Origin``, when sent, must be the node's own page or an
    ``allowed_origins`` entry. POST bodies must be ``application/json`` (415 otherwise), so
    another site's form or ``text/plain`` fetch cannot reach a handler.
    """

    enabled: bool = True
    listen_host: ListenHost = "127.0.0.1"
    listen_port: Port = 0
    # extra names clients reach the API by (a reverse proxy, an mDNS or LAN name, a port
    # forward): "hearth.lan" (any port) or "localhost:9000" (that port only)
    allowed_hosts: list[Annotated[str, Field(pattern=_HOST_PATTERN)]] = Field(
        default_factory=list)
    # extra page origins allowed to call it from a browser, e.g. "https://hearth.lan"
    allowed_origins: list[Annotated[str, Field(pattern=_ORIGIN_PATTERN)]] = Field(
        default_factory=list)
    # seconds a client has to send a request's headers (also the idle time of a kept-alive
    # connection) and again its body: a half-sent request is not held open
    read_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    keys: list[Annotated[str, Field(min_length=16, max_length=256)]] = Field(
        default_factory=list)
    key_file: str = ""
    max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = 1024 * 1024
    max_messages: Annotated[int, Field(ge=1, le=256)] = 64
    max_tokens: Annotated[int, Field(ge=1, le=8192)] = 2048
    default_max_tokens: Annotated[int, Field(ge=1, le=8192)] = 256

    @property
    def loopback(self) -> bool:
        """True when only this machine can reach the listener (no key needed)."""
        if self.listen_host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.listen_host).is_loopback
        except ValueError:
            return False


class NodeConfig(_Section):
    """A whole node configuration file."""

    node: NodeSection
    research: ResearchSection = Field(default_factory=ResearchSection)
    # [[shards]] tables, or "auto": the node picks its ranges itself (DESIGN.md decision 14)
    shards: list[ShardSection] | Literal["auto"] = Field(default_factory=list)
    community: CommunitySection = Field(default_factory=CommunitySection)
    security: SecuritySection = Field(default_factory=SecuritySection)
    api: ApiSection = Field(default_factory=ApiSection)

    _source: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _cross(self) -> NodeConfig:
        seen: set[tuple[str, tuple[int, int]]] = set()
        for i, s in enumerate(self.declared_shards()):
            if (s.model, s.layers) in seen:
                raise _KeyedError(f"shards[{i}]", f"shard {s.model} layers "
                                  f"{s.layers[0]}-{s.layers[1]} is listed twice")
            seen.add((s.model, s.layers))
        own = {(h, self.node.listen_port) for h in (self.node.listen_host,
                                                    self.node.advertise_host) if h}
        for i, uri in enumerate(self.node.peers):
            parts = urlsplit(uri)
            if (parts.hostname, parts.port) in own:
                raise _KeyedError(f"node.peers[{i}]", f"{uri} is this node itself")
        if not self.api.loopback and self.api.enabled and not (self.api.keys
                                                               or self.api.key_file):
            raise _KeyedError("api.keys", f"the API listens on {self.api.listen_host!r}, "
                              "not loopback: set api.keys or api.key_file")
        if (self.hosted_shards() or self.auto_hosting) and self.node.listen_host in _WILDCARDS \
                and not self.node.advertise_host:
            raise _KeyedError("node.advertise_host", "must be set when serving shards on "
                              f"the wildcard address {self.node.listen_host!r}")
        self._distinct_ports()
        return self

    def _distinct_ports(self) -> None:
        """Two listeners of this node on one port: the second bind would fail part-way
        through the start, so it is refused here with both keys."""
        bound: list[tuple[str, str, int]] = [
            ("node.listen_port", self.node.listen_host, self.node.listen_port),
            ("node.metrics_port", self.node.listen_host, self.node.metrics_port),
            ("security.admin_port", "127.0.0.1", self.security.admin_port)]
        if self.api.enabled:
            bound.append(("api.listen_port", self.api.listen_host, self.api.listen_port))
        seen: list[tuple[str, str, int]] = []
        for key, host, port in bound:
            if port <= 0:  # 0: any free port; -1: off
                continue
            for other, other_host, other_port in seen:
                if port == other_port and (host == other_host or host in _WILDCARDS
                                           or other_host in _WILDCARDS):
                    raise _KeyedError(key, f"port {port} is also {other}: each listener "
                                      "of a node needs its own port")
            seen.append((key, host, port))

    # ---- derived values ----

    @property
    def source(self) -> Path | None:
        """The file this config was loaded from (None when built in code)."""
        return self._source

    @property
    def di(self) -> DistributedInferenceSection:
        return self.research.distributed_inference

    @property
    def distributed_enabled(self) -> bool:
        """Research on and distributed inference enabled (else: inert, M26 §2)."""
        return self.research.enable and self.di.enabled

    def declared_shards(self) -> list[ShardSection]:
        """The `[[shards]]` tables (none when ``shards = "auto"``)."""
        return [] if self.shards == "auto" else list(self.shards)

    def hosted_shards(self) -> list[ShardSection]:
        """The `[[shards]]` this node actually serves (see the module docstring)."""
        return self.declared_shards() if self._serving else []

    @property
    def _serving(self) -> bool:
        return self.distributed_enabled and self.di.host.serve_shards

    @property
    def auto_hosting(self) -> bool:
        """``shards = "auto"`` and serving: the node chooses its ranges (DESIGN.md decision 14)."""
        return self.shards == "auto" and self._serving

    def warnings(self) -> list[str]:
        """Valid but probably unintended settings, for the daemon to log at start."""
        out = []
        if self.shards == "auto" and not self.auto_hosting:
            out.append("shards = \"auto\" but this node serves no shards: research, "
                       "distributed_inference and host.serve_shards must all be on")
        if self.declared_shards() and not self.hosted_shards():
            why = ("research.enable is false" if not self.research.enable else
                   "research.distributed_inference.enabled is false" if not self.di.enabled
                   else "research.distributed_inference.host.serve_shards is false")
            out.append(f"{len(self.declared_shards())} [[shards]] declared but not served: {why}")
        if self._serving and not self.shards:
            out.append("serve_shards is true but no [[shards]] are declared")
        return out

    def _resolve(self, value: str) -> Path:
        p = Path(value).expanduser()
        if not p.is_absolute() and self._source is not None:
            p = self._source.parent / p
        return p

    def effective_data_dir(self) -> Path:
        """This node's state folder (event log, keys ...); not created here."""
        if self.node.data_dir:
            return self._resolve(self.node.data_dir)
        return paths.data_dir() / "nodes" / self.node.id

    def effective_models_dir(self) -> Path:
        """The model store folder (shared by the nodes of one machine)."""
        if self.node.models_dir:
            return self._resolve(self.node.models_dir)
        return paths.models_dir()

    def advertise_host(self) -> str:
        return self.node.advertise_host or self.node.listen_host

    def endpoint(self, port: int | None = None) -> str:
        """The base URI others use to reach this node (`port` = the bound port)."""
        scheme = "ws" if self.security.insecure_plaintext else "wss"
        host = self.advertise_host()
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        return f"{scheme}://{host}:{port if port is not None else self.node.listen_port}"

    def peer_uris(self) -> list[str]:
        """``node.peers`` with the scheme this node's links use (``wss`` unless plaintext)."""
        scheme = "ws" if self.security.insecure_plaintext else "wss"
        return [scheme + uri[uri.index("://"):] for uri in self.node.peers]

    def api_keys(self) -> list[str]:
        """``api.keys`` plus the keys in ``api.key_file`` (one a line, ``#`` comments).

        Raises:
            ConfigError: the key file cannot be read.
        """
        keys = list(self.api.keys)
        if self.api.key_file:
            path = self._resolve(self.api.key_file)
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"api.key_file {path}: {e.strerror or e}",
                                  file=str(self._source), key="api.key_file",
                                  reason=str(e)) from None
            keys += [ln.strip() for ln in text.splitlines()
                     if ln.strip() and not ln.lstrip().startswith("#")]
        return keys

    def event_log_path(self) -> Path:
        return self.effective_data_dir() / "events.sqlite3"


class _KeyedError(ValueError):
    """A cross-field error that knows its dotted key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key, self.reason = key, reason


def load_config(path: str | Path) -> NodeConfig:
    """Read and validate a node config file.

    Raises:
        ConfigError: missing/unreadable file, invalid TOML (with line and column), or a
            schema violation — the message names the file, the dotted key and the reason.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found", file=str(p), key=None,
                          reason="not found") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"{p}: cannot read config file: {reason}", file=str(p), key=None,
                          reason=reason) from None
    cfg = parse_config(text, source=p)
    return _with_provisioned_members(cfg, text, p)


def check_shard_layers(cfg: NodeConfig, num_layers: Callable[[str], int | None], *,
                       name: str | None = None) -> None:
    """Refuse a hosted ``[[shards]]`` range that reaches past its model's last layer.

    The layer count is the model's, so this runs once the model store is at hand (the
    node, before it serves anything), not in `load_config`. `num_layers(model)` gives a
    model's decoder layers, None for a model the store lacks (its own error says more).
    `name` is the file as the user gave it (default: the config's source).

    Raises:
        ConfigError: ``F: shards[0] = [0, 99]: smollm2 has 30 layers (0-29)`` (exit 2 in
            the CLI, like every config error: the file, the key and the reason).
    """
    if not cfg.hosted_shards():
        return
    where = name or str(cfg.source or "<config>")
    for i, s in enumerate(cfg.declared_shards()):
        n = num_layers(s.model)
        lo, hi = s.layers
        if n is not None and hi >= n:
            reason = f"{s.model} has {n} layers (0-{n - 1})"
            raise ConfigError(f"{where}: shards[{i}] = [{lo}, {hi}]: {reason}", file=where,
                              key=f"shards[{i}].layers", reason=reason)


MEMBERS_FILE = "members.toml"  # written by hearthnet.security.provision


def _with_provisioned_members(cfg: NodeConfig, text: str, source: Path) -> NodeConfig:
    """`cfg` with the member list `hearthnet keys provision` wrote to the data directory.

    A member listed in both keeps the config's trust and takes the file's public key where
    the config has none; members only in the file are added. Without that file: `cfg`.
    """
    path = cfg.effective_data_dir() / MEMBERS_FILE
    if not path.is_file():
        return cfg
    try:
        extra = tomllib.loads(path.read_text(encoding="utf-8"))
        rows = extra.get("community", {}).get("members", [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("[[community.members]] tables expected")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {e}", file=str(path), key="community.members",
                          reason=str(e)) from None
    data = tomllib.loads(text)
    own = data.setdefault("community", {}).setdefault("members", [])
    by_id = {m.get("node_id"): m for m in own if isinstance(m, dict)}
    for row in rows:
        mine = by_id.get(row.get("node_id"))
        if mine is None:
            own.append(dict(row))
        elif not str(mine.get("public_key", "")).strip():
            mine["public_key"] = row.get("public_key", "")
    return config_from_dict(data, source=source)


def parse_config(text: str, *, source: str | Path | None = None) -> NodeConfig:
    """Validate TOML text (`source` names it in errors and anchors relative paths)."""
    name = str(source) if source is not None else "<config>"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{name}: invalid TOML: {e}", file=name, key=None,
                          reason=f"invalid TOML: {e}") from None
    return config_from_dict(data, source=source)


def config_from_dict(data: dict[str, Any], *, source: str | Path | None = None) -> NodeConfig:
    """Validate an already parsed mapping (used by tests and generated configs)."""
    name = str(source) if source is not None else "<config>"
    try:
        cfg = NodeConfig.model_validate(data)
    except ValidationError as e:
        problems = [_describe(err) for err in _shards_union(e.errors(), data)]
        key, reason = problems[0]
        text = "; ".join(f"{k}: {r}" for k, r in problems)
        raise ConfigError(f"{name}: {text}", file=name, key=key, reason=reason) from None
    if source is not None:
        cfg._source = Path(source).resolve()
    return cfg


_AUTO_TAG = "literal['auto']"


def _shards_union(errors: list[Any], data: Any) -> list[Any]:
    """Errors of the ``shards`` union (tables or "auto") told as one of its branches.

    Pydantic reports both branches with their tags in the location; keep the branch the
    input was meant for and drop the tag, so the key reads ``shards[0].layers``.
    """
    given = data.get("shards") if isinstance(data, dict) else None
    out = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if len(loc) < 2 or loc[0] != "shards" or not isinstance(loc[1], str):
            out.append(err)
            continue
        if isinstance(given, str):  # meant to be "auto"
            if loc[1] != _AUTO_TAG:
                continue
            err = {**err, "type": "value_error", "msg": 'must be "auto" or [[shards]] tables'}
        elif loc[1] == _AUTO_TAG:
            continue
        out.append({**err, "loc": (loc[0], *loc[2:])})
    return out


def _describe(err: Any) -> tuple[str, str]:
    """(dotted key, reason) of one pydantic error."""
    loc = tuple(err.get("loc", ()))
    ctx = err.get("ctx") or {}
    exc = ctx.get("error")
    if isinstance(exc, _KeyedError):
        return exc.key, exc.reason
    key = _dotted(loc)
    typ = err.get("type", "")
    if typ == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return key, "unknown key" + hint
    if typ == "missing":
        return key, "required key is missing"
    if typ in ("model_type", "dict_type"):
        return key, "must be a table"
    if typ == "list_type":
        return key, "must be an array"
    msg = str(exc) if isinstance(exc, ValueError) else str(err.get("msg", "invalid value"))
    got = repr(err.get("input"))
    if len(got) > 60:
        got = got[:57] + "..."
    return key, f"{msg} (got {got})"


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: Any = NodeConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        model = args[0] if args and isinstance(args[0], type) else ann
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return sorted(getattr(model, "model_fields", {}))
