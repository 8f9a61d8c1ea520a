"""`hearthnet plan`'s parts: sizes from headers alone (`models.sizes`), the pure prediction
(`placement.predict`), and the command's answers to bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hearthnet.cli import main
from hearthnet.distributed_inference.placement import predict
from hearthnet.distributed_inference.placement.predict import (
    GIB,
    MIB,
    LayerCosts,
    NodeFacts,
    Sourced,
)
from hearthnet.errors import BadRequest
from hearthnet.models.sizes import (
    gguf_sizes,
    local_sizes,
    safetensors_sizes,
    safetensors_sizes_from_bytes,
)

H, V, LAYERS = 64, 512, 4


def write_model(folder: Path, dtype: Any = None, config: bool = True) -> Path:
    """A tiny Llama-shaped safetensors model: embedding, LAYERS layers, norm, no lm_head."""
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.float32
    folder.mkdir(parents=True, exist_ok=True)
    t = {"model.embed_tokens.weight": torch.zeros((V, H), dtype=dtype),
         "model.norm.weight": torch.zeros((H,), dtype=dtype)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.zeros((H, H), dtype=dtype)
        t[p + "mlp.up_proj.weight"] = torch.zeros((2 * H, H), dtype=dtype)
        t[p + "input_layernorm.weight"] = torch.zeros((H,), dtype=dtype)
    save_file(t, str(folder / "model.safetensors"))
    if config:
        (folder / "config.json").write_text(json.dumps(
            {"num_hidden_layers": LAYERS, "hidden_size": H, "tie_word_embeddings": True}))
    return folder


def write_gguf(path: Path, layers: int = LAYERS, hidden: int = H, vocab: int = V,
               tokens: int = 0, quant: bool = True) -> Path:
    """A GGUF of the same shape (llama.cpp's names), F32 and Q8_0 tensors (F16 without
    `quant`: quick to write); `tokens` vocabulary strings make its header that much bigger."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    if tokens:
        w.add_token_list([f"token-{i:08d}" for i in range(tokens)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), np.float32))
    w.add_tensor("output_norm.weight", np.zeros((hidden,), np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for i in range(layers):
        if quant:
            w.add_tensor(f"blk.{i}.attn_q.weight",
                         gguf.quants.quantize(np.zeros((hidden, hidden), np.float32), q8),
                         raw_dtype=q8)
        else:
            w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((hidden, hidden), np.float16))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.zeros((hidden,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- sizes from headers ----

def test_safetensors_sizes_per_layer_and_head(tmp_path: Path) -> None:
    s = safetensors_sizes(write_model(tmp_path / "m"))
    per_layer = (H * H + 2 * H * H + H) * 4
    assert s.num_layers == LAYERS and s.hidden_size == H and s.stored_format == "fp32"
    assert s.layer_stored_bytes() == [per_layer] * LAYERS
    assert s.head_stored_bytes() == (V * H + H) * 4
    assert s.params_per_layer() == per_layer // 4
    assert s.head_matmul_params() == V * H  # tied: the embedding is the lm_head
    # the same from the file's first bytes (what a URL read hands in), layer count from names
    raw = (tmp_path / "m" / "model.safetensors").read_bytes()
    s2 = safetensors_sizes_from_bytes(raw[:8 + int.from_bytes(raw[:8], "little")], "u")
    assert s2.layer_stored_bytes() == s.layer_stored_bytes() and s2.num_layers == LAYERS


def test_bf16_store_and_held_formats(tmp_path: Path) -> None:
    import torch

    s = safetensors_sizes(write_model(tmp_path / "m", torch.bfloat16))
    assert s.stored_format == "bf16"
    native = predict.layer_costs(s, "native")
    fp32 = predict.layer_costs(s, "fp32")
    int8 = predict.layer_costs(s, "int8")
    assert native.fmt == "bf16" and native.held == native.stored
    assert fp32.held[0] == 2 * native.held[0]
    # int8: a byte per matrix weight + a bf16 scale per output row (and int8-vnni's fp32
    # copy of it); vectors stay fp32
    from hearthnet.distributed_inference.engine import quant

    row = 2 + (4 if quant.int8_kernel_name() == "int8-vnni" else 0)
    assert int8.held[0] == (H * H + H * row) + (2 * H * H + 2 * H * row) + H * 4
    assert int8.head_fmt == "int8" and predict.layer_costs(s, "int4").head_fmt == "int8"


def test_gguf_sizes_from_its_header(tmp_path: Path) -> None:
    s = gguf_sizes(write_gguf(tmp_path / "m.gguf"))
    assert s.container == "gguf" and s.num_layers == LAYERS and s.hidden_size == H
    q = next(t for t in s.layer_tensors(0) if t.name == "blk.0.attn_q.weight")
    assert q.ggml_type == "Q8_0" and q.shape == (H, H)
    assert q.stored_bytes == H * H // 32 * 34  # Q8_0: 34 bytes per 32 values
    assert s.layer_stored_bytes()[0] == q.stored_bytes + H * 4
    assert {t.name for t in s.head_tensors()} == {"token_embd.weight", "output_norm.weight"}


def test_store_sizes_match_the_engine_memory_plan(smollm2: Any) -> None:
    """The plan's held bytes are what a shard really holds (`engine.memory`)."""
    from hearthnet.distributed_inference.engine.memory import layer_weight_bytes

    s = safetensors_sizes(smollm2.path)
    assert s.num_layers == smollm2.num_layers
    for fmt in ("fp32", "bf16", "int8"):
        c = predict.layer_costs(s, fmt)
        assert c.held_of(0, 4) == layer_weight_bytes(smollm2, 0, 4, fmt), fmt


def test_bad_files_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="no such file"):
        local_sizes(tmp_path / "missing.gguf")
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(BadRequest, match="not a readable GGUF"):
        local_sizes(tmp_path / "x.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadRequest, match=r"no \*\.safetensors"):
        local_sizes(tmp_path / "empty")
    with pytest.raises(BadRequest, match="not a safetensors file"):
        safetensors_sizes_from_bytes(b"\x05" + b"\0" * 7 + b"[1,2]", "u")


# ---- the prediction ----

def costs(n: int = 10, per_layer: int = 100 * MIB, params: int = 1000,
          head_params: int = 8000) -> LayerCosts:
    return LayerCosts("m", n, "fp32", "fp32", (per_layer,) * n, (per_layer // 2,) * n,
                      50 * MIB, 25 * MIB, params, head_params)


def node(name: str, speed: float, budget_mib: int | None = None, **kw: Any) -> NodeFacts:
    return NodeFacts(name, Sourced(speed, "test"),
                     budget_mib * MIB if budget_mib is not None else None, "test", **kw)


def test_layers_shared_by_speed_and_capped_by_budget() -> None:
    even = predict.place(costs(), [node("a", 100), node("b", 100)])
    assert even == {"a": [(0, 4)], "b": [(5, 9)]}
    fast = predict.place(costs(), [node("a", 200), node("b", 100)])
    assert sorted(hi - lo + 1 for r in fast.values() for lo, hi in r) == [3, 7]
    assert fast["a"][0][1] - fast["a"][0][0] + 1 == 7
    # a's budget holds 2 layers (250 MiB): b takes the rest
    capped = predict.place(costs(), [node("a", 200, 250), node("b", 100)])
    assert [hi - lo + 1 for lo, hi in capped["a"]] == [2]
    assert [hi - lo + 1 for lo, hi in capped["b"]] == [8]


def test_holders_keep_their_layers_and_fetch_only_the_rest() -> None:
    c = costs()
    p = predict.plan(c, [node("a", 100, orchestrator=True, head_held=False),
                         node("b", 100, holds=((0, 5),)), node("c", 100)])
    by = {n.node_id: n for n in p.nodes}
    assert by["b"].layers == [(0, 5)] and by["b"].fetch_bytes == 0
    assert by["a"].layers + by["c"].layers and p.fits and not p.missing
    got = sorted(r for n in ("a", "c") for r in by[n].layers)
    assert got[0][0] == 6 and got[-1][1] == 9  # the free layers, nothing twice
    assert by["a"].fetch_head and by["a"].fetch_bytes == sum(
        c.stored_of(lo, hi) for lo, hi in by["a"].layers) + c.head_stored


def test_what_does_not_fit_is_named_with_how_much() -> None:
    p = predict.plan(costs(), [node("a", 100, 300, orchestrator=True)])
    assert not p.fits and p.single_tps is None
    # 300 MiB less the 50 MiB head holds 2 layers of 100 MiB: layers 2-9 have no host
    assert p.missing == [(2, 9)] and p.missing_bytes == 8 * 100 * MIB
    assert "layers 2-9 have no host: 800 MiB more budget needed" in p.problems[0]
    assert "fits: NO" in predict.describe(p)


def test_single_chat_rate_is_stages_plus_head_plus_hops() -> None:
    c = costs(params=1000, head_params=8000)
    p = predict.plan(c, [node("a", 200, orchestrator=True, holds=((0, 3),)),
                         node("b", 100, holds=((4, 9),))], Sourced(2.0, "given"))
    # a: 4 layers at 200/s = 20 ms; b: 6 at 100/s = 60 ms; head 8 layer-steps at 200/s =
    # 40 ms; two hops of 2 ms
    assert [(s.node_id, s.lo, s.hi, s.ms) for s in p.stages] == [
        ("a", 0, 3, 20.0), ("b", 4, 9, 60.0)]
    assert p.head_ms == pytest.approx(40.0)
    assert p.single_tps == pytest.approx(1000 / 124.0)
    assert p.hop.source == "given"
    # eight chats: the stated model, or a measured factor when one is given
    model = predict.chats_tps(p.stages, p.head_ms, 2.0, None)
    assert model.value == pytest.approx(8000 / (124 + 7 * predict.ROW_MS))
    assert model.source == predict.BATCH_MODEL
    measured = predict.chats_tps(p.stages, p.head_ms, 2.0, Sourced(3.0, "bench"))
    assert measured.value == pytest.approx(3 * 1000 / 124.0) and measured.source == "bench"


def test_router_takes_the_furthest_reach() -> None:
    c = costs()
    stages = predict.chain(c, {"a": [(0, 9)], "b": [(0, 4)], "c": [(5, 9)]},
                           {"a": 10.0, "b": 100.0, "c": 100.0})
    assert [(s.node_id, s.lo, s.hi) for s in stages] == [("a", 0, 9)]


def test_bad_facts_are_refused() -> None:
    with pytest.raises(BadRequest, match="no node"):
        predict.plan(costs(), [])
    with pytest.raises(BadRequest, match="alike"):
        predict.plan(costs(), [node("a", 1), node("a", 2)])
    with pytest.raises(BadRequest, match="positive"):
        predict.plan(costs(), [node("a", 0)])


def test_hop_from_the_orchestrators_histogram() -> None:
    name = "hearthnet_distributed_inference_hop_overhead_ms"
    got = predict.hop_from_histogram([(name + "_sum", {"shard_id": "x"}, 6.0),
                                      (name + "_count", {"shard_id": "x"}, 3.0),
                                      (name + "_sum", {"shard_id": "y"}, 2.0),
                                      (name + "_count", {"shard_id": "y"}, 1.0)])
    assert got is not None and got.value == pytest.approx(2.0) and "4 hops" in got.source
    assert predict.hop_from_histogram([(name + "_count", {}, 0.0)]) is None


def test_mesh_facts_from_status_and_capacity_events() -> None:
    status = {"nodes": [{"node_id": "a", "self": True, "online": True},
                        {"node_id": "b", "online": True}, {"node_id": "c", "online": True},
                        {"node_id": "d", "online": False}],
              "shards": [{"host": "c", "model_id": "m", "layers": [0, 9], "state": "online",
                          "usable": True, "p95_latency_ms": 52.0}],
              "models": [{"model_id": "m"}]}
    hop = Sourced(2.0, "h")
    facts = predict.mesh_facts(status, {"b": {"m": (50.0, 4)}}, {"m": (1000, 100 * MIB)}, hop,
                               own_budget_bytes=GIB)
    by = {f["node"]: f for f in facts}
    assert set(by) == {"a", "b", "c"}  # d is offline
    assert by["b"]["params_per_s"] == 50_000 and by["b"]["budget_bytes"] == 400 * MIB
    # c: its shard's 10 layers in 52 - 2 ms
    assert by["c"]["params_per_s"] == pytest.approx(10 / 0.050 * 1000)
    assert by["c"]["holds"] == {"m": [[0, 9]]} and by["a"]["budget_bytes"] == GIB
    nodes = predict.node_facts(facts, costs(), "m", Sourced(7000.0, "probe"))
    nf = {n.node_id: n for n in nodes}
    assert nf["a"].orchestrator and nf["a"].head_held and nf["a"].speed.value == 7.0
    assert nf["b"].speed.value == 50.0 and nf["c"].holds == ((0, 9),)
    assert [n.node_id for n in predict.node_facts(facts, costs(), "m")] == ["b", "c"]


# ---- the command ----

def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(["plan", *argv])
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_command_for_given_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    model = write_model(tmp_path / "m")
    rc, out, err = _plan(capsys, str(model), "--node", "a:1:500", "--node", "b:1:500",
                         "--json")
    assert rc == 0, err
    p = json.loads(out)["plan"]
    assert p["fits"] and [n["layers"] for n in p["nodes"]] == [[[0, 1]], [[2, 3]]]
    assert p["single_chat_tokens_per_s"] > 0 and p["hop_source"].startswith("default")
    rc, out, _ = _plan(capsys, str(model), "--node", "a:0.0001:500")
    assert rc == 0 and "fits: NO" in out and "have no host" in out


@pytest.mark.parametrize(("argv", "rc", "says"), [
    (["--node", "a"], 2, "expected NAME:BUDGET_GB"),
    (["--node", "a:x"], 2, "must be numbers"),
    (["--node", "a:-1"], 2, "must be > 0"),
    ([], 1, "give the nodes"),
])
def test_plan_command_refuses_bad_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        argv: list[str], rc: int, says: str) -> None:
    got, _, err = _plan(capsys, str(write_model(tmp_path / "m")), *argv)
    assert got == rc and says in err and "Traceback" not in err


@pytest.mark.parametrize(("model", "says"), [
    ("no-such-model", "unknown model 'no-such-model'"),
    ("{tmp}/absent.gguf", "no such file"),
    ("{tmp}/junk.safetensors", "corrupted safetensors header"),
    ("http://127.0.0.1:9/notes.txt", "not a model file URL"),
])
def test_plan_command_refuses_bad_models(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         model: str, says: str, model_store: Any) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    rc, out, err = _plan(capsys, model.format(tmp=tmp_path), "--node", "a:1:100")
    assert rc == 1 and says in err and not out
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bench_prints_predicted_beside_measured() -> None:
    from hearthnet.bench.pipeline import predicted_beside_measured, prediction_report

    c = costs()
    plans = {name: predict.plan(c, [node("a", speed, orchestrator=True, holds=((0, 9),))])
             .to_dict() for name, speed in (("engine", 100.0), ("probe", 1000.0))}
    pred = {"layer_steps_per_s": {"engine": 100.0, "probe": 1000.0}, **plans}
    # one stage of 10 layers at 100/s (100 ms), the head 80 ms, one 1.54 ms hop
    assert plans["engine"]["single_chat_tokens_per_s"] == pytest.approx(1000 / 181.54, 0.01)
    runs = {"distributed": {"tokens_per_second": 5.0, "hops": {"overhead_p50_ms_max": 3.54}},
            "concurrency": [{"concurrency": 8, "aggregate_tokens_per_second": 20.0}]}
    got = predicted_beside_measured(pred, runs)
    e = got["engine_vs_measured"]
    assert e["ratio_single"] == pytest.approx(5.51 / 5.0, abs=0.01) and e["within_25_percent"]
    assert e["predicted_single_with_measured_hop"] == pytest.approx(1000 / 183.54, abs=0.01)
    assert e["ratio_8_chats"] == pytest.approx(e["predicted_8_chats"] / 20.0, abs=0.001)
    assert not got["probe_vs_measured"]["within_25_percent"]
    text = prediction_report(got)
    assert "ratio 1.10" in text and "within ±25 %" in text and "NOT within" in text
