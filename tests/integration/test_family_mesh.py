"""Every family, the wire overflow cases and a broken model through real node processes.

Issue 11: one store holds a tiny random-weight model of every supported family (real
config shapes scaled down, tests/helpers/tiny_models.py), two Gemma-3-like models whose
residual stream exceeds fp16's range from layer 2 on (one correctly calibrated, one whose
calibration is made to miss it, so the overflow is only seen at run time) and a model
whose head cannot load. One mesh of three node processes hosts layers [0,1], [2,3] and
[4,5] of every model, so each call relays through three shards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.sanity import BOUNDS_FILE, calibrate
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from hearthnet.models.importer import import_folder
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from tests.helpers.tiny_models import FAMILIES, OVERFLOW_ALIAS, make_tiny_model, overflow_model

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
N = 16
RANGES = [(0, 1), (2, 3), (4, 5)]
OVERFLOW, MISCALIBRATED, BROKEN = OVERFLOW_ALIAS, "gemma-miscal", "broken"
P = "hearthnet_distributed_inference_"


def _add_models(store, root, tokenizer_from):
    """The overflow and broken models, next to the families; every model calibrated."""
    for e in store.entries():
        calibrate(e.path)  # once here, not in each of the three nodes (they read the cache)
    calibrate(overflow_model(store, root / "src", tokenizer_from).path)
    src = make_tiny_model("gemma3", root / "src" / MISCALIBRATED, tokenizer_from, seed=3,
                          overflow_from=2)
    cal = calibrate(import_folder(store, src, alias=MISCALIBRATED).path)
    # a calibration that missed the big activations: auto expects fp16 to fit everywhere
    miscal = store.get(MISCALIBRATED).path
    (miscal / BOUNDS_FILE).write_text(json.dumps({
        "version": 2, "bounds": cal.bounds, "absmax": [1.0] * len(cal.absmax),
        "embed_absmax": 1.0}))
    src = make_tiny_model("llama", root / "src" / BROKEN, tokenizer_from, seed=4)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (src / f).unlink()  # its head cannot load: no tokenizer
    import_folder(store, src, alias=BROKEN)


@pytest.fixture(scope="module")
def family_mesh(tmp_path_factory, smollm2, family_models):
    root = tmp_path_factory.mktemp("family-mesh")
    store = family_models[0]
    _add_models(store, root, smollm2.path)
    hosted = [*FAMILIES, OVERFLOW, MISCALIBRATED]
    specs = [NodeSpec(f"node-{c}", model_shards=[(m, *r) for m in hosted],
                      extra_di={"allow_self_as_shard": True})
             for c, r in zip("abc", RANGES, strict=True)]
    (root / "mesh").mkdir()
    with LocalMesh(specs, root=root / "mesh", model="llama", models=store.root) as m:
        for alias in hosted:
            _wait_covered(m, alias)
        yield m, store


def _wait_covered(mesh: LocalMesh, alias: str) -> None:
    mesh.model = alias
    mesh.wait_covered("node-a", shards=3 * (len(FAMILIES) + 2))


async def _chat(mesh: LocalMesh, model: str, **params: Any) -> list[dict[str, Any]]:
    args = chat_args(PROMPT, model, SamplingParams(max_tokens=N), **params)
    return [f async for f in bus_call(mesh.nodes["node-a"].uri, CHAT_CAPABILITY, args)]


def _tokens(frames):
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]


def _of(frames, kind):
    return [f for f in frames if f["type"] == kind]


def _wires(done: dict[str, Any]) -> list[str]:
    stats = sorted(done["timings"]["per_shard"].values(), key=lambda s: s["layers"])
    return [s["wire_dtype"] for s in stats]


def _greedy_by_transformers(model, ids: list[int], answer: list[int]) -> list[int]:
    """transformers' greedy choice at every step of `answer` (teacher-forced, one pass):
    equal to `answer` exactly when transformers' own greedy decoding gives `answer`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + answer[:-1]])).logits[0, len(ids) - 1:]
    return logits.argmax(-1).tolist()


def _corruption(mesh: LocalMesh) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(mesh.metrics("node-a")):
        for s in fam.samples:
            if s.name == P + "shard_corruption_detected_total":
                total += s.value
    return total


def _no_shard_blamed(mesh: LocalMesh, frames) -> None:
    assert not [f for f in frames if f["type"] == "shard_status" and f["status"] != "ok"]
    assert not _of(frames, "shard_failover") and not _of(frames, "pipeline_aborted")
    assert not any(s["suspect"] for s in mesh.status("node-a")["shards"])
    assert _corruption(mesh) == 0


# ---- the family matrix (issue 11 §1) ----

@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_through_three_node_processes(family_mesh, family, family_reference):
    mesh, store = family_mesh
    frames = await _chat(mesh, family, wire_dtype="fp32")
    done = frames[-1]
    assert done["type"] == "done", done
    assert len(done["pipeline"]) == 3 and done.get("fallback") is None
    entry = store.get(family)
    ids = LayeredHead(entry).chat_prompt_ids([{"role": "user", "content": PROMPT}])
    assert len(ids) > 7  # longer than every family's sliding window
    answer = _tokens(frames)
    assert answer and _greedy_by_transformers(family_reference(entry), ids, answer) == answer
    # speculative passes (prompt lookup, the default) give the answer of one token a pass
    assert done["speculative"]["mode"] == "lookup"
    plain = await _chat(mesh, family, wire_dtype="fp32", speculate="off")
    assert _tokens(plain) == answer and plain[-1].get("speculative") is None
    compact = await _chat(mesh, family, wire_dtype="compact")  # fp16 fits these models
    assert compact[-1]["type"] == "done" and _wires(compact[-1]) == ["fp16"] * 3


