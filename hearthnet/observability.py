"""Metrics and structured logs for every component (DESIGN.md decision 9, M26 §5.10).

One `Metrics` object per node owns a private `CollectorRegistry`, so several nodes can live
in one test process. Metric names are `hearthnet_<spec name with dots as underscores>`.
Logs are structlog JSON lines carrying node, session and shard ids — never tensor
contents (M26 §5.8).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, TextIO, cast

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

# Buckets fitted to measured values, so the dashboard's quantiles mean something: SmolLM2 decode
# steps through one shard take 15-50 ms on a CPU host (most samples fell in one 20-50 ms bucket
# before), first tokens 100 ms-2 s, decode 5-40 tokens/s, per-hop overhead 0.5-10 ms.
LATENCY_BUCKETS_MS = (0.5, 1, 2, 3, 5, 7.5, 10, 12.5, 15, 17.5, 20, 22.5, 25, 30, 35, 40,
                      50, 65, 80, 100, 150, 200, 300, 500, 1000, 2000, 5000, 10000)
CALL_BUCKETS_MS = (10, 25, 50, 75, 100, 150, 200, 250, 300, 400, 500, 650, 800, 1000, 1250,
                   1500, 2000, 3000, 5000, 10000, 30000)
TOKENS_PER_S_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20, 22.5, 25, 30, 35, 40, 50,
                        64, 80, 100, 128, 256)
# batching: decode rows per batched forward (max_concurrent_streams is 8 by default) and
# how long a row waited for its round (the collection window is 2 ms by default)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
BATCH_WAIT_BUCKETS_MS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 50, 100, 250, 1000)
OVERHEAD_BUCKETS_MS = (0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 15, 20,
                       50, 100, 500)


class Metrics:
    """All HearthNet metrics of one node, registered in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "hearthnet_distributed_inference_"
        # M26 §5.10 — orchestrator side, per call
        self.pipeline_construct_ms = Histogram(
            p + "pipeline_construct_ms", "Time to pick a pipeline and open its sessions (ms)",
            buckets=CALL_BUCKETS_MS, registry=r)
        self.first_token_ms = Histogram(
            p + "first_token_ms", "Time from call start to the first token (ms)",
            buckets=CALL_BUCKETS_MS, registry=r)
        self.tokens_per_second = Histogram(
            p + "tokens_per_second", "Decode tokens per second of a finished call",
            buckets=TOKENS_PER_S_BUCKETS, registry=r)
        self.shard_latency_ms = Histogram(
            p + "shard_latency_ms", "Round trip of one step through one shard, seen by the caller",
            ["shard_id"], buckets=LATENCY_BUCKETS_MS, registry=r)
        self.hop_overhead_ms = Histogram(
            p + "hop_overhead_ms", "Per-hop overhead of one step: round trip minus the shard's "
            "compute (transport, serialisation, queueing; ms)", ["shard_id"],
            buckets=OVERHEAD_BUCKETS_MS, registry=r)
        self.failovers_total = Counter(
            p + "failovers_total", "Shard failovers performed", registry=r)
        self.fallback_to_local_total = Counter(
            p + "fallback_to_local_total", "Calls that continued on the local engine", registry=r)
        self.shard_corruption_detected_total = Counter(
            p + "shard_corruption_detected_total",
            "Shard outputs rejected by the NaN/Inf/norm sanity check", ["shard_id"], registry=r)
        self.chats_total = Counter(
            p + "chats_total", "Distributed chat calls by outcome", ["outcome"], registry=r)
        # what served the stages: the format each shard's ACCEPT stated (not its
        # advertisement), and whether it kept the stored weights (formats.lossless_formats)
        self.stage_formats_total = Counter(
            p + "stage_formats_total", "Pipeline stages opened, by the weight format the "
            "shard accepted with", ["weights_format", "lossless"], registry=r)
        self.tokens_generated_total = Counter(
            p + "tokens_generated_total", "Tokens streamed to callers", registry=r)
        # prompt positions a call's stages took from another of this node's calls instead
        # of computing them (a shared prompt prefix, DESIGN.md decision 12)
        self.prefix_reused_tokens_total = Counter(
            p + "prefix_reused_tokens_total", "Prompt tokens whose cached keys and values "
            "the stages copied from another call with the same first tokens", registry=r)
        # speculative passes (DESIGN.md decision 16): per model and proposer; a model's
        # acceptance is accepted / proposed
        self.speculative_proposed_total = Counter(
            "hearthnet_speculative_proposed_total", "Tokens proposed for verification",
            ["model", "mode"], registry=r)
        self.speculative_accepted_total = Counter(
            "hearthnet_speculative_accepted_total", "Proposed tokens the model agreed with",
            ["model", "mode"], registry=r)
        self.speculative_passes_total = Counter(
            "hearthnet_speculative_passes_total", "Decode passes of speculating calls "
            "(tokens streamed per pass = 1 + accepted / passes)", ["model", "mode"], registry=r)
        # shard host side (M26 §5.10)
        self.shard_forward_ms = Histogram(
            p + "shard_forward_ms", "Compute time of one forward on a hosted shard (ms)",
            ["shard_id"], buckets=LATENCY_BUCKETS_MS, registry=r)
        self.shard_queue_depth = Gauge(
            p + "shard_queue_depth", "Forwards waiting or running on a hosted shard",
            ["shard_id"], registry=r)
        self.shard_batch_size = Histogram(
            p + "shard_batch_size", "Decode steps of different sessions run as one forward "
            "on a hosted shard", ["shard_id"], buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.shard_batch_wait_ms = Histogram(
            p + "shard_batch_wait_ms", "Time a decode step waited for its batch on a hosted "
            "shard (ms)", ["shard_id"], buckets=BATCH_WAIT_BUCKETS_MS, registry=r)
        self.head_batch_size = Histogram(
            p + "head_batch_size", "Concurrent chats whose norm + lm_head ran as one product "
            "on this orchestrator", buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.head_batch_wait_ms = Histogram(
            p + "head_batch_wait_ms", "Time a chat's head step waited for its batch (ms)",
            buckets=BATCH_WAIT_BUCKETS_MS, registry=r)
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
        # event log: appended, received, and rejected unsigned or foreign events
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
        self.task_failures_total = Counter(
            "hearthnet_task_failures_total", "Failures of the node's supervised tasks",
            ["task"], registry=r)
        self.bus_calls_total = Counter(
            "hearthnet_bus_calls_total", "Capability calls over /bus by caller and result",
            ["capability", "caller", "result"], registry=r)
        self.auth_failures_total = Counter(
            "hearthnet_auth_failures_total", "Refused connections and session opens",
            ["reason"], registry=r)

        # the node process itself: RSS, CPU seconds, open files (Linux /proc) and the build
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Info("hearthnet_build", "HearthNet build: version, Python and torch", registry=r).info(
            build_info())

    def render(self) -> bytes:
        """The Prometheus text exposition of this node's metrics."""
        return generate_latest(self.registry)


def build_info() -> dict[str, str]:
    """Version labels of ``hearthnet_build_info``."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "unknown"

    from hearthnet import __version__

    return {"version": __version__, "python": platform.python_version(),
            "torch": of("torch"), "transformers": of("transformers")}


# Libraries whose INFO lines are per-connection chatter ("connection open", "HTTP response
# sent"): shown from debug on, else only their warnings.
_CHATTY = ("websockets", "aiohttp.access", "aiohttp.server", "urllib3", "httpx", "httpx2",
           "asyncio")  # httpx2: huggingface_hub's client, a line per request


class _Stderr:
    """Whatever `sys.stderr` is when a line is written (it is replaced under test runners)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def logs_as_json(log_format: str = "auto") -> bool:
    """Whether `log_format` (`hearthnet node --log-format`: auto, json or human) means JSON
    lines on this stderr: `auto` is short human lines on a terminal and JSON lines otherwise
    (a file, a pipe, a service manager), unless `HEARTHNET_LOG_FORMAT` names one."""
    if log_format == "auto":
        log_format = os.environ.get("HEARTHNET_LOG_FORMAT", "auto")
    if log_format == "auto":
        return not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    return log_format != "human"


def configure_logging(level: str = "info", *, json: bool | None = None,
                      **context: Any) -> None:
    """Set up structlog on stderr and bind `context` (e.g. node id) to every line: JSON
    lines, or short human lines (`json=False`; None: `logs_as_json()` decides).

    Every library logger (websockets, aiohttp, transformers …) goes through the same
    structlog processors, so a node's terminal shows one format at the configured level.
    """
    if json is None:
        json = logs_as_json()
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        # people read local wall-clock time; machines get UTC ISO 8601
        structlog.processors.TimeStamper(fmt="iso", utc=True) if json
        else structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
    ]
    # tracebacks as plain text: never a renderer that prints local variables, which could
    # hold activations (M26 §5.8: tensor contents are never logged)
    renderer: Any = structlog.processors.JSONRenderer() if json \
        else structlog.dev.ConsoleRenderer(colors=False,
                                           exception_formatter=structlog.dev.plain_traceback)
    exc: list[Any] = [structlog.processors.format_exc_info] if json else []
    handler = logging.StreamHandler(cast(TextIO, _Stderr()))
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *exc,
                    renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name,
                           structlog.stdlib.ExtraAdder()]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    for name in _CHATTY:
        logging.getLogger(name).setLevel(lvl if lvl <= logging.DEBUG else logging.WARNING)
    logging.captureWarnings(True)
    processors = [*shared, *exc, renderer]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _Stderr())),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


@contextlib.asynccontextmanager
async def progress(logger: Any, event: str, every_s: float = 2.0, **fields: Any
                   ) -> AsyncIterator[None]:
    """Log ``<event>_started``, ``<event>_progress`` every `every_s` seconds with the time
    so far, and ``<event>_done`` with the total — a long load never looks like a hang."""
    t0 = time.perf_counter()
    logger.info(f"{event}_started", **fields)

    async def tick() -> None:
        while True:
            await asyncio.sleep(every_s)
            logger.info(f"{event}_progress", elapsed_s=round(time.perf_counter() - t0, 1),
                        **fields)

    ticker = asyncio.create_task(tick())
    try:
        yield
    finally:
        ticker.cancel()
    logger.info(f"{event}_done", seconds=round(time.perf_counter() - t0, 2), **fields)


def get_logger(name: str) -> Any:
    """A structlog logger tagged with the component name.

    Until `configure_logging` runs (library use, tests), the defaults are ours too (JSON
    lines, plain tracebacks), never structlog's development renderer with its locals.
    """
    if not structlog.is_configured():
        configure_logging()
    return structlog.get_logger(component=name)
