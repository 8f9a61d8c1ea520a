"""GGUF blocks kept (`models import … --dtype gguf`) and held as int4 exactly (DESIGN.md
decisions 10 and 15): the store is the GGUF's size, `weights_sha256` is defined over the
blocks as stored, and a model held as int4 from its Q4 blocks answers as the same model
de-quantised to fp32 — transformers' own load of the GGUF."""

from __future__ import annotations

import argparse

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, dequantize

from hearthnet.commands.models import _list
from hearthnet.distributed_inference.directory.formats import lossless_of
from hearthnet.distributed_inference.engine import q4vnni
from hearthnet.distributed_inference.engine.blocks import GgmlBlocks, inexact_zeros
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.engine.memory import layer_weight_bytes
from hearthnet.distributed_inference.engine.quant import (
    FusedLinear,
    FusedMember,
    Int4Linear,
    Int8Linear,
    Q8Linear,
)
from hearthnet.models import ModelStore
from hearthnet.models.hashing import weights_sha256
from hearthnet.models.importer import import_model, smollm2_gguf_path
from tests.helpers.kernels import use_int4_kernel
from tests.helpers.tiny_gguf import GGUF_VOCAB, write_tiny_gguf
from tests.helpers.tiny_models import make_tiny_model

IDS = list(range(40, 52))  # inside the tiny GGUF tokenizer's vocabulary
CASES = [("llama", "Q4_0"), ("qwen2", "Q4_1")]  # q/k rows permuted; qkv biases


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("gguf-blocks")
    for fam, quant in CASES:
        src = make_tiny_model(fam, root / "src" / fam, smollm2.path, seed=21, layers=4,
                              vocab_size=GGUF_VOCAB)
        write_tiny_gguf(fam, src, root / f"tiny-{fam}.gguf", quant=quant)
    return root


def _greedy(entry, fmt, n=12):
    head = LayeredHead(entry, "fp32")
    stack = LayeredStack(entry, 0, entry.num_layers - 1, fmt)
    s = stack.open_session(0, entry.num_layers - 1, 64)
    ids, out, logits = list(IDS), [], []
    h = s.forward(head.embed(ids), 0)
    for _ in range(n):
        lg = head.logits(h)
        logits.append(lg)
        out.append(int(lg.argmax()))
        h = s.forward(head.embed(out[-1:]), len(ids) + len(out) - 1)
    return out, torch.stack(logits), stack