# ---- the default wire never changes an answer ----

def _long_chat(tokenizer: Any, target: int) -> list[dict[str, str]]:
    """A system + user chat whose prompt is about `target` tokens."""
    line = ("The keeper climbed the stairs at dusk, trimmed the wick and wrote the weather "
            "in the log, as every keeper had for a hundred years.")
    text: list[str] = []
    while len(tokenizer(" ".join(text))["input_ids"]) < target:
        text.append(line)
    return [{"role": "system", "content": "You are a careful storyteller."},
            {"role": "user", "content": " ".join(text) + " What happened next?"}]


@pytest.mark.parametrize("family", [*sorted(FAMILIES), OVERFLOW])
async def test_default_wire_answers_as_the_local_engine(family_mesh, family):
    """The default wire is lossless: a system + user chat of over 1,000 prompt tokens
    through three shards gives the local engine's tokens, in every family and on a Gemma-3
    whose activations pass fp16's range (a bf16 wire changed such an answer within 7
    tokens)."""
    from hearthnet.distributed_inference.engine.local import LocalEngine

    mesh, store = family_mesh
    entry = store.get(family)
    local = LocalEngine(entry)
    messages = _long_chat(local.head.tokenizer, 1100)
    params = SamplingParams(max_tokens=N)
    gen = local.new_generation(messages, params)
    assert len(gen.prompt_ids) > 1000
    want = [ev.token_id for ev in local.run(gen)]
    args = chat_args("", family, params)
    args["request"]["messages"] = messages
    frames = [f async for f in bus_call(mesh.nodes["node-a"].uri, CHAT_CAPABILITY, args)]
    done = frames[-1]
    assert done["type"] == "done", done
    assert _wires(done) == ["fp32"] * 3 and done["formats"]["lossless"] is True
    assert _tokens(frames) == want


# ---- a compact wire fits the activations ----

async def test_compact_wire_uses_bf16_where_calibration_says_fp16_overflows(family_mesh):
    mesh, _ = family_mesh
    frames = await _chat(mesh, OVERFLOW, wire_dtype="compact")
    assert frames[-1]["type"] == "done", frames[-1]
    # [0,1] carries the embeddings and layer 1 (small); [2,3] and [4,5] carry > 65,504
    assert _wires(frames[-1]) == ["fp16", "bf16", "bf16"]
    assert not _of(frames, "wire_widened") and frames[-1]["formats"]["lossless"] is False
    _no_shard_blamed(mesh, frames)
    fp32 = await _chat(mesh, OVERFLOW)
    assert len(_tokens(fp32)) == len(_tokens(frames))


async def test_overflow_seen_at_run_time_is_widened_and_blames_no_shard(family_mesh):
    mesh, _ = family_mesh
    frames = await _chat(mesh, MISCALIBRATED, wire_dtype="compact")
    assert frames[-1]["type"] == "done", frames[-1]
    widened = _of(frames, "wire_widened")
    # the shard [2,3] saw its output overflow; the orchestrator saw [2,3]'s output
    # overflow when sending it on to [4,5]: both redone wider at the first step
    assert [(w["layers"], w["from"], w["to"], w["step"]) for w in widened] == \
        [([2, 3], "fp16", "bf16", 1), ([4, 5], "fp16", "bf16", 1)]
    assert _wires(frames[-1]) == ["fp16", "bf16", "bf16"]  # for the rest of the call
    assert len(_tokens(frames)) == N or frames[-1]["finish_reason"] == "stop"
    _no_shard_blamed(mesh, frames)
    assert "wire_overflow" in mesh.log_text("node-b")


async def test_forced_fp16_on_an_overflowing_model_is_refused_before_work(family_mesh):
    mesh, _ = family_mesh
    frames = await _chat(mesh, OVERFLOW, wire_dtype="fp16")
    assert [f["type"] for f in frames] == ["error"]
    assert frames[0]["code"] == "bad_request"
    assert "fp16" in frames[0]["message"] and "auto" in frames[0]["message"]


async def test_forced_fp16_overflow_at_run_time_ends_in_wire_overflow(family_mesh):
    mesh, _ = family_mesh
    frames = await _chat(mesh, MISCALIBRATED, wire_dtype="fp16")
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "wire_overflow"
    assert not _tokens(frames)  # not a silent fallback to a wider dtype or to local
    _no_shard_blamed(mesh, frames)


def test_cli_exits_non_zero_without_done(family_mesh):
    mesh, _ = family_mesh
    cfg = str(mesh.nodes["node-a"].config)
    for model, wire, code in ((MISCALIBRATED, "fp16", "wire_overflow"),
                              (BROKEN, "auto", "model_unusable")):
        r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "chat", "--config", cfg,
                            "--model", model, "--wire-dtype", wire, "--max-tokens", "4",
                            "Hello"], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, r.stdout + r.stderr
        assert code in r.stderr


# ---- failures are loud (issue 11 §3) ----

async def test_model_whose_head_fails_gives_every_call_a_typed_error(family_mesh):
    mesh, _ = family_mesh
    for _ in range(2):
        frames = await _chat(mesh, BROKEN)
        assert [f["type"] for f in frames] == ["error"]
        assert frames[0]["code"] == "model_unusable"
        assert BROKEN in frames[0]["message"] and "head" in frames[0]["message"]
    log = mesh.log_text("node-a")
    assert log.count('"event": "model_unusable"') == 1, "logged once, with its cause"
    ok = await _chat(mesh, "llama")  # the node goes on serving the other models
    assert ok[-1]["type"] == "done"
