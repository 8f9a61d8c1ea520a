"""Metrics and structured logs for every component (DESIGN.md decision 9, M26 §5.10).

One `Metrics` object per node owns a private `CollectorRegistry`, so several nodes can live
in one test process. Metric names are `hearthnet_<spec name with dots as underscores>`.
Logs are structlog JSON lines carrying node, session and shard ids — never tensor
contents (M26 §5.8).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_MS = (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_SIZE_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


class Metrics:
    """All HearthNet metrics of one node, registered in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "hearthnet_distributed_inference_"
        # M26 §5.10 — orchestrator side, per call
        self.pipeline_construct_ms = Histogram(
            p + "pipeline_construct_ms", "Time to pick a pipeline and open its sessions (ms)",
            buckets=_SIZE_BUCKETS_MS, registry=r)
        self.first_token_ms = Histogram(
            p + "first_token_ms", "Time from call start to the first token (ms)",
            buckets=_SIZE_BUCKETS_MS, registry=r)
        self.tokens_per_second = Histogram(
            p + "tokens_per_second", "Decode tokens per second of a finished call",
            buckets=(0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.shard_latency_ms = Histogram(
            p + "shard_latency_ms", "Round trip of one step through one shard, seen by the caller",
            ["shard_id"], buckets=_LATENCY_BUCKETS_MS, registry=r)
        self.failovers_total = Counter(
            p + "failovers_total", "Shard failovers performed", registry=r)
        self.fallback_to_local_total = Counter(
            p + "fallback_to_local_total", "Calls that continued on the local engine", registry=r)
        self.shard_corruption_detected_total = Counter(
            p + "shard_corruption_detected_total",
            "Shard outputs rejected by the NaN/Inf/norm sanity check", ["shard_id"], registry=r)
        self.chats_total = Counter(
            p + "chats_total", "Distributed chat calls by outcome", ["outcome"], registry=r)
        self.tokens_generated_total = Counter(
            p + "tokens_generated_total", "Tokens streamed to callers", registry=r)
        # shard host side (issue 4 item 8)
        self.shard_forward_ms = Histogram(
            p + "shard_forward_ms", "Compute time of one forward on a hosted shard (ms)",
            ["shard_id"], buckets=_LATENCY_BUCKETS_MS, registry=r)
        self.shard_queue_depth = Gauge(
            p + "shard_queue_depth", "Forwards waiting or running on a hosted shard",
            ["shard_id"], registry=r)
        self.shard_active_sessions = Gauge(
            p + "shard_active_sessions", "Open sessions on a hosted shard", ["shard_id"],
            registry=r)
        self.shard_sessions_total = Counter(
            p + "shard_sessions_total", "Session opens on a hosted shard by result",
            ["shard_id", "result", "caller"], registry=r)
        self.transport_bytes_in_total = Counter(
            "hearthnet_transport_bytes_in_total", "Tensor transport bytes received", registry=r)
        self.transport_bytes_out_total = Counter(
            "hearthnet_transport_bytes_out_total", "Tensor transport bytes sent", registry=r)
        # event log (issue 4 item 8, issue 7 item 2)
        self.events_appended_total = Counter(
            "hearthnet_events_appended_total", "Events appended by this node", ["type"],
            registry=r)
        self.events_received_total = Counter(
            "hearthnet_events_received_total", "Events received from peers and stored",
            ["type"], registry=r)
        self.events_rejected_total = Counter(
            "hearthnet_events_rejected_total", "Events dropped (unknown key, bad signature...)",
            ["reason"], registry=r)
        self.advertisements_live = Gauge(
            "hearthnet_advertisements_live", "Unexpired shard advertisements in the store",
            registry=r)
        self.api_requests_total = Counter(
            "hearthnet_api_requests_total", "HTTP API requests by route and status",
            ["path", "status"], registry=r)
        self.auth_failures_total = Counter(
            "hearthnet_auth_failures_total", "Refused connections and session opens",
            ["reason"], registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of this node's metrics."""
        return generate_latest(self.registry)


def configure_logging(level: str = "info", *, json: bool = True, **context: Any) -> None:
    """Set up structlog (JSON lines on stderr) and bind `context` (e.g. node id) to every line."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s")
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    processors.append(structlog.processors.JSONRenderer() if json
                      else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str) -> Any:
    """A structlog logger tagged with the component name."""
    return structlog.get_logger(component=name)