@pytest.mark.parametrize(("family", "quant"), CASES)
def test_kept_blocks_held_as_int4_answer_as_the_fp32_dequantised_model(family, quant,
                                                                       ggufs, tmp_path,
                                                                       monkeypatch, capsys):
    """In the exact kernel (`int4pack-fp32`); the fast one rounds to bf16 (below)."""
    from transformers import AutoModelForCausalLM

    use_int4_kernel(monkeypatch, "int4pack-fp32")
    path = ggufs / f"tiny-{family}.gguf"
    entry = import_model(ModelStore(tmp_path / "store"), str(path), dtype="gguf")
    assert entry.ggml_types == {quant: 4 * 7 + 1}  # every layer matrix and the embeddings
    assert entry.dtype == "float32"  # `native`: the blocks de-quantised exactly
    assert entry.stored_as == f"gguf:{quant}"  # what `models list` shows, not float32
    # its Q4 blocks held as they are keep every stored weight: a default (lossless) call
    # takes int4 shards of this store, and fp32 ones; never int8 or bf16
    assert lossless_of(entry) == {"fp32", "int4"}
    _list(argparse.Namespace(models_dir=str(tmp_path / "store"), json=False, config=None))
    listed = capsys.readouterr().out
    assert f" gguf:{quant} " in listed and "float32" not in listed
    size = sum(f.stat().st_size for f in entry.path.glob("*.safetensors"))
    assert size <= 1.1 * path.stat().st_size
    assert weights_sha256(entry.path) == entry.weights_sha256

    tokens, logits, stack = _greedy(entry, "int4")
    mods = list(stack.layers.modules())
    assert not [m for m in mods if isinstance(m, torch.nn.Linear)]
    # each layer's 7 matrices held as int4 groups of 32, siblings that read one input
    # (gate|up, and q|k|v where their packed rows join) as one matrix
    fused = [m for m in mods if isinstance(m, FusedLinear)]
    assert fused and all(isinstance(g.inner, Int4Linear) for g in fused)
    joined = {id(g.inner) for g in fused}
    slots = [m for m in mods if isinstance(m, FusedMember)
             or (isinstance(m, Int4Linear) and id(m) not in joined)]
    assert len(slots) == 4 * 7
    assert all(m.group == 32 for m in mods if isinstance(m, Int4Linear))
    assert stack.param_bytes() == layer_weight_bytes(entry, 0, entry.num_layers - 1, "int4")
    ref_tokens, ref_logits, _ = _greedy(entry, "fp32")
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max() < 1e-4 * ref_logits.abs().max()

    hf = AutoModelForCausalLM.from_pretrained(str(ggufs), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():  # transformers de-quantises the same file to fp32
        expected = hf(torch.tensor([IDS])).logits[0, -1]
    assert (logits[0] - expected).abs().max() < 1e-4 * expected.abs().max()

    use_int4_kernel(monkeypatch, "int4pack-bf16")  # int4pack-bf16
    _, fast, stack = _greedy(entry, "int4", n=1)
    assert {m.scales_and_zeros.dtype for m in stack.layers.modules()
            if isinstance(m, Int4Linear)} == {torch.bfloat16}
    assert stack.param_bytes() == layer_weight_bytes(entry, 0, entry.num_layers - 1, "int4")
    assert (fast[0] - expected).abs().max() < 2e-2 * expected.abs().max()  # bf16 rounding

    # int4-vnni: the blocks' own scales, activations as two int8 digits — the fp32 tokens,
    # logits ~100× closer than bf16's
    if q4vnni.available():
        use_int4_kernel(monkeypatch, q4vnni.KERNEL)
        vnni_tokens, vnni, stack = _greedy(entry, "int4")
        assert all(m.vnni for m in stack.layers.modules() if isinstance(m, Int4Linear))
        assert stack.param_bytes() == layer_weight_bytes(entry, 0, entry.num_layers - 1,
                                                         "int4")
        assert vnni_tokens == ref_tokens
        assert (vnni - ref_logits).abs().max() < 2e-4 * ref_logits.abs().max()


def test_the_vnni_kernel_compiles_into_the_decode_step(ggufs, tmp_path, monkeypatch):
    """A compiled step (inductor's C++ wrapper, as shipped) calls the int4-vnni kernel
    once per held int4 matrix per position and answers as the eager layers do."""
    from hearthnet.config import COMPILE_ENV
    from hearthnet.distributed_inference.engine import compiled

    use_int4_kernel(monkeypatch, q4vnni.KERNEL)
    monkeypatch.setenv(COMPILE_ENV, "1")  # the suite turns compilation off
    monkeypatch.setenv(compiled.WRAPPER_ENV, "cpp")
    entry = import_model(ModelStore(tmp_path / "store"), str(ggufs / "tiny-llama.gguf"),
                         dtype="gguf")
    stack = LayeredStack(entry, 0, entry.num_layers - 1, "int4", compile_decode=True,
                         compile_dir=tmp_path / "compiled")
    assert stack.compiled is not None
    stack.compiled.start(0, entry.num_layers - 1)
    state = stack.compiled.wait(0, entry.num_layers - 1)
    assert state.startswith("compiled in "), state
    head = LayeredHead(entry, "fp32")
    session = stack.open_session(0, entry.num_layers - 1, 64)
    h = session.forward(head.embed(IDS), 0)
    toks = [int(head.logits(h).argmax())]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(6):
            h = session.forward(head.embed(toks[-1:]), len(IDS) + i)
            toks.append(int(head.logits(h).argmax()))
    assert stack.compiled.calls == 6
    held = {m for m in stack.layers.modules() if isinstance(m, Int4Linear)}
    assert held and all(m.vnni for m in held)
    products = sum(e.count for e in prof.key_averages() if e.key == "hearthnet::q4_mm")
    assert products == len(held) * 6
    eager, _, _ = _greedy(entry, "int4", n=7)
    assert toks == eager


def test_q8_0_blocks_are_held_as_they_are_where_the_vnni_kernel_runs(ggufs, tmp_path,
                                                                     monkeypatch):
    """A GGUF quantised to Q8_0 throughout: held as int4, its layer matrices stay the
    file's Q8_0 blocks (`Q8Linear`, no second rounding) and answer as fp32 does; the
    planner's bytes are the held ones. An int8 head (the default beside int4 shards)
    holds its Q8_0 embeddings as they are too — a vocabulary of 261 rows, padded to
    whole tiles — and its logits are an fp32 head's to ~1e-4."""
    use_int4_kernel(monkeypatch, q4vnni.KERNEL)
    src = ggufs / "src" / "llama"
    path = write_tiny_gguf("llama", src, tmp_path / "tiny-q8.gguf", quant="Q8_0")
    entry = import_model(ModelStore(tmp_path / "store"), str(path), dtype="gguf")
    tokens, logits, stack = _greedy(entry, "int4")
    q8 = [m for m in stack.layers.modules() if isinstance(m, Q8Linear)]
    assert len(q8) == 4 * 7
    assert not [m for m in stack.layers.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert stack.param_bytes() == layer_weight_bytes(entry, 0, entry.num_layers - 1, "int4")
    ref_tokens, ref_logits, _ = _greedy(entry, "fp32")
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max() < 2e-4 * ref_logits.abs().max()

    # the head compiled (M26 §5.7), its Q8_0 products in the kernel inside the compiled step
    from hearthnet.config import COMPILE_ENV
    from hearthnet.distributed_inference.engine import compiled

    monkeypatch.setenv(COMPILE_ENV, "1")  # the suite turns compilation off
    monkeypatch.setenv(compiled.WRAPPER_ENV, "python")  # half the C++ wrapper's compile
    head = LayeredHead(entry, "int8", compile_dir=tmp_path / "compiled")
    exact = LayeredHead(entry, "fp32")
    assert isinstance(head.embed_q, Q8Linear) and head.embed_q.out_features == GGUF_VOCAB
    assert isinstance(head.lm_head_q, Q8Linear)  # tied, or Q8_0 blocks of its own
    assert head.compiled is not None
    state = head.compiled.wait()
    assert all(v.startswith("compiled in ") for v in state.values()) and len(state) == 2, state
    assert torch.equal(head.embed(IDS), exact.embed(IDS))
    hidden = torch.randn(1, 3, exact.norm.weight.numel())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = head.logits_rows([hidden, hidden[:, :1]])
    assert head.compiled.calls == 2  # the embedding, then one logits step for both
    assert sum(e.count for e in prof.key_averages() if e.key == "hearthnet::q8_mm") == 1
    want = exact.logits_rows([hidden, hidden[:, :1]])
    assert [g.shape for g in got] == [w.shape for w in want] == [(3, GGUF_VOCAB),
                                                                  (1, GGUF_VOCAB)]
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() < 1e-4 * w.abs().max()


def test_smollm2s_q8_0_embeddings_are_held_as_they_are():
    """SmolLM2's GGUF ties its lm_head to Q8_0 embeddings (49,152 × 576), the matrix an
    int8 head holds: rows exactly gguf-py's de-quantisation, products ~1e-4 of fp32."""
    if not q4vnni.available():
        pytest.skip(q4vnni.unavailable_reason())
    reader = GGUFReader(str(smollm2_gguf_path()))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embd.tensor_type == GGMLQuantizationType.Q8_0
    shape = (int(embd.shape[1]), int(embd.shape[0]))
    lin = Q8Linear(GgmlBlocks(torch.from_numpy(embd.data.copy()), "Q8_0", shape))
    ref = torch.from_numpy(dequantize(embd.data, embd.tensor_type).copy()).reshape(shape)
    ids = torch.tensor([1, 504, 3260, 49151])
    assert torch.equal(lin.rows(ids), ref[ids])
    x = torch.randn(2, shape[1])
    want = x.double() @ ref.double().t()
    assert float((lin(x).double() - want).abs().max()) < 1e-4 * float(want.abs().max())


def test_smollm2s_real_q4_1_blocks_are_held_exactly():
    """Every Q4_1 matrix of layer 0 of the bundled GGUF: held weights and products as
    gguf-py's fp32 de-quantisation gives them."""
    reader = GGUFReader(str(smollm2_gguf_path()))
    tensors = [t for t in reader.tensors if t.name.startswith("blk.0.")
               and t.tensor_type == GGMLQuantizationType.Q4_1]
    assert len(tensors) == 7
    x = torch.randn(3, 1536)
    for t in tensors:
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists the input size first
        raw = torch.from_numpy(t.data.copy())
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(shape)
        assert inexact_zeros(raw, "Q4_1", shape) == 0
        lin = Int4Linear.from_blocks(GgmlBlocks(raw, "Q4_1", shape), None, torch.float32)
        xs = x[:, :shape[1]]
        bound = 1e-6 * float((xs.abs() @ ref.abs().t()).max())
        assert float((lin(xs) - xs @ ref.t()).abs().max()) < bound, t.name


def test_bench_quality_gguf_scores_kept_blocks_against_transformers(ggufs, tmp_path,
                                                                     monkeypatch):
    """`hearthnet bench quality --gguf FILE`: teacher-forced agreement with transformers'
    fp32 de-quantisation of the same file; int4 from Q4 blocks in the exact kernel agrees
    everywhere, and the kernel is named."""
    from hearthnet.bench import quality

    use_int4_kernel(monkeypatch, "int4pack-fp32")
    args = argparse.Namespace(gguf=str(ggufs / "tiny-qwen2.gguf"), formats=["int4", "fp32"],
                              prompts=2, tokens=8, head="fp32", store=None, threads=2,
                              results_dir=str(tmp_path), model=["smollm2"])
    f, text = quality.run(args)  # --gguf hands over to bench/fidelity.py
    for fmt in ("int4", "fp32"):
        row = f["formats"][fmt]
        assert row["top1_agreement"] == 1.0 and row["first_divergence"] == [None, None]
        assert row["positions"] == 16
    assert f["formats"]["int4"]["kernel"] == "int4pack-fp32"
    assert f["formats"]["fp32"]["kernel"] == ""
    assert f["ggml_types"] == {"Q4_1": 29} and "int4/fp32 (int4pack-fp32)" in text
    assert (tmp_path / "quality-gguf.json").is_file()


def test_the_default_import_and_host_keep_the_q4_blocks_and_serve_losslessly(ggufs, tmp_path):
    """What a household gets by default: `models import` keeps a GGUF's blocks, a host with
    no `weights` configured holds its Q4 blocks as they are (int4), and a default
    (lossless) call is served by them, saying so — the local engine holding the same
    format gives the same tokens."""
    import asyncio

    from hearthnet.distributed_inference.engine.local import LocalEngine
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.bus import bus_call
    from hearthnet.mesh.launcher import LocalMesh, NodeSpec
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    store = ModelStore(tmp_path / "store")
    entry = import_model(store, str(ggufs / "tiny-llama.gguf"), alias="tiny")
    assert entry.q4_blocks and entry.stored_as == "gguf:Q4_0"
    messages = [{"role": "user", "content": "Name three colours."}]
    params = SamplingParams(max_tokens=8)
    local = LocalEngine(entry, "int4", head_weights="fp32")  # as node-a + node-b hold it
    want = [e.token_id for e in local.generate(messages, params)]
    specs = [NodeSpec("node-a"), NodeSpec("node-b", [(0, 3)])]
    (tmp_path / "mesh").mkdir()
    with LocalMesh(specs, root=tmp_path / "mesh", model="tiny", models=store.root) as mesh:
        shard = mesh.status("node-a")["shards"][0]
        assert (shard["format"], shard["usable"]) == ("int4", True)

        async def chat() -> list[dict]:
            args = chat_args(messages[0]["content"], "tiny", params)
            return [f async for f in bus_call(mesh.nodes["node-a"].uri, CHAT_CAPABILITY,
                                              args)]

        frames = asyncio.run(chat())
    done = frames[-1]
    assert done["type"] == "done", done
    assert done["formats"]["stages"] == ["int4"] and done["formats"]["lossless"] is True
    assert [f["token_id"] for f in frames if f["type"] == "token_delta"] == want
