"""Node metrics beyond the spec's (issue 15 §6): process, build, buckets that resolve."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from hearthnet import __version__
from hearthnet.observability import (
    CALL_BUCKETS_MS,
    LATENCY_BUCKETS_MS,
    OVERHEAD_BUCKETS_MS,
    TOKENS_PER_S_BUCKETS,
    Metrics,
)


def _within(buckets: tuple[float, ...], lo: float, hi: float) -> int:
    return sum(lo <= b <= hi for b in buckets)


def test_buckets_resolve_the_measured_ranges():
    # measured on SmolLM2 through two CPU shards (README, `hearthnet bench pipeline`): steps
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
