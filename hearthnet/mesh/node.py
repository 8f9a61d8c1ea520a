"""The node daemon: wires config, event log, gossip, shards, router and orchestrator.

One asyncio process per machine (DESIGN.md decision 6). One WebSocket server on
`[node] listen_host:listen_port` routes by request path:

- `/shard`  tensor sessions on a hosted shard (transport `ServerStream`)
- `/gossip` the event-log feed (`mesh.gossip`)
- `/bus`    capability calls (`experimental.distributed_llm.chat`)
- plain HTTP `GET /metrics` (Prometheus), `GET /health`, `GET /status` (JSON)

When the node is up it prints one JSON line ``{"event": "node_ready", ...}`` on stdout
(scripts and tests wait for it); logs are JSON lines on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

import torch
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from hearthnet.config import NodeConfig
from hearthnet.distributed_inference.descriptors import (
    advertisement_payload,
    withdrawal_payload,
)
from hearthnet.distributed_inference.generation import SamplingParams
from hearthnet.distributed_inference.health import ShardHealthTracker
from hearthnet.distributed_inference.pipeline import (
    ChatRequest,
    DistributedChatParams,
    PipelineOrchestrator,
)
from hearthnet.distributed_inference.routing import RoutingSettings, ShardRouter
from hearthnet.distributed_inference.shard import ShardServer, ShardSettings
from hearthnet.distributed_inference.store import ShardStore
from hearthnet.errors import BadRequest, HearthNetError, ShardUnavailable
from hearthnet.mesh.bus import CapabilityBus
from hearthnet.mesh.eventlog import ADVERTISED, WITHDRAWN, EventLog
from hearthnet.mesh.gossip import MAX_MESSAGE_BYTES, GossipPeerLink, handle_gossip_connection
from hearthnet.models.store import ModelStore
from hearthnet.observability import Metrics, get_logger
from hearthnet.transport.codec import max_frame_bytes
from hearthnet.transport.websocket import ServerStream, TensorChannel

log = get_logger("node")

CHAT_CAPABILITY = "experimental.distributed_llm.chat"


class Node:
    """One HearthNet node; see the module docstring."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node.id
        self.metrics = Metrics()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.bus = CapabilityBus()
        self.shards: dict[str, ShardServer] = {}
        self.links: list[GossipPeerLink] = []
        self.server: Server | None = None
        self.port = cfg.node.listen_port
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = asyncio.Event()
        self.started_at = time.time()

    # ---- lifecycle ----

    async def start(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(cfg.node.torch_threads)
        data = cfg.effective_data_dir()
        data.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(cfg.event_log_path(), self.node_id, metrics=self.metrics)
        self.health = ShardHealthTracker()
        self.store = ShardStore(cfg.di.advertisement_expiry_s,
                                lan_networks=cfg.node.lan_networks, metrics=self.metrics,
                                tracker=self.health)
        self.store.rebuild(self.log.all_events())
        self.log.subscribe(self.store.apply)
        self.models = ModelStore(cfg.effective_models_dir())
        size = max(max_frame_bytes(cfg.di.chunk_bytes), MAX_MESSAGE_BYTES)
        self.server = await serve(self._route, cfg.node.listen_host, cfg.node.listen_port,
                                  process_request=self._http, max_size=size,
                                  compression=None, ping_interval=20, ping_timeout=20)
        self.port = self.server.sockets[0].getsockname()[1] if self.server.sockets else \
            cfg.node.listen_port
        self.endpoint = cfg.endpoint(self.port)
        await self._start_shards()
        self.router = ShardRouter(self.store, RoutingSettings.from_config(cfg.di), self.health,
                                  self_node_id=self.node_id)
        self.orchestrator = PipelineOrchestrator(
            models=self.models, router=self.router, health=self.health,
            metrics=self.metrics, connect=self._connect, executor=self.executor,
            defaults=DistributedChatParams(
                fallback_to_local=cfg.di.fallback_to_local, wire_dtype=cfg.di.activation_dtype,
                max_shards=cfg.di.max_shards_per_request,
                timeout_s=cfg.di.shard_health_timeout_seconds,
                fallback_after_failures=cfg.di.fallback_after_failures),
            enabled=cfg.distributed_enabled, max_concurrent_pipelines=cfg.di.max_concurrent_pipelines)
        self.bus.register(CHAT_CAPABILITY, self._chat_capability)
        for peer in cfg.node.peers:
            link = GossipPeerLink(self.log, peer)
            link.start()
            self.links.append(link)
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        if cfg.distributed_enabled:  # load heads + sanity bounds now, not in the first call
            self._tasks.append(asyncio.create_task(self._prepare_models(), name="prepare"))
        for w in cfg.warnings():
            log.warning("config_warning", warning=w)
        log.info("node_started", endpoint=self.endpoint, shards=list(self.shards))
        print(json.dumps({"event": "node_ready", "node_id": self.node_id,
                          "endpoint": self.endpoint, "port": self.port, "pid": os.getpid(),
                          "shards": list(self.shards)}), flush=True)

    async def _start_shards(self) -> None:
        cfg = self.cfg
        host = cfg.di.host
        for spec in cfg.hosted_shards():
            entry = self.models.get(spec.model)
            lo, hi = spec.layers
            shard = ShardServer(
                entry, lo, hi, node_id=self.node_id, endpoint=self.endpoint,
                settings=ShardSettings(
                    max_concurrent_streams=spec.max_concurrent_streams,
                    eviction_idle_s=host.shard_eviction_idle_seconds,
                    session_idle_timeout_s=host.session_idle_timeout_seconds,
                    max_session_tokens=host.max_session_tokens,
                    compute_dtype=host.compute_dtype),
                executor=self.executor, metrics=self.metrics)
            await shard.start()
            self.shards[shard.shard_id] = shard
            from hearthnet.distributed_inference.faults import install_faults

            install_faults(shard, cfg.testing.faults)
            await self._advertise(shard)

    async def _advertise(self, shard: ShardServer) -> None:
        if not self.cfg.research.enable:  # M26 §5.1: opted out → no advertisements
            return
        self.log.append(ADVERTISED, advertisement_payload(shard.descriptor,
                                                          await shard.health()))

    async def _prepare_models(self) -> None:
        for e in self.models.entries():
            try:
                await self.orchestrator.prepare(e.alias)
            except HearthNetError as err:
                log.warning("model_prepare_failed", model=e.alias, code=err.code)

    async def _heartbeat_loop(self) -> None:
        """Re-advertise every health timeout / 2 with health; evict idle weights."""
        interval = self.cfg.di.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            for shard in self.shards.values():
                if shard.maybe_evict_idle():
                    await shard.evict()
                await self._advertise(shard)
            self.store.expire()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, then stop cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        try:
            await self._stopping.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Withdraw advertisements, close sessions and links, flush the log."""
        log.info("node_stopping")
        for t in self._tasks:
            t.cancel()
        for sid in self.shards:
            if self.cfg.research.enable:
                self.log.append(WITHDRAWN, withdrawal_payload(sid, "shutdown"))
        if self.links and self.shards:
            await asyncio.sleep(0.3)  # let the live push carry the withdrawals out
        for shard in self.shards.values():
            await shard.close_all()
        for link in self.links:
            await link.stop()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)
        self.log.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        log.info("node_stopped")

    # ---- connections ----

    async def _route(self, ws: ServerConnection) -> None:
        path = ws.request.path.split("?", 1)[0] if ws.request else ""
        if path == "/shard":
            await self._serve_shard(ws)
        elif path == "/gossip":
            await handle_gossip_connection(self.log, ws)
        elif path == "/bus":
            await self.bus.serve_connection(ws)
        else:
            await ws.close(1008, "unknown path")

    async def _serve_shard(self, ws: ServerConnection) -> None:
        di = self.cfg.di
        try:
            stream = await ServerStream.accept_open(
                ws, window=di.flow_control_window, chunk_bytes=di.chunk_bytes,
                deadline_s=di.shard_health_timeout_seconds, metrics=self.metrics)
        except HearthNetError as e:
            log.info("shard_open_failed", code=e.code)
            return
        try:
            params = stream.open_params
            shard = self.shards.get(str(params.get("shard_id")))
            if shard is None:
                raise ShardUnavailable(f"this node does not host {params.get('shard_id')!r}; "
                                       f"it hosts {sorted(self.shards)}")
            req = shard.validate_open(params)
        except HearthNetError as e:
            sid = str(stream.open_params.get("shard_id"))[:200]
            self.metrics.shard_sessions_total.labels(sid, e.code, "anonymous").inc()
            await stream.refuse(e)
            return
        try:
            await shard.serve_session(stream, req)
        except HearthNetError as e:
            if not stream.closed:
                await stream.refuse(e)
        finally:
            await stream.close()

    async def _connect(self, uri: str, params: dict[str, Any], deadline_s: float) -> Any:
        di = self.cfg.di
        return await TensorChannel.connect(uri, params, window=di.flow_control_window,
                                           chunk_bytes=di.chunk_bytes, deadline_s=deadline_s,
                                           metrics=self.metrics)

    async def _chat_capability(self, args: dict[str, Any]):  # type: ignore[no-untyped-def]
        request = ChatRequest.from_dict(args.get("request", {}))
        params = DistributedChatParams.from_dict(args.get("params", {}),
                                                 self.orchestrator.defaults)
        async for frame in self.orchestrator.chat(request, params):
            yield frame

    # ---- HTTP ----

    async def _http(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None
        if path == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render(),
                             "text/plain; version=0.0.4; charset=utf-8")
        if path == "/health":
            return _json(HTTPStatus.OK, {"node_id": self.node_id, "online": True,
                                         "uptime_s": round(time.time() - self.started_at, 1)})
        if path == "/status":
            return _json(HTTPStatus.OK, await self.status())
        return _json(HTTPStatus.NOT_FOUND, {"error": "not found",
                                            "paths": ["/metrics", "/health", "/status"]})

    async def status(self) -> dict[str, Any]:
        """What this node knows of the mesh (`hearthnet status`)."""
        from hearthnet.mesh.status import mesh_status

        return await mesh_status(self)


def _response(status: HTTPStatus, body: bytes, ctype: str) -> Response:
    headers = Headers([("Content-Type", ctype), ("Content-Length", str(len(body))),
                       ("Connection", "close")])
    return Response(status.value, status.phrase, headers, body)


def _json(status: HTTPStatus, obj: Any) -> Response:
    return _response(status, json.dumps(obj).encode(), "application/json")


def chat_args(prompt: str, model: str, sampling: SamplingParams, **params: Any
              ) -> dict[str, Any]:
    """The bus arguments of a chat call."""
    s = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
         "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
         "stop": list(sampling.stop)}
    return {"request": {"model": model, "messages": [{"role": "user", "content": prompt}]},
            "params": {"sampling": s, **{k: v for k, v in params.items() if v is not None}}}


__all__ = ["CHAT_CAPABILITY", "BadRequest", "Node", "chat_args"]
