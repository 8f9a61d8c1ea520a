"""`hearthnet bench local|pipeline|reach|failover` as a user runs them.

Each test runs the real command as a subprocess: real node processes on 127.0.0.1, the
real model. No timing is asserted — only that the figures exist, are consistent, and that
no process is left behind. (The demo's own tests are in test_demo_bench.py; two files, so
that two pytest workers run them side by side.) The two longest (bench local: six model
processes; bench reach) and bench pipeline's and bench failover's full runs are checked in
`make bench` (``HEARTHNET_BENCH_TESTS=1``), keeping `make test` within its 15 minutes on 2
cores; the behaviour they measure is tested in `make test` by test_mesh_chat,
test_batching_mesh and test_failover.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from hearthnet.distributed_inference.engine.quant import INT8_KERNEL
from tests.helpers.marks import IN_MAKE_BENCH
from tests.helpers.processes import alive

CLI = [sys.executable, "-m", "hearthnet.cli"]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


# ---- benchmarks --------------------------------------------------------------------------


def _bench(args: list[str], out_dir: Path) -> dict:
    r = subprocess.run([*CLI, "bench", *args, "--json", "--results-dir", str(out_dir)],
                       capture_output=True, text=True, timeout=900, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout)
    saved = json.loads(Path(figures["results_file"]).read_text())
    assert saved == {k: v for k, v in figures.items() if k != "results_file"}
    return figures


def test_bench_local_refuses_an_unknown_model_in_one_line(smollm2, tmp_path):
    r = subprocess.run([*CLI, "bench", "local", "--model", "nosuch", "--results-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "unknown model 'nosuch'" in r.stderr



@IN_MAKE_BENCH
def test_bench_local_measures_each_part_in_its_own_process(smollm2, tmp_path):
    f = _bench(["local", "--model", "smollm2", "--tokens", "8", "--runs", "2",
                "--against", "int8"], tmp_path)
    assert f["prefill_ms"] > 0 and f["decode_tokens_per_s"] > 0
    assert len(f["runs_detail"]["decode_tokens_per_s"]) == 2
    mem = f["memory_mb"]
    assert set(mem) == {"full", "layers_0_14", "layers_15_29", "head", "runtime"}
    pids = {p["pid"] for p in f["parts"].values()}
    assert len(pids) == 5 and os.getpid() not in pids  # five fresh processes
    # --against: the whole model once more, int8, in a sixth process (issue 12's ratio)
    a = f["against"]
    assert a["weights"] == "int8" and len(a["runs_detail"]) == 2
    assert a["param_mb"] < f["parts"]["full"]["param_mb"] / 3  # int8 against fp32 weights
    assert f["decode_speedup"] == round(f["decode_tokens_per_s"] / a["decode_tokens_per_s"], 2)
    assert f["goals"] == {} and f["goals_source"] == ""  # no issue set one for SmolLM2
    peak = {k: v["peak_rss_mb"] for k, v in mem.items()}
    # a half holds half the layers and no head: less than the whole; all more than bare
    assert peak["runtime"] < peak["layers_0_14"] < peak["full"]
    assert peak["runtime"] < peak["layers_15_29"] < peak["full"]
    assert peak["runtime"] < peak["head"] < peak["full"]
    assert f["parts"]["lower"]["param_mb"] == f["parts"]["upper"]["param_mb"]


@IN_MAKE_BENCH
def test_bench_pipeline_three_shards(smollm2, tmp_path):
    f = _bench(["pipeline", "--shards", "3", "--tokens", "12", "--runs", "1", "--wire", "fp32",
                "--concurrency", "1", "2"], tmp_path)
    assert f["layer_split"] == [[0, 9], [10, 19], [20, 29]]
    assert f["settings"]["node_torch_threads"] == 1
    d = f["distributed"]
    assert [s.rsplit("@", 1)[1] for s in d["pipeline"]] == ["node-b", "node-c", "node-d"]
    assert d["tokens_per_second"] > 0 and d["ratio_to_local"] > 0
    assert len(d["hops"]["stages"]) == 3 and d["construction_ms"] > 0
    assert f["tokens_match_local"]["fp32"]  # fp32 wire is exact (test_mesh_chat)
    assert [c["concurrency"] for c in f["concurrency"]] == [1, 2]
    assert all(c["aggregate_tokens_per_second"] > 0 for c in f["concurrency"])
    two = f["concurrency"][1]  # issue 16: latency, batch sizes and agreement per level
    assert two["inter_token_ms_p95"] >= two["inter_token_ms_p50"] > 0
    assert two["agreement"]["chats"] == 2 and len(two["shard_batches"]) == 3
    assert two["local_fallbacks"] == 0  # issue 16 §2: every chat through the shards
    # nothing failed: no stage replaced mid-answer, counted per chat from its `done`
    assert two["failovers"] == 0 and [c["failovers"] for c in two["last_run_chats"]] == [0, 0]
    # the two prompts share the chat template's preamble (over half of each): computed once
    assert 16 <= two["cached_prompt_tokens"] < two["prompt_tokens"]
    assert len(two["last_run_chats"]) == 2
    assert all(c["first_token_s"] > 0 for c in two["last_run_chats"])
    assert all(s["batches"] > 0 for s in two["shard_batches"].values())
    assert set(f["goals"]) == {"ratio_to_best_local", "first_token_ms", "construction_ms",
                               "overhead_p95_ms"}
    # issue 34: each shard node's weights and caches beside its peak RSS, the goal both ways
    assert set(f["shard_memory"]) == {"node-b", "node-c", "node-d"}
    for m in f["shard_memory"].values():
        assert 0 < m["runtime_baseline_mb"] < m["peak_rss_mb"]
        assert m["weights_mb"] > 0 and m["kv_peak_sessions"] >= 2  # two chats at once
        assert abs(m["kv_peak_mb"] - m["kv_per_session_mb"] * m["kv_peak_sessions"]) \
            <= 0.05 * m["kv_peak_sessions"] + 0.05  # each figure rounded to 0.1 MiB
        assert m["limit_mb"] == round(m["weights_mb"] + 1.2 * m["kv_peak_mb"], 1)
        assert {"met_counting_runtime", "met_above_runtime"} <= set(m)
    assert all(c["aggregate_tokens_per_second_all_decoding"] > 0 for c in f["concurrency"])


@IN_MAKE_BENCH
def test_bench_reach_splits_the_model_and_matches_the_local_engine(smollm2, tmp_path):
    f = _bench(["reach", "--model", "smollm2", "--weights", "int8", "--tokens", "6"], tmp_path)
    assert f["layer_split"] == [[0, 14], [15, 29]] and f["whole_model_mb"] > 0
    assert {n: v["layers"] for n, v in f["nodes"].items()} == {
        "node-a": [], "node-b": [[0, 14]], "node-c": [[15, 29]]}
    assert all(v["peak_rss_mb"] > 0 for v in f["nodes"].values())
    assert f["distributed"]["formats"] == {
        "head": "int8", "stages": ["int8", "int8"], "wire": ["fp32", "fp32"],
        "policy": "int8", "lossless": False}
    # each node names the int8 kernel it chose (the same probe as this process's)
    assert list(f["distributed"]["kernels"].values()) == [INT8_KERNEL] * 2
    assert len(f["distributed"]["token_ids"]) == 6 and f["distributed"]["tokens_per_second"] > 0
    assert f["local"]["peak_rss_mb"] > 0 and f["tokens_identical_to_local"]
    assert f["every_shard_under_half_one_process"] == (
        f["max_shard_peak_rss_mb"] < f["local"]["peak_rss_mb"] / 2)


@IN_MAKE_BENCH
def test_bench_failover_kills_the_last_stage_and_keeps_the_answer(smollm2, tmp_path):
    f = _bench(["failover", "--tokens", "24", "--kill-after", "6"], tmp_path)
    (r,) = f["runs_detail"]
    assert r["victim"] in ("node-c", "node-d") and r["victim_exit"] == -signal.SIGKILL
    assert not alive(r["victim_pid"])
    assert r["frames"].get("shard_failover") == 1 and not r["fallback_to_local"]
    assert r["pipeline_after"][-1] != r["victim_shard"]
    assert r["kill_to_next_token_ms"] is not None and r["completion_tokens"] == 24
    assert f["tokens_identical"]


def test_context_prompts_are_about_the_asked_length(smollm2):
    """`bench pipeline --context N`: each concurrency prompt after a text that makes it
    about N tokens (within one repeated line), still ending in its own question."""
    from hearthnet.bench import PROMPTS, concurrency
    from hearthnet.bench.flow import LINE
    from hearthnet.distributed_inference.engine.head import LayeredHead

    tok = LayeredHead(smollm2, lm_head=False).tokenizer
    assert concurrency.level_prompts(tok, None) == list(PROMPTS)
    line = len(tok(LINE)["input_ids"])
    prompts = concurrency.level_prompts(tok, 2000)
    assert [p[-len(q):] for p, q in zip(prompts, PROMPTS, strict=True)] == list(PROMPTS)
    assert all(2000 - line - 8 <= len(tok(p)["input_ids"]) <= 2000 + 8 for p in prompts)
