"""What a host holds, beside its RSS (issue 34's memory goal): the KV-cache slots alive in
the process and their peak, the shard memory figures `bench pipeline` prints, and the
steady-state aggregate it reports beside the batching goal.

The ledger is process-wide, so each test reads differences from a snapshot it took first.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import torch

from hearthnet.bench.concurrency import steady_ratio
from hearthnet.bench.pipeline import shard_memory, shard_memory_report
from hearthnet.distributed_inference.engine.kv_cache import LEDGER, KVSlot, slot_bytes
from hearthnet.distributed_inference.engine.memory import process_memory

CONFIG = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)


def _slot(capacity: int = 256) -> KVSlot:
    return KVSlot(CONFIG, 0, 2, capacity, torch.float32, torch.device("cpu"))


def test_slots_are_counted_from_allocation_until_released_or_collected():
    gc.collect()  # earlier tests' unreleased slots go now, not inside the difference below
    before = LEDGER.snapshot()
    a, b = _slot(256), _slot(512)
    held = LEDGER.snapshot()
    want = slot_bytes(CONFIG, 3, 256, torch.float32) + slot_bytes(CONFIG, 3, 512, torch.float32)
    assert a.nbytes + b.nbytes == want
    assert (held.bytes - before.bytes, held.slots - before.slots) == (want, 2)
    assert held.peak_bytes >= held.bytes and held.largest_slot_bytes >= b.nbytes
    a.release()
    a.release()  # a second release counts nothing
    assert LEDGER.snapshot().bytes - before.bytes == b.nbytes
    del b  # a slot dropped without release (an evicted stack's) is uncounted too
    gc.collect()
    after = LEDGER.snapshot()
    assert (after.bytes, after.slots) == (before.bytes, before.slots)
    assert after.peak_bytes >= before.bytes + want  # the peak stays


def test_process_memory_reports_weights_caches_and_rss():
    stack = SimpleNamespace(param_bytes=lambda: 3 * 2**20)
    shards = [SimpleNamespace(stack=stack), SimpleNamespace(stack=None),  # not loaded yet
              SimpleNamespace(active=1)]  # no stack at all (a status test's stand-in)
    slot = _slot()
    try:
        m = process_memory(shards)
        assert m["weights_bytes"] == 3 * 2**20
        assert m["kv_bytes"] >= slot.nbytes and m["kv_peak_bytes"] >= m["kv_bytes"]
        assert m["rss_bytes"] > 0 and m["peak_rss_bytes"] >= m["rss_bytes"]
        assert "preallocated" in m["kv_allocation"]
    finally:
        slot.release()


def _held(peak_mib: float, base_mib: float | None) -> dict:
    mib = 2**20
    return {"weights_bytes": 600 * mib, "kv_bytes": 0, "kv_slots": 0,
            "kv_peak_bytes": 400 * mib, "kv_peak_slots": 8, "kv_largest_slot_bytes": 50 * mib,
            "kv_allocation": "preallocated", "rss_bytes": 900 * mib,
            "peak_rss_bytes": int(peak_mib * mib),
            "runtime_baseline_bytes": None if base_mib is None else int(base_mib * mib)}


def test_the_memory_goal_is_checked_with_and_without_the_runtime():
    m = shard_memory(_held(1500, 400))  # limit 600 + 1.2 × 400 = 1080
    assert m["limit_mb"] == 1080.0 and m["kv_per_session_mb"] == 50.0
    assert m["met_counting_runtime"] is False and m["margin_counting_runtime_mb"] == -420.0
    assert m["above_runtime_mb"] == 1100.0 and m["met_above_runtime"] is False
    ok = shard_memory(_held(1400, 400))
    assert ok["met_above_runtime"] is True and ok["met_counting_runtime"] is False
    text = shard_memory_report({"node-b": m, "node-c": ok})
    assert "node-b: peak RSS 1500.0 MiB" in text and "limit 1080.0 MiB" in text
    assert "runtime counted (as the goal is written): MISSED (-420.0 MiB)" in text
    assert "above the runtime (1000.0 MiB): met (+80.0 MiB)" in text
    no_base = shard_memory(_held(1000, None))  # no shard planned there: one way only
    assert no_base["met_counting_runtime"] is True and "met_above_runtime" not in no_base


def test_the_steady_aggregate_ratio_needs_both_levels():
    one = {"concurrency": 1, "aggregate_tokens_per_second_all_decoding": 4.0}
    eight = {"concurrency": 8, "aggregate_tokens_per_second_all_decoding": 13.0}
    assert steady_ratio([one, eight]) == 3.25
    assert steady_ratio([one]) is None
    assert steady_ratio([one, {**eight, "aggregate_tokens_per_second_all_decoding": None}]) \
        is None
