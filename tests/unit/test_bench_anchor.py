"""`hearthnet bench anchor` without building or running llama.cpp: the CPU flags → cmake
options, the build cache's paths, llama-bench's JSON, the goals, the argument errors (the
run itself is `make bench`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from hearthnet.bench import anchor
from hearthnet.bench import llamacpp as lc
from hearthnet.errors import BadRequest, HearthNetError

# /proc/cpuinfo's flags of the project's VMs (abridged to what the mapping reads)
SAPPHIRE = ("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq "
            "avx512ifma avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi "
            "avx512_vnni amx_bf16 amx_tile amx_int8")
ZEN1 = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2"


def _opts(flags: str) -> dict[str, str]:
    out = {}
    for o in lc.cmake_options(frozenset(flags.split())):
        k, _, v = o[2:].partition("=")
        out[k] = v
    return out


def test_cpu_flags_are_read_from_the_first_processor():
    text = ("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512f\n\n"
            "processor\t: 1\nflags\t\t: fpu\n")
    assert lc.cpu_flags(text) == frozenset({"fpu", "avx2", "avx512f"})
    assert lc.cpu_flags("model name: X\n") == frozenset()


def test_every_option_is_named_on_exactly_where_the_cpu_has_it_and_amx_never():
    o = _opts(SAPPHIRE)
    assert o["GGML_NATIVE"] == "OFF" and o["GGML_RPC"] == "ON"
    assert o["CMAKE_BUILD_TYPE"] == "Release"
    for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX_VNNI",
              "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"):
        assert o[k] == "ON", k
    # AMX is reported here but a guest may not run it: always off
    assert o["GGML_AMX_TILE"] == o["GGML_AMX_INT8"] == o["GGML_AMX_BF16"] == "OFF"
    z = _opts(ZEN1)
    assert z["GGML_AVX2"] == "ON" and z["GGML_FMA"] == "ON"
    assert z["GGML_AVX512"] == z["GGML_AVX_VNNI"] == z["GGML_AVX512_VNNI"] == "OFF"


def test_avx512_needs_all_five_subsets_that_ggml_compiles_with():
    no_bw = SAPPHIRE.replace(" avx512bw", "")
    assert _opts(no_bw)["GGML_AVX512"] == "OFF"
    # an extension without avx512f itself is not switched on
    assert _opts("avx2 avx512_vnni")["GGML_AVX512_VNNI"] == "OFF"
    assert lc.enabled_options(lc.cmake_options(frozenset(ZEN1.split()))) == [
        "SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2"]


def test_the_cache_is_one_folder_per_version_and_option_set(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert lc.default_cache_root() == tmp_path / "xdg" / "hearthnet" / "llama.cpp"
    a = lc.cmake_options(frozenset(ZEN1.split()))
    b = lc.cmake_options(frozenset(SAPPHIRE.split()))
    key = lc.build_key("0.3.36", a)
    assert key.startswith("0.3.36-") and len(key) == len("0.3.36-") + 12
    assert key == lc.build_key("0.3.36", list(a))  # stable
    assert key != lc.build_key("0.3.36", b) != lc.build_key("0.3.37", b)
    assert lc.build_dir(tmp_path, "0.3.36", a) == tmp_path / key


def test_a_build_is_reused_only_when_its_stamp_and_every_tool_are_there(tmp_path):
    opts = lc.cmake_options(frozenset(ZEN1.split()))
    folder = lc.build_dir(tmp_path, "0.3.36", opts)
    assert lc.cached(tmp_path, "0.3.36", opts) is None
    (folder / "build" / "bin").mkdir(parents=True)
    for t in ("llama-bench", "llama-simple", "llama-quantize", "ggml-rpc-server"):
        (folder / "build" / "bin" / t).write_text("")
    assert lc.cached(tmp_path, "0.3.36", opts) is None  # no stamp: an unfinished build
    (folder / "build.json").write_text(json.dumps({"options": opts}))
    built = lc.cached(tmp_path, "0.3.36", opts)
    assert built is not None and built.tool("rpc-server").name == "ggml-rpc-server"
    assert lc.cached(tmp_path, "0.3.36", opts[:-1]) is None  # other options: another folder
    (folder / "build" / "bin" / "llama-quantize").unlink()
    assert lc.cached(tmp_path, "0.3.36", opts) is None


def test_the_cache_may_not_lie_inside_the_repository(tmp_path):
    lc.check_cache_root(tmp_path / "cache", tmp_path / "repo")
    with pytest.raises(BadRequest, match="inside the repository"):
        lc.check_cache_root(tmp_path / "repo" / "cache", tmp_path / "repo")


def test_a_failed_build_step_is_a_typed_error_naming_its_log(tmp_path):
    log = tmp_path / "build.log"
    with pytest.raises(lc.LlamaCppBuildFailed) as e:
        lc._run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log,
                       "cmake build")
    assert e.value.message == f"llama.cpp cmake build failed (exit 3); see {log}"
    assert "boom" in log.read_text()
    with pytest.raises(lc.LlamaCppBuildFailed, match="could not start"):
        lc._run_logged([str(tmp_path / "no-such-cmake")], log, "cmake configure")


LLAMA_BENCH_JSON = """[
  {"build_commit": "8cf427ff", "build_number": 5163, "cpu_info": "AMD EPYC",
   "backends": "CPU", "model_type": "llama ?B Q4_1", "model_size": 98000000,
   "n_threads": 2, "n_prompt": 27, "n_gen": 0, "avg_ts": 1500.0,
   "samples_ts": [1400.0, 1600.0, 1500.5]},
  {"build_commit": "8cf427ff", "build_number": 5163, "cpu_info": "AMD EPYC",
   "backends": "CPU", "model_type": "llama ?B Q4_1", "model_size": 98000000,
   "n_threads": 2, "n_prompt": 0, "n_gen": 64, "avg_ts": 150.0,
   "samples_ts": [149.0, 160.0, 151.0]}
]"""


def test_llama_bench_json_gives_median_prefill_and_decode():
    f = lc.parse_llama_bench("build: 8cf427ff (5163)\n" + LLAMA_BENCH_JSON)
    assert f["prefill_tokens_per_s"] == 1500.5 and f["prefill_tokens"] == 27
    assert f["decode_tokens_per_s"] == 151.0 and f["decode_tokens"] == 64
    assert f["decode_runs"] == [149.0, 160.0, 151.0]
    assert f["n_threads"] == 2 and f["build_commit"] == "8cf427ff"
    only_tg = json.dumps([{"n_prompt": 0, "n_gen": 8, "avg_ts": 20.0}])
    assert lc.parse_llama_bench(only_tg)["decode_tokens_per_s"] == 20.0
    for bad in ("", "error: failed to load model", "[]", '[{"n_prompt": 1, "n_gen": 1}]'):
        with pytest.raises(HearthNetError):
            lc.parse_llama_bench(bad)


def test_llama_bench_argv_same_threads_and_rpc_split_evenly():
    argv = lc.llama_bench_argv(Path("/b/llama-bench"), Path("m.gguf"), prompt_tokens=27,
                               tokens=64, threads=2, runs=3)
    assert argv == ["/b/llama-bench", "-m", "m.gguf", "-p", "27", "-n", "64", "-t", "2",
                    "-r", "3", "-o", "json"]
    rpc = lc.llama_bench_argv(Path("b"), Path("m.gguf"), prompt_tokens=0, tokens=64,
                              threads=1, runs=3, rpc=["127.0.0.1:5001", "127.0.0.1:5002"])
    assert rpc[-6:] == ["--rpc", "127.0.0.1:5001,127.0.0.1:5002", "-ngl", "99", "-ts", "1/1"]


def _model(decode: float | None, prefill: float | None, store: float,
           mesh: float | None = None) -> dict[str, object]:
    m: dict[str, object] = {"store_ratio": store,
                            "local": {"decode_ratio": decode, "prefill_ratio": prefill}}
    if mesh is not None:
        m["two_shards"] = {"decode_ratio": mesh}
    return m


def test_goals_each_marked_met_or_missed_with_its_figure():
    g = anchor.evaluate_goals({"smollm2": _model(0.81, 0.69, 1.05, mesh=1.9),
                               "qwen1.5b": _model(0.6, 2.0, 1.2, mesh=1.0)})
    assert g["smollm2 decode_ratio"] == {"measured": 0.81, "goal": "≥ 0.8", "met": True}
    assert g["smollm2 prefill_ratio"] == {"measured": 0.69, "goal": "≥ 0.7", "met": False}
    assert g["smollm2 store_ratio"] == {"measured": 1.05, "goal": "≤ 1.1", "met": True}
    assert g["smollm2 mesh_vs_rpc_ratio"] == {"measured": 1.9, "goal": "≥ 2.0", "met": False}
    assert g["qwen1.5b mesh_vs_rpc_ratio"]["met"]  # ≥ 1× on the 1.5B
    assert not g["qwen1.5b decode_ratio"]["met"] and not g["qwen1.5b store_ratio"]["met"]


def test_a_restarted_engine_has_its_compiled_step_within_five_seconds():
    m = _model(0.81, 0.7, 1.0, mesh=2.0)
    m["local"]["hearthnet"] = {"compile": {
        "first_start": {"state": "compiled in 29.3 s", "seconds": 29.3},
        "restart": {"state": "loaded in 6.2 s", "seconds": 6.2}}}
    g = anchor.evaluate_goals({"smollm2": m})
    assert g["smollm2 restart_compiled_step_s"] == {"measured": 6.2, "goal": "≤ 5.0",
                                                    "met": False}
    m["local"]["hearthnet"]["compile"]["restart"]["seconds"] = 2.5
    assert anchor.evaluate_goals({"smollm2": m})["smollm2 restart_compiled_step_s"]["met"]
    del m["local"]["hearthnet"]["compile"]  # compiled steps off: not checked
    assert "smollm2 restart_compiled_step_s" not in anchor.evaluate_goals({"smollm2": m})


def test_a_figure_not_measured_is_missed_and_a_skipped_part_is_not_checked():
    g = anchor.evaluate_goals({"smollm2": {"store_ratio": 3.0, "local": {"error": "x"}}})
    assert g["smollm2 decode_ratio"] == {"measured": None, "goal": "≥ 0.8", "met": False}
    assert "smollm2 mesh_vs_rpc_ratio" not in g  # --no-rpc
    # a --gguf model: only the store goal (the speed goals were set for (a) and (b))
    g = anchor.evaluate_goals({"gguf:x.gguf": _model(0.1, 0.1, 1.0, mesh=0.1)})
    assert list(g) == ["gguf:x.gguf store_ratio"]


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    from hearthnet.cli import build_parser

    a = build_parser().parse_args(["bench", "anchor", "--cache-dir", str(tmp_path / "c")])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_argument_errors_are_one_line_before_any_work(tmp_path):
    cases = [({"models": [], "gguf": []}, "nothing to run"),
             ({"gguf": [tmp_path / "none.gguf"]}, "no such file"),
             ({"gguf": [tmp_path / "model.bin"]}, "not a .gguf file"),
             ({"skip_build": True}, "--skip-build: no llama.cpp"),
             ({"cache_dir": anchor.REPO / "llama-cache"}, "inside the repository"),
             ({"import_dtype": "q4"}, "--import-dtype must be one of")]
    (tmp_path / "model.bin").write_text("")
    for kw, words in cases:
        with pytest.raises(BadRequest) as e:
            anchor.check_args(_args(tmp_path, **kw))
        assert words in e.value.message and "\n" not in e.value.message
    (tmp_path / "a").mkdir()
    for d in (tmp_path, tmp_path / "a"):
        (d / "M.gguf").write_text("")
    with pytest.raises(BadRequest, match="same name"):
        anchor.check_args(_args(tmp_path, gguf=[tmp_path / "M.gguf", tmp_path / "a/M.gguf"]))
    anchor.check_args(_args(tmp_path, models=[], gguf=[tmp_path / "M.gguf"]))


def test_options_and_their_usage_errors(tmp_path, capsys):
    from hearthnet.cli import build_parser

    a = _args(tmp_path)
    assert a.models == ["smollm2", "qwen1.5b"] and a.threads == 2 and not a.no_rpc
    assert a.weights == anchor.default_weights()
    a = build_parser().parse_args(["bench", "anchor", "--models", "smollm2", "--no-rpc",
                                   "--skip-build", "--gguf", "x.gguf", "--weights", "int8"])
    assert (a.models, a.no_rpc, a.skip_build, a.gguf, a.weights) == (
        ["smollm2"], True, True, [Path("x.gguf")], "int8")
    for bad in (["--models", "llama"], ["--weights", "q9"], ["--tokens", "1"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["bench", "anchor", *bad])
        assert e.value.code == 2
    capsys.readouterr()


def test_default_format_store_alias_and_flags_reported():
    assert anchor.default_weights(("native", "fp32", "int8", "int4")) == "int4"
    assert anchor.default_weights(("native", "fp32", "int8")) == "int8"
    assert anchor.gguf_alias(Path("/m/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf")) == \
        "anchor-qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert anchor.gguf_alias(Path("a b+c.gguf")) == "anchor-a-b-c"
    assert anchor.relevant_flags(frozenset(SAPPHIRE.split())) == sorted(
        ["fma", "sse4_2", "avx", "f16c", "avx2", "bmi2", "avx512f", "avx512dq", "avx512ifma",
         "avx512cd", "avx512bw", "avx512vl", "avx_vnni", "avx512_bf16", "avx512vbmi",
         "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"])


def test_report_prints_both_engines_the_ratios_the_goals_and_any_error():
    m = {"gguf_mb": 93.8, "store_mb": 95.5, "store_ratio": 1.018,
         "local": {"hearthnet": {"decode_tokens_per_s": 80.0, "prefill_tokens_per_s": 300.0,
                                 "peak_rss_mb": 600.0},
                   "llama_cpp": {"decode_tokens_per_s": 100.0, "prefill_tokens_per_s": 200.0,
                                 "peak_rss_mb": 128.8},
                   "decode_ratio": 0.8, "prefill_ratio": 1.5},
         "two_shards": {"llama_cpp_rpc": {"decode_tokens_per_s": 44.3},
                        "hearthnet_mesh": {"error": "the chat did not finish"},
                        "decode_ratio": None, "error": "the chat did not finish"}}
    f = {"models": {"smollm2": m}, "tokens": 64, "runs": 3, "weights": "int4",
         "import_dtype": "gguf", "settings": {"threads": 2}, "results_file": "x.json",
         "llama_cpp": {"version": "llama-cpp-python 0.3.36", "instruction_sets": ["AVX2"],
                       "folder": "/c"}}
    f["goals"] = anchor.evaluate_goals(f["models"])
    text = anchor.report(f)
    assert "smollm2  93.8     95.5 (1.018×)  100.0             80.0" in text
    assert "smollm2  44.3                  -                      -" in text
    assert "error: smollm2 two shards: the chat did not finish" in text
    assert "smollm2 decode_ratio 0.8 (met, goal ≥ 0.8)" in text
    assert "smollm2 mesh_vs_rpc_ratio None (MISSED, goal ≥ 2.0)" in text


def test_two_shards_also_measure_one_thread_with_no_network_as_the_ceiling(
        tmp_path, monkeypatch):
    """One chat's token passes 1-thread stages one after the other: llama.cpp on one thread
    with no network at all is measured beside RPC, and the ratio of the two is reported as
    the most any 1-thread pipeline can reach against RPC on that machine."""
    import contextlib

    runs: list[list[str]] = []

    def bench(argv: list[str], log: Path) -> dict[str, float]:
        runs.append(argv)
        return {"decode_tokens_per_s": 50.0 if "--rpc" in argv else 75.0}

    @contextlib.contextmanager
    def servers(tool, count, threads, log_dir):
        assert (count, threads) == (2, 1)
        yield [("127.0.0.1:1", 11), ("127.0.0.1:2", 12)]

    class Built:
        def tool(self, name: str) -> Path:
            return tmp_path / name

    monkeypatch.setattr(lc, "run_llama_bench", bench)
    monkeypatch.setattr(lc, "rpc_servers", servers)
    monkeypatch.setattr(lc, "server_memory", lambda pids: [40.0 for _ in pids])
    monkeypatch.setattr(anchor, "mesh_decode", lambda entry, args: {"decode_tokens_per_s": 60.0})
    s = anchor.Subject("smollm2", "anchor-smollm2", tmp_path / "m.gguf")
    two = anchor.measure_two_shards(s, object(), Built(), _args(tmp_path), tmp_path)
    rpc_argv, one_argv = runs
    assert "--rpc" in rpc_argv and "--rpc" not in one_argv
    assert one_argv[one_argv.index("-t") + 1] == "1"
    assert two["decode_ratio"] == 1.2 and two["ceiling_ratio"] == 1.5
    assert two["llama_cpp_one_thread"] == {"decode_tokens_per_s": 75.0}
    f = {"models": {"smollm2": {"gguf_mb": 93.8, "store_mb": 95.5, "store_ratio": 1.018,
                                "local": {}, "two_shards": two}},
         "tokens": 64, "runs": 3, "weights": "int4", "import_dtype": "gguf",
         "settings": {"threads": 2}, "results_file": "x.json",
         "llama_cpp": {"version": "v", "instruction_sets": [], "folder": "/c"}}
    f["goals"] = anchor.evaluate_goals(f["models"])
    row = next(ln for ln in anchor.report(f).splitlines()
               if ln.startswith("smollm2") and "50.0" in ln)
    assert row.split() == ["smollm2", "50.0", "60.0", "1.20", "75.0", "1.50"]
