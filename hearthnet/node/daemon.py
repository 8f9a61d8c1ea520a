"""The node daemon: wires config, event log, gossip, shards, router and orchestrator.

One asyncio process per machine (DESIGN.md decision 6). One WebSocket server on
`[node] listen_host:listen_port` routes by request path:

- `/shard`  tensor sessions on a hosted shard (transport `ServerStream`)
- `/gossip` the event-log feed (`mesh.gossip`)
- `/bus`    capability calls (`experimental.distributed_llm.chat`; for authenticated
            members only, `hearthnet.weights.manifest` / `.read`: the tensors of a stored
            model, `node.fetch`)
- plain HTTP `GET /metrics` (Prometheus), `GET /health`, `GET /status` (JSON)

Security (M26 §5.8, §5.9; `node.guard`): the listener is ``wss://`` with mutual TLS pinned to
the community members (plain ``ws://`` only with ``insecure_plaintext = true``); every
connection is rate- and count-limited per peer; shard opens must be signed by a member
at ``min_trust`` or higher *before* any shard work (or weight reload); gossiped events
must be signed by a member. A second, loopback-only plaintext **admin listener** serves
the local CLI (`/bus`, `/status`, `/health`, `/metrics`; no `/shard`, no `/gossip`); its
URI is in the ``node_ready`` line and in ``<data_dir>/node.json`` with the pid. SIGHUP
re-reads the config's member list (`hearthnet node --reload`). While an invite from
``hearthnet invite`` is pending, a plain listener on a free port serves ``/join`` only:
the SPAKE2 exchange of `hearthnet.security.joining`, which adds the joiner as a member.

When the node is up it prints one JSON line ``{"event": "node_ready", ...}`` on stdout
(scripts and tests wait for it); logs are JSON lines on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from hearthnet.background import cancel_and_wait, detach
from hearthnet.config import NodeConfig, ShardSection
from hearthnet.constants import CloseCode
from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    WITHDRAWN,
    advertisement_payload,
    make_shard_id,
    withdrawal_payload,
)
from hearthnet.distributed_inference.directory.formats import (
    default_held,
    formats_for,
)
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.liveness import HostLiveness
from hearthnet.distributed_inference.directory.routing import RoutingSettings, ShardRouter
from hearthnet.distributed_inference.directory.store import Advertisement, ShardStore
from hearthnet.distributed_inference.engine.compiled import compile_dir_of
from hearthnet.distributed_inference.engine.device import resolve_device
from hearthnet.distributed_inference.engine.generation import PromptLimits
from hearthnet.distributed_inference.engine.memory import apply_large_blocks
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.distributed_inference.placement.autohost import AutoHost
from hearthnet.distributed_inference.placement.community import (
    SERVED_MODELS,
    PlacementView,
    ServedModel,
    served_payload,
)
from hearthnet.distributed_inference.shard.server import ShardServer, ShardSettings
from hearthnet.errors import (
    AuthError,
    BadRequest,
    ConfigError,
    HearthNetError,
    InternalError,
    ListenFailed,
    ModelUnusable,
    PortInUse,
    Refused,
    ShardUnavailable,
    StorageError,
    WeightsMismatch,
)
from hearthnet.frames import StreamFrame, is_incident
from hearthnet.mesh.bus import BUS_PATH, CapabilityBus, bus_call
from hearthnet.mesh.discovery import DiscoveredPeers, LanDiscovery
from hearthnet.mesh.eventlog import EVENT_TYPES, Event, EventLog, EventType
from hearthnet.mesh.gossip import (
    CLOSE_TIMEOUT_S,
    GOSSIP_PATH,
    MAX_MESSAGE_BYTES,
    GossipPeerLink,
    handle_gossip_connection,
)
from hearthnet.mesh.join_announce import JoinAnnouncer
from hearthnet.mesh.links import VIA_AD, VIA_MDNS, Known, LinkKeeper, OnEnd
from hearthnet.models.store import HeadKey, ModelEntry, ModelStore
from hearthnet.node.capabilities import CHAT_CAPABILITY, SERVED_MODELS_CAPABILITY
from hearthnet.node.fetch import (
    HELD,
    MANIFEST_CAPABILITY,
    READ_CAPABILITY,
    STALE_STAGING_S,
    WEIGHTS_CAPABILITIES,
    HeldModels,
    WeightsFetcher,
    WeightsService,
    held_payload,
    remove_stale_staging,
)
from hearthnet.node.guard import NodeGuard, remove_state, write_state
from hearthnet.node.supervise import Supervisor
from hearthnet.node.threads import serial_torch_here
from hearthnet.observability import Metrics, get_logger, progress
from hearthnet.security import note_refusal, split_open
from hearthnet.security.joining import (
    DEFAULT_TTL_S,
    INVITE_CAPABILITY,
    JOIN_PATH,
    MAX_JOIN_MESSAGE_BYTES,
    Card,
    InviteBook,
    JoinCode,
    lan_address,
    merge_member_file,
    serve_join,
    welcome_map,
)
from hearthnet.security.keys import encode_public_key
from hearthnet.security.members import Member, Trust
from hearthnet.transport.codec import max_frame_bytes
from hearthnet.transport.websocket import SHARD_PATH, ServerStream, TensorChannel

log = get_logger("node")
# A steward's record that it admitted a member with a join code (M26 §5.8): members whose
# lists name the origin a steward add the member too. Only stewards may originate it (the
# guard's admission reads `min_trust`); folding never changes a listed member.
MEMBER_ADDED = EVENT_TYPES.register(EventType(
    "experimental.community.member_added", lambda p: f"community.member:{p['node_id']}",
    max_payload_bytes=1024, min_trust="steward"))
PREPARE_POLL_S = 1.0  # how often a node looks for models it has come to serve or orchestrate
STOP_STEP_S = 2.0  # the most one step of the shutdown waits (besides the drain itself)
DRAIN_POLL_S = 0.05  # how often the drain looks whether the open sessions have ended


class Node:
    """One HearthNet node; see the module docstring."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node.id
        # this process's boot id, in every advertisement: peers drop the advertisements of
        # an earlier process of this node as soon as they see one of this one's
        self.incarnation = uuid.uuid4().hex[:16]
        self.metrics = Metrics()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.bus = CapabilityBus(self.metrics)
        self.admin_bus = CapabilityBus(self.metrics)  # the local CLI's: the chat plus admin calls
        self.shards: dict[str, ShardServer] = {}
        self.auto: AutoHost | None = None
        self._placement: dict[str, dict[str, Any]] = {}  # shard_id -> advertised placement
        self.links: list[GossipPeerLink] = []
        self.server: Server | None = None
        self.admin_server: Server | None = None
        self.admin_uri = ""
        self.port = cfg.node.listen_port
        self._tasks: list[asyncio.Task[Any]] = []
        self._to_fetch: list[ShardSection] = []  # configured [[shards]] waiting for their weights
        self._held_said: dict[str, dict[str, Any]] = {}  # weights_sha256 -> last held event
        # a task that failed within three heartbeats is unhealthy, not silently dead
        self.supervisor = Supervisor(
            self.metrics, failing_window_s=max(5.0, 3 * cfg.di.heartbeat_interval_s))
        self._gossip_ws: dict[str, set[Any]] = {}  # incoming gossip connections by member
        self._stopping = asyncio.Event()  # set at SIGTERM/SIGINT: drain, refuse new work
        self._drain_cut = asyncio.Event()  # a second SIGTERM/SIGINT: stop draining now
        self._chats = 0  # chats this node orchestrates now (the drain waits for them)
        self._retiring: set[ShardServer] = set()  # dropped, still serving open sessions
        self.started_at = time.time()
        self.api: Any = None  # hearthnet.api.server.ApiServer once started
        self._metrics_server: Any = None  # prometheus_client's server, when configured
        self.discovery: LanDiscovery | None = None
        # gossip peers by node id: (connected, since) — incoming and outgoing links
        self.peer_links: dict[str, tuple[bool, float]] = {}
        self._peer_conns: dict[str, int] = {}  # gossip connections past the hello, by peer
        # the links to other members than the configured peers (mesh.links)
        self.keeper: LinkKeeper[GossipPeerLink] | None = None
        # recent shard_failover / pipeline_aborted / degraded frames, for the status page
        self.recent_events: deque[dict[str, Any]] = deque(maxlen=20)
        # one-time join codes, in memory only, and the plain listener that is open only
        # while one is pending (security/joining.py: SPAKE2 protects the exchange)
        self.invites = InviteBook()
        self.join_server: Server | None = None
        self._join_port = 0
        self._join_ads: JoinAnnouncer | None = None  # the invites' mDNS announcements
        self._join_ad_tasks: set[asyncio.Task[bool]] = set()

    # ---- lifecycle ----

    async def start(self) -> None:
        """Bring the node up in the order its parts depend on one another: the security
        guard and the event log, the directory folded from it, the listeners, the shards
        this node hosts, the orchestrator, the mesh links, the background tasks, the API,
        and last the `node_ready` line (and automatic hosting, which acts on all of them).
        """
        cfg = self.cfg
        torch.set_num_threads(cfg.node.torch_threads)  # the compute thread's
        serial_torch_here()  # the event loop's: one OpenMP team per process (node/threads.py)
        apply_large_blocks()  # HEARTHNET_LARGE_BLOCKS_MIB, before any shard loads (M26 §5.6)
        data = cfg.effective_data_dir()
        data.mkdir(parents=True, exist_ok=True)
        self._open_event_log()
        self._build_directory()
        await self._listen()
        await self._start_shards()
        self._build_orchestrator()
        await self._join_mesh()
        self._announce_held()
        if self._to_fetch:
            self.supervisor.spawn("fetch", self._fetch_and_host)  # retried: it resumes
        self.supervisor.spawn("heartbeat", self._heartbeat_loop)  # restarts if it dies
        self.supervisor.spawn("liveness", self.liveness.run)
        self._start_metrics()
        if cfg.distributed_enabled and cfg.di.prepare_heads_at_start:
            # heads + sanity bounds before the first call, of the models this node serves
            # or can orchestrate (as they become so); any other model's on first use
            self.supervisor.spawn("prepare", self._prepare_models)  # idempotent: retried
        await self._start_api()
        self._announce_ready(data)
        if cfg.auto_hosting:  # shards = "auto" (DESIGN.md decision 14)
            self.auto = AutoHost(cfg, log_=self.log, store=self.store, models=self.models,
                                 host=self, view=self.placement, liveness=self.liveness,
                                 executor=self.executor, usable=self.shard_usable,
                                 remote=self._remote_model,
                                 fetch_rate=lambda: self.fetcher.rate)
            self.auto.start()

    def _open_event_log(self) -> None:
        """The guard (key, members, TLS, limits) and the signed event log it admits to."""
        cfg = self.cfg
        self.guard = NodeGuard(cfg, self.metrics)  # key, members, TLS, limits (M26 §5.8)
        self._gate = self.guard.gate()
        # a corrupt log is set aside, not fatal: the peers hold copies of every event and
        # catch-up refills a fresh one, as after an emptied log (M26 §5.1); a full disk or
        # bad permissions stay a `StorageError` that stops the start
        self.log = EventLog(cfg.event_log_path(), self.node_id, metrics=self.metrics,
                            compact_retain_s=cfg.di.advertisement_expiry_s,
                            signer=self.guard.key.sign, admit=self.guard.admit_event,
                            set_aside_corrupt=True)
        # catch-up serves members' events only: a removed member's are dropped (§7)
        self.log.serve_filter = lambda origin: origin in self.guard.directory
        self.guard.on_reload.append(self._drop_removed_members)
        self.guard.stored_count = self.log.count_of  # per-origin event quotas (§5)
        self.log.subscribe(self._fold_member_event)  # new events only: never a replay

    def _build_directory(self) -> None:
        """Who hosts what: the store of advertisements, health, liveness and placement,
        folded from the event log and kept current by subscribing to it; and the models
        this node holds."""
        cfg = self.cfg
        self.health = ShardHealthTracker(
            offline_after_s=cfg.di.shard_health_timeout_seconds)
        self.store = ShardStore(cfg.di.advertisement_expiry_s,
                                lan_networks=cfg.node.lan_networks, metrics=self.metrics,
                                tracker=self.health)
        self.store.rebuild(self.log.all_events())
        self.log.subscribe(self.store.apply)
        self._withdraw_earlier_incarnations()
        # every node probes the hosts it sees advertised: a dead host shows in seconds
        self.liveness = HostLiveness(self.store, self.node_id,
                                     interval_s=cfg.di.host_probe_interval_seconds,
                                     failures=cfg.di.host_probe_failures)
        self.placement = PlacementView(self.guard.is_steward)
        self.placement.rebuild(self.log.all_events())
        self.log.subscribe(self.placement.apply)
        self.models = ModelStore(cfg.effective_models_dir())
        # who holds which layers of which model, and the fetch of missing ones (DESIGN.md
        # decision 17)
        self.held = HeldModels()
        self.held.rebuild(self.log.all_events())
        self.log.subscribe(self.held.apply)
        self.weights = WeightsService(self.models)
        for name in remove_stale_staging(self.models.root, time.time()):
            log.info("weights_fetch_abandoned", folder=name,
                     why=f"untouched for over {STALE_STAGING_S / 86400:.0f} days")
        self.fetcher = WeightsFetcher(self.models, self.held, self._weights_call,
                                      node_id=self.node_id, registry=self.metrics.registry,
                                      on_stored=self._announce_held)

    def _withdraw_earlier_incarnations(self) -> None:
        """An earlier process of this node (crashed, or stopped with its gossip down) may
        have left advertisements in the log that peers still hold: withdraw each one now,
        before this process advertises what it really hosts, so no peer routes or places
        by them (a restart keeps its id and address: liveness probes cannot tell)."""
        if not self.cfg.research.enable:
            return
        for ad in self.store.live():
            d = ad.descriptor
            if d.host == self.node_id and d.incarnation != self.incarnation:
                self.log.append(WITHDRAWN, withdrawal_payload(d.shard_id, "restarted"))

    async def _listen(self) -> None:
        """The main listener (mutual TLS for members) and the loopback admin listener."""
        cfg = self.cfg
        size = max(max_frame_bytes(cfg.di.chunk_bytes), MAX_MESSAGE_BYTES)
        with binding("the node listener", "[node] listen_port", cfg.node.listen_host,
                     cfg.node.listen_port):
            self.server = await serve(self._route, cfg.node.listen_host, cfg.node.listen_port,
                                      ssl=self.guard.server_ssl(),
                                      process_request=self._process, max_size=size,
                                      compression=None, ping_interval=20, ping_timeout=20,
                                      close_timeout=CLOSE_TIMEOUT_S)  # cut off floods
        self.port = self.server.sockets[0].getsockname()[1] if self.server.sockets else \
            cfg.node.listen_port
        if cfg.security.admin_port >= 0:
            with binding("the admin listener", "[security] admin_port", "127.0.0.1",
                         cfg.security.admin_port):
                self.admin_server = await serve(self._route_admin, "127.0.0.1",
                                                cfg.security.admin_port,
                                                process_request=self._http, max_size=size,
                                                compression=None)
            admin_port = self.admin_server.sockets[0].getsockname()[1]
            self.admin_uri = f"ws://127.0.0.1:{admin_port}"
        self.endpoint = cfg.endpoint(self.port)

    def _build_orchestrator(self) -> None:
        """The router over the directory and the orchestrator that serves chats."""
        cfg = self.cfg
        self.router = ShardRouter(self.store, RoutingSettings.from_config(cfg.di), self.health,
                                  self_node_id=self.node_id,
                                  host_allowed=self.guard.host_allowed,
                                  host_down=self.liveness.is_down)
        self.orchestrator = PipelineOrchestrator(
            models=self.models, router=self.router, health=self.health,
            metrics=self.metrics, connect=self._connect, executor=self.executor,
            defaults=DistributedChatParams(
                fallback_to_local=cfg.di.fallback_to_local, wire_dtype=cfg.di.activation_dtype,
                wire_wide_dtype=cfg.di.activation_wide_dtype,
                max_shards=cfg.di.max_shards_per_request,
                timeout_s=cfg.di.shard_health_timeout_seconds,
                fallback_after_failures=cfg.di.fallback_after_failures,
                weights=cfg.di.weights, speculate=cfg.di.speculate),
            enabled=cfg.distributed_enabled, sign_open=self.guard.sign_open,
            max_concurrent_pipelines=cfg.di.max_concurrent_pipelines,
            limits=PromptLimits(max_prompt_bytes=cfg.di.max_prompt_bytes,
                                max_prompt_tokens=cfg.di.max_prompt_tokens,
                                max_completion_tokens=cfg.di.max_completion_tokens),
            prefill_chunk_tokens=cfg.di.prefill_chunk_tokens,
            batch_window_ms=cfg.di.batch_window_ms,
            local_weights=cfg.di.head_weights,
            head_device=str(resolve_device(cfg.di.head_device)),  # absent: start-up error
            draft_models=cfg.di.draft_models, speculate_max_tokens=cfg.di.speculate_max_tokens,
            local_budget_mb=cfg.di.auto.memory_mb or cfg.di.host.shard_max_vram_mb,
            lanes=cfg.di.pipeline_lanes or None, prefix_sharing=cfg.di.prefix_sharing,
            compile_head=cfg.di.host.compile_decode)

    async def _join_mesh(self) -> None:
        """The bus capabilities, the links to configured peers, mDNS discovery, and the
        keeper of the links to other members (`mesh.links`)."""
        cfg = self.cfg
        self.bus.register(CHAT_CAPABILITY, self._chat_capability)
        self.admin_bus.register(CHAT_CAPABILITY, self._chat_capability)
        self.admin_bus.register(SERVED_MODELS_CAPABILITY, self._served_capability)
        self.admin_bus.register(INVITE_CAPABILITY, self._invite_capability)
        # members only, on the main listener (`_authorize_bus`); the local CLI needs no bytes
        self.bus.register(MANIFEST_CAPABILITY, self.weights.manifest)
        self.bus.register(READ_CAPABILITY, self.weights.read)
        for peer in cfg.peer_uris():
            self._link(peer)
        keeper = self.keeper = LinkKeeper(
            self.node_id, self.links,
            make_link=self._member_link, known=self._known_members,
            live=lambda: {p for p, n in self._peer_conns.items() if n > 0},
            is_member=lambda nid: nid in self.guard.directory,
            on_refused=self._refused_address, target=cfg.node.min_gossip_links)
        if cfg.node.discovery == "mdns":  # addresses only; TLS pins members (DESIGN.md decision 14)
            self.discovery = LanDiscovery(
                self.node_id, cfg.advertise_host(), self.port,
                "wss" if self.guard.tls else "ws",
                allowed=lambda nid: nid in self.guard.directory,
                on_found=lambda _nid, _uri: keeper.wake(),
                on_lost=lambda _nid, _uri: keeper.wake(),
                peers=DiscoveredPeers(linked=keeper.linked))
            await self.discovery.start()
        self.supervisor.spawn("links", keeper.run)  # restarts if it dies

    def _start_metrics(self) -> None:
        """A plain-HTTP /metrics for a LAN Prometheus, when a port is configured."""
        cfg = self.cfg
        if cfg.node.metrics_port:  # TLS-free: Prometheus scrapes plain HTTP
            from prometheus_client import start_http_server

            with binding("the metrics listener", "[node] metrics_port", cfg.node.listen_host,
                         cfg.node.metrics_port):
                self._metrics_server, _ = start_http_server(
                    cfg.node.metrics_port, addr=cfg.node.listen_host,
                    registry=self.metrics.registry)

    def _announce_ready(self, data: Path) -> None:
        """Log the start, write the node's state file (read by the CLI) and print the
        `node_ready` line that launchers wait for."""
        cfg = self.cfg
        for w in cfg.warnings():
            log.warning("config_warning", warning=w)
        log.info("node_started", endpoint=self.endpoint, admin=self.admin_uri,
                 tls=self.guard.tls, members=len(self.guard.directory),
                 shards=list(self.shards))
        ready = {"event": "node_ready", "node_id": self.node_id, "endpoint": self.endpoint,
                 "port": self.port, "admin": self.admin_uri, "pid": os.getpid(),
                 "shards": list(self.shards), "api": self.api.url if self.api else ""}
        write_state(data, {k: v for k, v in ready.items() if k != "event"})
        print(json.dumps(ready), flush=True)

    async def _start_shards(self) -> None:
        """Host the configured ranges this node's store holds; the others are fetched from
        the members that hold them once the node is in the mesh (`_fetch_and_host`)."""
        self._to_fetch = []
        for spec in self.cfg.hosted_shards():
            lo, hi = spec.layers
            if self.fetcher.needs(spec.model, lo, hi, head=False):
                self._to_fetch.append(spec)
                continue
            await self._host_shard(self.models.get(spec.model), lo, hi,
                                   spec.max_concurrent_streams, spec.weights, spec.device)

    async def _fetch_and_host(self) -> None:
        """Fetch each configured range the store lacks (and the head, when this node's API
        serves the LAN: it orchestrates the household's chats), then host it (DESIGN.md
        decision 17). A failed fetch is retried by the supervisor and resumes where it
        stopped."""
        while self._to_fetch:
            spec = self._to_fetch[0]
            lo, hi = spec.layers
            head = self.cfg.api.enabled and not self.cfg.api.loopback
            if self.fetcher.needs(spec.model, lo, hi, head):
                entry = await self.fetcher.fetch(spec.model, [(lo, hi)], head)
            else:
                entry = self.models.get(spec.model)
            await self._host_shard(entry, lo, hi, spec.max_concurrent_streams, spec.weights,
                                   spec.device)
            self._to_fetch.pop(0)

    async def _remote_model(self, served: ServedModel) -> ModelEntry | None:
        """Automatic hosting's view of a served model this store lacks: when a member holds
        it, its manifest and config are fetched (a partial model holding no layer yet),
        so it is placed like a stored one and its range fetched at load."""
        if not self.held.holders(served.weights_sha256, exclude=self.node_id):
            return None
        try:
            return await self.fetcher.fetch(served.weights_sha256, [], head=False, wait_s=0)
        except HearthNetError:
            return None  # logged by the fetcher; tried again on the next round

    def _announce_held(self, entry: ModelEntry | None = None) -> None:
        """Append what this node holds of each stored model (or of `entry`), so members
        can fetch from it (`node.fetch.HELD`; superseded per model)."""
        if not self.cfg.research.enable:
            return
        for e in [entry] if entry is not None else self.models.entries():
            payload = held_payload(e, self.endpoint)
            self.log.append(HELD, payload)
            self._held_said[e.weights_sha256] = payload

    def _announce_held_changes(self) -> None:
        """At each heartbeat: a model imported, fetched or removed since is announced (a
        removed one as holding nothing), so members never ask for what is gone."""
        if not self.cfg.research.enable:
            return
        now = {e.weights_sha256: e for e in self.models.entries()}
        for sha, e in now.items():
            if self._held_said.get(sha) != held_payload(e, self.endpoint):
                self._announce_held(e)
        for sha in [x for x in self._held_said if x not in now]:
            gone = {**self._held_said.pop(sha), "layers": [], "head": False}
            self.log.append(HELD, gone)

    async def _weights_call(self, node_id: str, capability: str, args: dict[str, Any]
                            ) -> AsyncGenerator[dict[str, Any], None]:
        """A weights call to member `node_id` at the endpoint of its held event, over TLS
        pinned to that member (M26 §5.8)."""
        holding = next((h for h in self.held.holders(str(args.get("model")))
                        if h.node_id == node_id), None)
        if holding is None:
            raise ShardUnavailable(f"{node_id} no longer says it holds this model")
        endpoint = holding.endpoint
        scheme = "wss" if self.guard.tls else "ws"
        uri = scheme + endpoint[endpoint.index("://"):]
        async for frame in bus_call(uri, capability, args, ssl=self.guard.client_ssl(node_id)):
            yield frame

    def _authorize_bus(self, capability: str, caller: str | None) -> None:
        """The main listener's bus policy: the guard's, and model bytes only to an
        authenticated member (a plaintext mesh has no identities to tell one)."""
        if capability in WEIGHTS_CAPABILITIES and caller is None:
            err = AuthError(f"{capability} serves members over mutual TLS only",
                            reason="unauthenticated")
            note_refusal(self.metrics, err, capability=capability)
            raise err
        self.guard.authorize_bus(capability, caller)

    async def _host_shard(self, entry: ModelEntry, lo: int, hi: int,
                          max_concurrent_streams: int, weights: str | None = None,
                          device: str | None = None) -> ShardServer:
        """Load layers `lo..hi` of `entry` held as `weights` (default: the host's) on
        `device` (default: the host's), serve and advertise them."""
        host = self.cfg.di.host
        entry.require_layers(lo, hi)  # a partial model: only the layers it holds
        # built off the event loop: planning reads the model's config, whose first read
        # imports transformers (seconds on a busy machine, and /status must keep answering)
        shard = await asyncio.to_thread(functools.partial(
            ShardServer, entry, lo, hi, node_id=self.node_id, endpoint=self.endpoint,
            settings=ShardSettings(
                max_concurrent_streams=max_concurrent_streams,
                eviction_idle_s=host.shard_eviction_idle_seconds,
                session_idle_timeout_s=host.session_idle_timeout_seconds,
                max_session_tokens=host.max_session_tokens,
                weights=weights or host.weights or default_held(host.compute_dtype,
                                                                entry.q4_blocks),
                max_vram_mb=host.shard_max_vram_mb,
                prefill_chunk_tokens=self.cfg.di.prefill_chunk_tokens,
                device=device or host.device, cuda_graphs=host.cuda_graphs,
                compile_decode=host.compile_decode,
                compile_dir=compile_dir_of(entry), incarnation=self.incarnation,
                batch_window_ms=self.cfg.di.batch_window_ms,
                mixed_prefill_tokens=self.cfg.di.mixed_prefill_tokens),
            executor=self.executor, metrics=self.metrics))
        async with progress(log, "shard_load", model=entry.alias, layers=[lo, hi]):
            await shard.start()
        self.shards[shard.shard_id] = shard
        await self._advertise(shard)
        return shard

    @property
    def stopping(self) -> bool:
        """True from SIGTERM/SIGINT (or `stop`) on: the node drains and takes no new work."""
        return self._stopping.is_set()

    def _refuse_when_stopping(self, what: str) -> None:
        """Raise a stopping node's refusal: `shard_unavailable` and not busy, so an
        orchestrator fails over at once instead of waiting for a slot here (M26 §5.6)."""
        if self.stopping:
            raise ShardUnavailable(f"node {self.node_id} is shutting down and {what}; "
                                   "use another node", stopping=True, node=self.node_id)

    # ---- automatic hosting (DESIGN.md decision 14; `AutoHost` drives these) ----

    def hosted(self) -> list[ShardServer]:
        return list(self.shards.values())

    async def load_shard(self, entry: ModelEntry, lo: int, hi: int,
                         placement: dict[str, Any]) -> ShardServer:
        """Load and advertise an automatically placed shard (its ad carries `placement`).

        Raises:
            ShardUnavailable: the node is stopping (it hosts nothing new), also when the
                stop began while the layers loaded: the shard is never served.
        """
        self._refuse_when_stopping("loads no new shard")
        if entry.missing_layers(lo, hi):  # a member holds them (DESIGN.md decision 17)
            entry = await self.fetcher.fetch(entry.weights_sha256, [(lo, hi)], head=False)
            self._refuse_when_stopping("loads no new shard")
        sid = make_shard_id(entry.model_id, lo, hi, self.node_id)
        self._placement[sid] = placement
        shard = await self._host_shard(entry, lo, hi, 8)
        if self.stopping:  # began while it loaded: never advertised (`_advertise`), freed
            self.shards.pop(sid, None)
            shard.stack = None
        self._refuse_when_stopping("loads no new shard")
        return shard

    async def drop_shard(self, shard_id: str, reason: str) -> None:
        """Withdraw a shard now, free it once its open sessions have ended (no failed chat)."""
        shard = self.shards.pop(shard_id, None)
        if shard is None:
            return
        self._placement.pop(shard_id, None)
        if self.cfg.research.enable:
            self.log.append(WITHDRAWN, withdrawal_payload(shard_id, reason))
        # until freed, a node stopping meanwhile drains and closes its sessions too (this
        # wait is cancelled by the stop, and the shard stays in the set for it)
        self._retiring.add(shard)
        limit = time.monotonic() + self.cfg.di.host.session_idle_timeout_seconds
        while shard.active and time.monotonic() < limit:
            await asyncio.sleep(0.2)
        await shard.close_all()
        shard.stack = None
        self._retiring.discard(shard)
        log.info("shard_dropped", shard_id=shard_id, reason=reason)

    async def _start_api(self) -> None:
        """The OpenAI-compatible API and the status page (DESIGN.md decision 13), if enabled."""
        api = self.cfg.api
        if not api.enabled:
            return
        from hearthnet.api.openai_compat import Limits
        from hearthnet.api.server import ApiServer

        self.api = ApiServer(self, listen_host=api.listen_host, listen_port=api.listen_port,
                             keys=self.cfg.api_keys(), require_key=not api.loopback,
                             max_body_bytes=api.max_body_bytes,
                             limits=Limits(max_messages=api.max_messages,
                                           max_tokens=api.max_tokens,
                                           default_max_tokens=api.default_max_tokens),
                             allowed_hosts=api.allowed_hosts,
                             allowed_origins=api.allowed_origins,
                             read_timeout_s=api.read_timeout_s)
        with binding("the HTTP API", "[api] listen_port", api.listen_host, api.listen_port):
            await self.api.start()

    def _link(self, uri: str) -> None:
        """Keep a gossip link to `uri` (a configured peer), once, for as long as the node
        runs; links to other members are the keeper's (`_join_mesh`)."""
        if any(link.uri == uri.rstrip("/") for link in self.links):
            return
        link = GossipPeerLink(
            self.log, uri, on_peer=self._on_peer,
            ssl_factory=(lambda: self.guard.client_ssl(None)) if self.guard.tls else None,
            check_peer=self.guard.peer_of if self.guard.tls else None)
        link.start()
        self.links.append(link)

    def _on_peer(self, peer: str, connected: bool) -> None:
        """A gossip connection to `peer` (in or out) came up or went down (status: peers,
        killed hosts; the keeper: which members are linked). A peer stays connected while
        any of its connections is: one dialled each way is common."""
        n = max(0, self._peer_conns.get(peer, 0) + (1 if connected else -1))
        self._peer_conns[peer] = n
        was = self.peer_links.get(peer)
        if was is None or was[0] != (n > 0):
            self.peer_links[peer] = (n > 0, time.time())
        if self.keeper is not None:
            self.keeper.wake()

    def _member_link(self, node_id: str, uri: str, on_end: OnEnd) -> GossipPeerLink:
        """A link the keeper manages to member `node_id` at `uri`: TLS pinned to that one
        member's key, its hello must name it (M26 §5.8), one connection, no redial."""
        tls = self.guard.tls
        return GossipPeerLink(
            self.log, uri, on_peer=self._on_peer, expect_peer=node_id, redial=False,
            on_end=on_end,
            ssl_factory=(lambda: self.guard.client_ssl(node_id)) if tls else None,
            check_peer=(lambda ws: self.guard.peer_of(ws, expect=node_id)) if tls else None)

    def _known_members(self) -> list[Known]:
        """The members' addresses this node knows: the endpoint each host signed into its
        newest advertisement (stale when its heartbeats stopped arriving: 3 heartbeat
        intervals, well before the ads expire at 8), then the addresses discovered."""
        scheme = "wss" if self.guard.tls else "ws"  # never dial ws:// when TLS is on
        stale_after = 3 * self.cfg.di.heartbeat_interval_s
        now = time.time()
        newest: dict[str, Advertisement] = {}
        for ad in self.store.live():
            held = newest.get(ad.descriptor.host)
            if held is None or ad.seen_at > held.seen_at:
                newest[ad.descriptor.host] = ad
        out = []
        for host, ad in newest.items():
            endpoint = ad.descriptor.endpoint  # checked: ws:// or wss://
            out.append(Known(host, scheme + endpoint[endpoint.index("://"):], VIA_AD,
                             stale=now - ad.seen_at > stale_after))
        if self.discovery is not None:
            out += [Known(nid, uri, VIA_MDNS) for nid, uri in self.discovery.current().items()]
        return out

    def _refused_address(self, node_id: str, uri: str) -> None:
        """A dial of `node_id` at `uri` was refused: discovery forgets that address."""
        if self.discovery is not None:
            self.discovery.forget(node_id, uri)

    # ---- the API's view of this node (hearthnet.api.server.ApiHost) ----

    def chat(self, args: dict[str, Any]) -> AsyncGenerator[StreamFrame, None]:
        """A chat call in-process, as over ``/bus`` but typed (the API reads the frames)."""
        return self._chat(args)

    def model_known(self, name: str) -> None:
        """Raises `ModelNotFound` unless `name` is a stored model."""
        self.models.get(name)

    def pipelines_free(self) -> bool:
        return self.orchestrator.has_free_slot()

    async def _check_weights(self, shard: ShardServer) -> None:
        """Before each session open and each heartbeat (a truncated mmap would SIGBUS): a hosted
        weights file truncated, replaced or removed under the running shard withdraws the shard
        (logged `shard_weights_changed`); the caller gets the `weights_mismatch` error."""
        try:
            await shard.check_weights()
        except WeightsMismatch as e:
            if self.shards.get(shard.shard_id) is shard:
                log.error("shard_weights_changed", shard_id=shard.shard_id,
                          file=e.details.get("file"), message=e.message)
                detach(self.drop_shard(shard.shard_id, "weights_changed"))
            raise

    async def _advertise(self, shard: ShardServer) -> None:
        if not self.cfg.research.enable:  # M26 §5.1: opted out → no advertisements
            return
        if self.stopping:  # withdrawn by the stop: a late heartbeat or load must not revive it
            return
        payload = advertisement_payload(shard.descriptor, await shard.health())
        if shard.shard_id in self._placement:
            payload["placement"] = self._placement[shard.shard_id]
        self.log.append(ADVERTISED, payload)

    async def _prepare_models(self) -> None:
        """Prepare the head of every stored model this node serves layers of or that the
        mesh covers whole (a call of it can be orchestrated here), once, as each becomes
        so: a head is the embeddings and lm_head (a 7B's is GBs), so a model nobody can
        run here is not loaded until a call asks for it. Ends once every stored model is
        prepared (a model imported later is prepared by its first call)."""
        done: set[HeadKey] = set()  # the orchestrator's key: a re-imported template counts
        while True:
            entries = self.models.entries()
            for e in entries:
                key = e.head_key()
                if not e.holds_head:  # a partial model of some layers: no head to prepare
                    done.add(key)
                if key in done or not self._runs_here(e):
                    continue
                done.add(key)
                try:
                    async with progress(log, "head_load", model=e.alias):
                        await self.orchestrator.prepare(e.alias)
                except ModelUnusable:
                    pass  # logged once by the orchestrator, with its cause; calls get it
                except HearthNetError as err:
                    log.warning("model_prepare_failed", model=e.alias, code=err.code,
                                message=err.message)
            if all(e.head_key() in done for e in entries):
                return
            await asyncio.sleep(PREPARE_POLL_S)

    def _runs_here(self, e: ModelEntry) -> bool:
        """This node serves layers of `e`, or usable live shards hold all of its layers."""
        return any(s.entry.weights_sha256 == e.weights_sha256 for s in self.shards.values()) \
            or self.store.covers(e.model_id, e.weights_sha256, e.num_layers,
                                 lambda ad: self.shard_usable(ad, e))

    def default_formats(self, e: ModelEntry) -> frozenset[str]:
        """The shard formats a call of `e` accepts under this node's default policy
        (`[research.distributed_inference] weights`)."""
        return formats_for(self.cfg.di.weights, self.cfg.di.head_weights, e)

    def shard_usable(self, ad: Advertisement, e: ModelEntry) -> bool:
        """Whether a default call of `e` from this node may use `ad`'s shard: the router's
        one definition (`ShardRouter.usable_host`), shared by automatic hosting, head
        preparation and the coverage `status` shows."""
        return self.router.usable_host(ad, self.default_formats(e))

    async def _heartbeat_loop(self) -> None:
        """Re-advertise every health timeout / 2 with health; evict idle weights."""
        interval = self.cfg.di.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            for shard in list(self.shards.values()):
                try:
                    await self._check_weights(shard)
                except WeightsMismatch:
                    continue  # withdrawn, never re-advertised
                if shard.maybe_evict_idle():
                    await shard.evict()
                await self._advertise(shard)
            self.store.expire()
            self._announce_held_changes()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then stop cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._signalled)
        with contextlib.suppress(NotImplementedError, AttributeError):
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        starting = asyncio.ensure_future(self.start())
        told = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({starting, told}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            told.cancel()
        if starting.done():
            starting.result()  # a failed start raises here: nothing was served, no stop
        else:  # told to stop mid-start (a long shard load): stop what is up so far
            log.info("start_interrupted")
            await cancel_and_wait([starting], STOP_STEP_S)
        try:
            await self._stopping.wait()
        finally:
            await self.stop()

    def _signalled(self) -> None:
        """SIGTERM/SIGINT: stop, draining the open sessions; a second one (Ctrl-C twice)
        ends the drain at once."""
        if self._stopping.is_set():
            self._drain_cut.set()
        self._stopping.set()

    def reload(self) -> bool:
        """Re-read the config's member list and trust minimums (SIGHUP): no restart needed."""
        return self.guard.reload() if hasattr(self, "guard") else False

    def _drop_removed_members(self) -> None:
        """After a reload: close the gossip links and shard sessions of
        members no longer in the list; their events are no longer served (`serve_filter`)."""
        gone = [p for p in self._gossip_ws if p and p not in self.guard.directory]
        for peer in gone:
            for ws in list(self._gossip_ws.pop(peer, ())):
                detach(ws.close(CloseCode.POLICY_VIOLATION, "member removed"))
        for link in self.links:
            if link.peer_id is not None and link.peer_id not in self.guard.directory:
                link.drop_connection()
        for shard in self.shards.values():
            shard.close_callers(lambda c: c not in self.guard.directory)
        if gone:
            log.info("members_dropped", peers=gone)

    async def stop(self) -> None:
        """Stop within the drain timeout (``[node] drain_timeout_seconds``): refuse new
        sessions, chats and shard loads, end every background loop, withdraw the
        advertisements, let the open shard sessions and chats finish (M26 §4.2: a leaving
        host fails no call it serves), then close what is left and flush the log. Every
        step is bounded: a task that swallows its cancellation is logged and left."""
        self._stopping.set()
        drain_s = self.cfg.node.drain_timeout_seconds
        deadline = time.monotonic() + drain_s
        log.info("node_stopping", drain_timeout_s=drain_s)
        if self.auto is not None:
            await self.auto.stop(STOP_STEP_S)
        if hasattr(self, "guard"):
            remove_state(self.cfg.effective_data_dir())
        await cancel_and_wait(self._tasks, STOP_STEP_S)
        await self.supervisor.stop(STOP_STEP_S)
        self._withdraw_all()
        if self.links and self.shards:
            await asyncio.sleep(0.3)  # let the live push carry the withdrawals out
        await self._drain(deadline)
        for shard in [*self.shards.values(), *self._retiring]:
            await bounded("close_sessions", shard.close_all(), STOP_STEP_S)
        discovery: LanDiscovery | None = getattr(self, "discovery", None)
        if discovery is not None:
            await bounded("discovery", discovery.stop(), STOP_STEP_S)
        await bounded("gossip_links", asyncio.gather(*(link.stop() for link in self.links)),
                      STOP_STEP_S)
        if self.api is not None:
            await bounded("api", self.api.stop(), STOP_STEP_S)
        for server in (self.server, self.admin_server, self.join_server):
            if server is not None:
                server.close()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2):
                        await server.wait_closed()
        if getattr(self, "_metrics_server", None) is not None:
            self._metrics_server.shutdown()
        self.log.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        log.info("node_stopped")

    def _withdraw_all(self) -> None:
        """Withdraw every hosted shard (routers stop picking them at once, M26 §5.1); a
        failing log write is logged by the log and must not stop the shutdown."""
        if not self.cfg.research.enable:
            return
        for sid in self.shards:
            with contextlib.suppress(StorageError):
                self.log.append(WITHDRAWN, withdrawal_payload(sid, "shutdown"))

    def _open_work(self) -> tuple[int, int]:
        """(open shard sessions, chats orchestrated here) now."""
        return sum(s.active for s in (*self.shards.values(), *self._retiring)), self._chats

    async def _drain(self, deadline: float) -> None:
        """Wait until the open shard sessions and chats have ended, or `deadline`
        (monotonic): a session open at SIGTERM finishes its answer (new ones are refused
        `shard_unavailable`, so orchestrators fail over)."""
        sessions, chats = self._open_work()
        if not (sessions or chats):
            return
        t0 = time.monotonic()
        log.info("node_draining", sessions=sessions, chats=chats,
                 timeout_s=round(max(0.0, deadline - t0), 1))
        while (sessions or chats) and time.monotonic() < deadline and \
                not self._drain_cut.is_set():
            await asyncio.sleep(DRAIN_POLL_S)
            sessions, chats = self._open_work()
        if sessions or chats:
            log.warning("drain_timed_out", sessions=sessions, chats=chats,
                        timeout_s=self.cfg.node.drain_timeout_seconds,
                        second_signal=self._drain_cut.is_set())
        else:
            log.info("node_drained", seconds=round(time.monotonic() - t0, 2))

    # ---- connections ----

    async def _route(self, ws: ServerConnection) -> None:
        path = ws.request.path.split("?", 1)[0] if ws.request else ""
        addr = ws.remote_address
        try:
            peer = self.guard.peer_of(ws)  # the TLS member; None in plaintext mode
            with self.guard.connection(peer or str(addr[0] if addr else "?")):
                if path == SHARD_PATH:
                    await self._serve_shard(ws, peer)
                elif path == GOSSIP_PATH:
                    self._gossip_ws.setdefault(peer or "", set()).add(ws)
                    try:  # the hello must name the TLS peer: no posing
                        await handle_gossip_connection(
                            self.log, self.guard.rate_limited(ws, peer or str(
                                addr[0] if addr else "?")),
                            on_peer=self._on_peer, expect_peer=peer)
                    finally:
                        self._gossip_ws.get(peer or "", set()).discard(ws)
                elif path == BUS_PATH:  # a member's call, under the bus's own trust (§4)
                    await self.bus.serve_connection(ws, caller=peer,
                                                    authorize=self._authorize_bus)
                else:
                    await ws.close(CloseCode.POLICY_VIOLATION, "unknown path")
        except Refused as e:  # not a member, over a connection or rate limit
            note_refusal(self.metrics, e, peer=e.details.get("peer"), path=path[:64])
            with contextlib.suppress(Exception):
                await ws.close(CloseCode.POLICY_VIOLATION, str(e.details.get("reason", "refused")))

    async def _route_admin(self, ws: ServerConnection) -> None:
        """The loopback admin listener: capability calls of the local CLI only."""
        path = ws.request.path.split("?", 1)[0] if ws.request else ""
        if path == BUS_PATH:
            await self.admin_bus.serve_connection(ws)
        else:
            await ws.close(CloseCode.POLICY_VIOLATION, "the admin listener serves /bus only")

    async def _serve_shard(self, ws: ServerConnection, peer: str | None = None) -> None:
        di = self.cfg.di
        try:
            stream = await ServerStream.accept_open(
                ws, window=di.flow_control_window, chunk_bytes=di.chunk_bytes,
                max_tensor_bytes=self._max_tensor_bytes(),
                deadline_s=di.shard_health_timeout_seconds, metrics=self.metrics)
        except HearthNetError as e:
            log.info("shard_open_failed", code=e.code, peer=peer)
            return
        try:  # M26 §5.8: authenticate before any shard work or weight reload
            caller = self.guard.verify_open(stream.open_params, peer)
        except Refused as e:
            await stream.refuse(e)
            return
        params, _ = split_open(stream.open_params)
        try:
            self._refuse_when_stopping("takes no new session")  # open ones are drained
            shard = self.shards.get(str(params.get("shard_id")))
            if shard is None:
                raise ShardUnavailable(f"this node does not host {params.get('shard_id')!r}; "
                                       f"it hosts {sorted(self.shards)}")
            await self._check_weights(shard)
            req = shard.validate_open(params, caller=caller)
        except HearthNetError as e:
            sid = str(params.get("shard_id"))[:200]
            self.metrics.shard_sessions_total.labels(sid, e.code, caller).inc()
            await stream.refuse(e)
            return
        try:
            with self.guard.limiter.session(caller):
                await shard.serve_session(stream, req)
        except Refused as e:  # too many sessions of this caller
            note_refusal(self.metrics, e, caller=caller, shard_id=shard.shard_id)
            if not stream.closed:
                await stream.refuse(e)
        except HearthNetError as e:
            if not stream.closed:
                await stream.refuse(e)
        except Exception:  # a bug: the caller gets `internal`, the log the traceback
            log.exception("shard_session_failed", shard_id=shard.shard_id, caller=caller)
            if not stream.closed:
                await stream.refuse(InternalError("internal error on the shard host; "
                                                  "see its log"))
        finally:
            await stream.close()

    def _max_tensor_bytes(self) -> int:
        """The largest tensor any hosted shard's session can legitimately send: every
        position it may hold at the hidden width in fp32, no more; each accepted
        session then lowers it to its own `max_length` and wire dtype."""
        tokens = self.cfg.di.host.max_session_tokens
        return max((tokens * s.entry.hidden_size * 4 for s in self.shards.values()),
                   default=1)

    async def _connect(self, uri: str, params: dict[str, Any],
                       deadline_s: float) -> TensorChannel:
        di = self.cfg.di
        host = str(params.get("shard_id", "")).rsplit("@", 1)[-1]
        ssl = self.guard.client_ssl(host)  # pinned to the shard's host (M26 §5.8)
        if ssl is not None and not uri.startswith("wss://"):
            raise AuthError(f"refusing to send activations to {host} over plaintext {uri}",
                            reason="plaintext_peer")
        ch = await TensorChannel.connect(uri, params, window=di.flow_control_window,
                                         chunk_bytes=di.chunk_bytes, deadline_s=deadline_s,
                                         ssl=ssl, metrics=self.metrics)
        try:
            self.guard.peer_of(ch.connection, expect=host)
        except AuthError:
            await ch.close("unexpected peer")
            raise
        return ch

    async def _process(self, conn: ServerConnection, request: Request) -> Response | None:
        """The listener's ``process_request``: member gate (TLS), then HTTP paths."""
        if self._gate is not None:
            refused: Response | None = await self._gate(conn, request)
            if refused is not None:
                return refused
        if request.headers.get("Upgrade", "").lower() != "websocket":
            # plain HTTP paths share the peer's connection-rate bucket, like upgrades
            addr = conn.remote_address
            peer = self.guard.peer_of(conn) if self.guard.tls else None
            who = peer or str(addr[0] if addr else "?")
            if not self.guard.rate.allow(who):
                note_refusal(self.metrics, AuthError(f"too many requests from {who}",
                                                     reason="rate_limited"),
                             peer=who, path=request.path[:64])
                return _json(HTTPStatus.TOO_MANY_REQUESTS, {"error": "rate limited"})
        return await self._http(conn, request)

    async def _chat_capability(self, args: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """The chat over ``/bus``: each frame as its wire map (`hearthnet.frames`)."""
        async with contextlib.aclosing(self._chat(args)) as it:
            async for frame in it:
                yield frame.to_wire()

    async def _chat(self, args: dict[str, Any]) -> AsyncGenerator[StreamFrame, None]:
        request = ChatRequest.from_dict(args.get("request", {}))
        params = DistributedChatParams.from_dict(args.get("params", {}),
                                                 self.orchestrator.defaults)
        self._refuse_when_stopping("takes no new chat")  # the open ones are drained
        self._chats += 1
        try:
            async with contextlib.aclosing(self.orchestrator.chat(request, params)) as it:
                async for frame in it:
                    if is_incident(frame):
                        self.recent_events.append({**frame.to_wire(), "time": time.time()})
                    yield frame
        finally:
            self._chats -= 1

    async def _served_capability(self, args: dict[str, Any]
                                 ) -> AsyncGenerator[dict[str, Any], None]:
        """Edit or read the served-model list (``hearthnet models serve|unserve|served``)."""
        op, name = args.get("op"), args.get("model")
        if op not in ("serve", "unserve", "list"):
            raise BadRequest("op must be serve, unserve or list")
        if op != "list":
            yield {"type": "served_models", **self._edit_served(str(op), name)}
        yield {"type": "served_models", "models": [m.to_dict() for m in
                                                   self.placement.served()],
               **self.placement.served_meta()}

    def _edit_served(self, op: str, name: object) -> dict[str, Any]:
        if not isinstance(name, str) or not name:
            raise BadRequest("model must be a model alias or id")
        if not self.guard.is_steward(self.node_id):  # only a steward edits the list
            raise AuthError(f"{self.node_id} is not a steward of this community; only a "
                            "steward edits the served-model list", reason="not_steward")
        current = self.placement.served()
        entry = self.models.get(name) if op == "serve" else None
        keep = [m for m in current if name not in (m.model_id, m.alias)]
        if op == "unserve" and len(keep) == len(current):
            raise BadRequest(f"{name!r} is not on the served-model list")
        new = keep + ([ServedModel(entry.model_id, entry.weights_sha256, entry.alias)]
                      if entry is not None else [])
        self.log.append(SERVED_MODELS, served_payload(new))
        return {"changed": op, "model": name}

    # ---- joining with a one-time code (docs/security.md: Joining with a code) ----

    async def _invite_capability(self, args: dict[str, Any]
                                 ) -> AsyncGenerator[dict[str, Any], None]:
        """Issue an invite (``hearthnet invite``): the code is printed by the local CLI
        and kept only here, in memory; it is never logged."""
        ttl = args.get("ttl_s", DEFAULT_TTL_S)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise BadRequest("ttl_s must be a number of seconds")
        self._refuse_when_stopping("issues no invite")
        secret = self.invites.issue(float(ttl), time.monotonic())
        await self._open_join_door()
        asyncio.get_running_loop().call_later(float(ttl) + 0.1, self._close_join_door)
        code = JoinCode(secret, self._join_host(), self._join_port)
        announced = await self._announce_invites()
        log.info("invite_issued", expires_in_s=ttl, pending=len(self.invites),
                 announced=announced)
        yield {"type": "invite", "code": code.text(), "short": code.short(),
               "announced": announced, "node_id": self.node_id, "expires_in_s": ttl}

    async def _announce_invites(self) -> bool:
        """Announce the pending invites by mDNS and withdraw the others (used, burnt,
        expired), where the node uses mDNS discovery (mesh/join_announce.py: the
        announcement carries the invite's public id only); whether it announces now."""
        zc = self.discovery.zeroconf if self.discovery is not None else None
        if zc is None or self.discovery is None:
            return False
        if self._join_ads is None:
            self._join_ads = JoinAnnouncer(zc, self.node_id, self.discovery.ip)
        return await self._join_ads.sync(self.invites.pending_ids(), self._join_port)

    def _join_host(self) -> str:
        """The address a joiner on the LAN dials: the advertised host, else (a wildcard
        listener) this machine's address on its default route."""
        host = self.cfg.advertise_host()
        return lan_address() if host in ("", "0.0.0.0", "::") else host

    async def _open_join_door(self) -> None:
        if self.join_server is not None:
            return
        host = self.cfg.node.listen_host
        with binding("the join listener", "[node] listen_host", host, 0):
            self.join_server = await serve(self._serve_join, host, 0,
                                           max_size=MAX_JOIN_MESSAGE_BYTES, compression=None)
        self._join_port = self.join_server.sockets[0].getsockname()[1]
        log.info("join_listener_open", port=self._join_port)

    def _close_join_door(self) -> None:
        """Close the join listener once no invite is pending (used, burnt or expired)."""
        self.invites.expire(time.monotonic())
        if self._join_ads is not None and self._join_ads.announced != \
                self.invites.pending_ids():  # withdraw the announcements of gone invites
            task = asyncio.get_running_loop().create_task(self._announce_invites())
            self._join_ad_tasks.add(task)
            task.add_done_callback(self._join_ad_tasks.discard)
        if self.join_server is not None and not len(self.invites):
            self.join_server.close()
            self.join_server = None
            log.info("join_listener_closed")

    async def _serve_join(self, ws: ServerConnection) -> None:
        """One joiner's exchange; refusals are counted like every other (`auth_failed`)."""
        path = ws.request.path.split("?", 1)[0] if ws.request else ""
        addr = ws.remote_address
        who = str(addr[0]) if addr else "?"
        if path != JOIN_PATH:
            await ws.close(CloseCode.POLICY_VIOLATION, "the join listener serves /join only")
            return
        try:
            with self.guard.connection("join:" + who):
                outcome = await serve_join(ws, self.invites, self._admit_joiner,
                                           time.monotonic)
        except Refused as e:
            note_refusal(self.metrics, e, peer=who, path=JOIN_PATH)
            return
        if outcome.result == "joined":
            print(json.dumps({"event": "member_joined", "node_id": outcome.node_id}),
                  flush=True)
        elif outcome.result in ("wrong_code", "burnt"):
            note_refusal(self.metrics, AuthError("wrong invite code", reason="wrong_code"),
                         peer=who, invite_burnt=outcome.result == "burnt")
        else:
            log.info("join_ended", result=outcome.result, reason=outcome.reason, peer=who)
        self._close_join_door()

    async def _admit_joiner(self, card: Card) -> dict[str, Any]:
        """Add a joiner whose code proved right: trust ``trusted``, written to
        ``<data_dir>/members.toml`` (kept over restarts) and applied as a reload is."""
        d = self.guard.directory
        if card.node_id in d:
            raise AuthError(f"{card.node_id} is a member of this community already: give "
                            "the new node another name (`hearthnet init --name ...`)",
                            reason="node_id_taken")
        if d.by_public_key(card.public_key) is not None:
            raise AuthError("this node's key belongs to a member already",
                            reason="key_taken")
        row = {"node_id": card.node_id, "public_key": encode_public_key(card.public_key),
               "trust": Trust.TRUSTED.label}
        merge_member_file(self.cfg.effective_data_dir(), [row],
                          f"members that joined {self.node_id} with `hearthnet join`")
        self._add_member(row)
        if self.guard.is_steward(self.node_id):  # others fold a steward's only
            self.log.append(MEMBER_ADDED, row)
        log.info("member_joined", node_id=card.node_id, trust=row["trust"])
        return welcome_map(self.node_id, [m.to_dict() for m in d.members()], self.port,
                           self.guard.tls)

    def _add_member(self, row: dict[str, str]) -> None:
        """Append a member to ``<data_dir>/members.toml`` and apply it as a reload does."""
        merge_member_file(self.cfg.effective_data_dir(), [row],
                          f"members added to {self.node_id} by `hearthnet join`")
        if not self.reload():  # a config built in code (tests): apply in memory
            d = self.guard.directory
            d.replace([*(m.to_dict() for m in d.members()), row])

    def _fold_member_event(self, ev: Event) -> None:
        """Another steward admitted a member (`MEMBER_ADDED`): add it here too, if it is
        not listed yet, at most ``trusted``; a listed id or key is never changed by an
        event (a key swap through the log would let one steward take over a member)."""
        if ev.type != MEMBER_ADDED or ev.origin == self.node_id \
                or not self.guard.is_steward(ev.origin):
            return
        try:
            m = Member.from_dict(ev.payload)
        except ConfigError:
            log.warning("member_event_ignored", origin=ev.origin, reason="malformed")
            return
        d = self.guard.directory
        if m.trust > Trust.TRUSTED or m.node_id in d \
                or d.by_public_key(m.public_key_raw) is not None:
            if d.get(m.node_id) != m:
                log.warning("member_event_ignored", origin=ev.origin, node_id=m.node_id,
                            reason="conflicts with the member list")
            return
        self._add_member(m.to_dict())
        log.info("member_added", node_id=m.node_id, by=ev.origin, trust=m.trust.label)

    # ---- HTTP ----

    async def _http(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None
        if path == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render(),
                             "text/plain; version=0.0.4; charset=utf-8")
        if path == "/health":  # a failing or dead task makes the node unhealthy (§6)
            ok = self.supervisor.healthy()
            return _json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                         {"node_id": self.node_id, "online": True, "healthy": ok,
                          "tasks": self.supervisor.health(),
                          "uptime_s": round(time.time() - self.started_at, 1)})
        if path == "/status":
            return _json(HTTPStatus.OK, await self.status())
        return _json(HTTPStatus.NOT_FOUND, {"error": "not found",
                                            "paths": ["/metrics", "/health", "/status"]})

    async def status(self) -> dict[str, Any]:
        """What this node knows of the mesh (`hearthnet status`)."""
        from hearthnet.node.status import mesh_status

        return await mesh_status(self)


async def bounded(step: str, aw: Awaitable[Any], timeout_s: float) -> None:
    """Await one step of the shutdown for at most `timeout_s`; past it the step is
    cancelled and logged (``stop_step_timed_out``): the node exits regardless."""
    try:
        async with asyncio.timeout(timeout_s):
            await aw
    except TimeoutError:
        log.warning("stop_step_timed_out", step=step, timeout_s=timeout_s)


@contextlib.contextmanager
def binding(what: str, key: str, host: str, port: int) -> Iterator[None]:
    """Turn a failed bind into the CLI's one-line error (`port_in_use` / `listen_failed`)."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"{what} cannot listen on {host}:{port}: the port is in use "
                            f"(another node, or another program?); stop it or change "
                            f"{key}") from None
        raise ListenFailed(f"{what} cannot listen on {host}:{port}: {e.strerror or e}; "
                           f"check {key}") from None


def _response(status: HTTPStatus, body: bytes, ctype: str) -> Response:
    headers = Headers([("Content-Type", ctype), ("Content-Length", str(len(body))),
                       ("Connection", "close")])
    return Response(status.value, status.phrase, headers, body)


def _json(status: HTTPStatus, obj: Any) -> Response:
    return _response(status, json.dumps(obj).encode(), "application/json")
