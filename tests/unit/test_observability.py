"""Node metrics (issue 15 §6: process, build, buckets that resolve), one registry per
node, JSON-line logging with context and plain tracebacks, progress lines (issue 10 §7)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hearthnet import __version__
from hearthnet.observability import (
    CALL_BUCKETS_MS,
    LATENCY_BUCKETS_MS,
    OVERHEAD_BUCKETS_MS,
    TOKENS_PER_S_BUCKETS,
    Metrics,
    configure_logging,
    get_logger,
    progress,
)
from tests.helpers.waiting import wait_until


def _within(buckets: tuple[float, ...], lo: float, hi: float) -> int:
    return sum(lo <= b <= hi for b in buckets)


def test_buckets_resolve_the_measured_ranges():
    # measured on SmolLM2 through two CPU shards (docs/benchmarks.md, `bench pipeline`): steps
    # 15-50 ms (382 of 532 samples sat in one 20-50 ms bucket before), first token
    # 0.1-2 s, 5-40 tokens/s, per-hop overhead 0.5-10 ms
    assert _within(LATENCY_BUCKETS_MS, 15, 50) >= 8
    assert _within(LATENCY_BUCKETS_MS, 20, 50) >= 6
    assert _within(CALL_BUCKETS_MS, 100, 2000) >= 10
    assert _within(TOKENS_PER_S_BUCKETS, 5, 40) >= 12
    assert _within(OVERHEAD_BUCKETS_MS, 0.5, 10) >= 10
    for b in (LATENCY_BUCKETS_MS, CALL_BUCKETS_MS, TOKENS_PER_S_BUCKETS, OVERHEAD_BUCKETS_MS):
        assert list(b) == sorted(set(b))


def test_process_and_build_info_and_hop_histogram_are_exported():
    m = Metrics()
    m.hop_overhead_ms.labels("m:0-14@b").observe(1.3)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    rss = fams["process_resident_memory_bytes"].samples[0].value
    assert rss > 10 * 2**20  # this test process holds well over 10 MiB
    assert "process_cpu_seconds" in fams
    build = fams["hearthnet_build_info"].samples[0].labels
    assert build["version"] == __version__ and build["torch"][0].isdigit()
    hop = fams["hearthnet_distributed_inference_hop_overhead_ms"]
    le = {s.labels["le"]: s.value for s in hop.samples if s.name.endswith("_bucket")}
    assert le["1.5"] == 1 and le["1.25"] == 0
    Metrics()  # a second node in one process: its own registry, no clash


class _Recorder:
    """A logger that keeps (event, fields) of every info line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


async def test_progress_logs_start_ticks_and_done_with_the_time_taken() -> None:
    rec = _Recorder()
    async with progress(rec, "load", every_s=0.01, shard="m:0-3"):
        await wait_until(lambda: any(e == "load_progress" for e, _ in rec.lines),
                         "a progress line")
    events = [e for e, _ in rec.lines]
    assert events[0] == "load_started" and events[-1] == "load_done"
    assert all(f["shard"] == "m:0-3" for _, f in rec.lines)
    assert rec.lines[-1][1]["seconds"] >= 0 and "elapsed_s" in rec.lines[1][1]
    ticks = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "tick"]
    assert ticks and all(t.done() or t.cancelling() for t in ticks)  # no line after done


def test_logging_is_json_lines_with_context_at_the_configured_level(
        capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", node="node-a")
    log = get_logger("test")
    log.debug("hidden_debug")
    log.info("shown", n=1)
    logging.getLogger("websockets").info("connection open")  # library chatter: hidden
    logging.getLogger("websockets").warning("library warning")
    try:
        secret = 0.1234  # noqa: F841 - a local that must never reach the log
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.strip()]
    events = [x["event"] for x in lines]
    assert events == ["shown", "library warning", "failed"]
    shown = lines[0]
    assert shown["node"] == "node-a" and shown["component"] == "test" and shown["n"] == 1
    assert shown["level"] == "info" and shown["timestamp"].endswith("Z")
    assert lines[1]["level"] == "warning" and lines[1]["node"] == "node-a"
    assert "Traceback" in lines[2]["exception"] and "RuntimeError: boom" in lines[2]["exception"]
    assert "0.1234" not in json.dumps(lines)  # plain tracebacks: no local variables
    configure_logging()  # back to the defaults for the tests after this one


def test_every_node_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.tokens_generated_total.inc(3)
    assert a.registry.get_sample_value("hearthnet_distributed_inference_tokens_generated_total"
                                       ) == 3
    assert b.registry.get_sample_value("hearthnet_distributed_inference_tokens_generated_total"
                                       ) == 0
    assert b"tokens_generated_total 3.0" in a.render()


class _Terminal:
    """A stderr that says it is a terminal, keeping what is written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(("fmt", "env", "tty", "json_lines"), [
    ("auto", None, True, False),     # a person at a terminal: short lines
    ("auto", None, False, True),     # a file, a pipe, a service manager: JSON lines
    ("auto", "json", True, True),    # HEARTHNET_LOG_FORMAT says what auto means
    ("human", None, False, False),   # --log-format wins over both
    ("json", "human", True, True),
])
def test_log_format_follows_the_terminal_unless_told(monkeypatch, fmt, env, tty, json_lines):
    from hearthnet.observability import logs_as_json

    err = _Terminal()
    err.isatty = lambda: tty  # type: ignore[method-assign]
    monkeypatch.setattr("sys.stderr", err)
    if env is None:
        monkeypatch.delenv("HEARTHNET_LOG_FORMAT", raising=False)
    else:
        monkeypatch.setenv("HEARTHNET_LOG_FORMAT", env)
    assert logs_as_json(fmt) is json_lines
    try:
        configure_logging("info", json=logs_as_json(fmt), node="node-a")
        get_logger("shard").info("shard_loaded", weights="fp32", ms=52)
        try:
            secret = 0.1234  # noqa: F841 - a local that must never reach the log
            raise RuntimeError("boom")
        except RuntimeError:
            get_logger("shard").exception("failed")
    finally:
        monkeypatch.undo()
        configure_logging()
    first = err.text.splitlines()[0]
    if json_lines:
        assert json.loads(first)["event"] == "shard_loaded"
    else:  # one short line: local time, level, event, fields; no JSON, no date
        assert first.startswith(tuple("0123456789")) and first[2] == ":" and "{" not in first
        assert "shard_loaded" in first and "weights=fp32" in first and "ms=52" in first
    assert "RuntimeError: boom" in err.text and "0.1234" not in err.text
