"""Compiled decode steps on the CPU (M26 §5.7, engine/compiled.py): the compiled step of
every family the suite covers gives transformers' logits and greedy tokens, a restart
loads the saved step instead of compiling, and a range that cannot be compiled runs
eagerly and says why."""

from __future__ import annotations

import os

import pytest
import torch

from hearthnet.config import COMPILE_ENV
from hearthnet.distributed_inference.engine import compiled as compiled_mod
from hearthnet.distributed_inference.engine import compiled_head as compiled_head_mod
from hearthnet.distributed_inference.engine import head as head_mod
from hearthnet.distributed_inference.engine import quant
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.engine.quant import FusedLinear, Int4Linear, Int8Linear
from tests.helpers.marks import IN_MAKE_BENCH
from tests.helpers.tiny_models import FAMILIES

PROMPT = [300, 301]  # short: the decode positions stay inside every tiny sliding window
DECODE = 2  # kv lengths 3 and 4: inside the smallest window (qwen2: 4)
# families whose compiled step is a variant of one compiled in `make test` (llama's layers
# with rope scaling, a sliding window on every layer, q/k norms): checked in `make bench`.
# A compiled step is checked against the eager layers when built and not used if it
# differs, so a regression there costs speed, never an answer.
# compiled in `make bench` only (each compiles for about 45 s on 2 cores): variants of the
# llama layer, and gemma3, whose sliding window the eager and packed paths' tests cover
VARIANTS = {"llama3", "mistral", "qwen3", "gemma3"}
# and llama, whose check adds the speculative passes' step (two compiles, 50-70 s on 2
# cores), and qwen2 (with its sliding window; 30-46 s, the longest test left in `make
# test`): `make test` compiles steps of every held format against their eager tokens
# (below), every built step is compared with the eager layers before use (`_compare`),
# and the eager layers with transformers' — so these comparisons are for `make bench`
IN_BENCH = VARIANTS | {"llama", "qwen2"}
# families whose layers cannot be traced as a compiled step, and why
EAGER = {"gemma2": "eager attention", "phi3": "rope's frequencies depend on the step"}


@pytest.fixture(autouse=True)
def compiling(monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "1")  # the suite turns compilation off
    # inductor's Python wrapper: half the C++ one's compile time; the default (C++) is
    # built by the quantised formats' test
    monkeypatch.setenv(compiled_mod.WRAPPER_ENV, "python")


def _compiled_stack(entry, tmp_path, weights="fp32"):
    stack = LayeredStack(entry, 0, entry.num_layers - 1, weights, compile_decode=True,
                         compile_dir=tmp_path / "compiled")
    assert stack.compiled is not None
    stack.compiled.start(0, entry.num_layers - 1)
    return stack, stack.compiled.wait(0, entry.num_layers - 1)


def _greedy(head, stack, ids, n):
    session = stack.open_session(0, stack.hi, len(ids) + n + 1)
    logits = [head.logits(session.forward(head.embed(ids), 0))]
    toks = [int(logits[-1].argmax())]
    for i in range(n):
        logits.append(head.logits(session.forward(head.embed([toks[-1]]), len(ids) + i)))
        toks.append(int(logits[-1].argmax()))
    session.close()
    return toks, torch.stack(logits)


@pytest.mark.parametrize("family", [pytest.param(f, marks=IN_MAKE_BENCH) if f in IN_BENCH
                                    else f for f in sorted(FAMILIES)])
def test_compiled_step_gives_transformers_tokens(family, family_models, family_reference,
                                                 tmp_path):
    entry = family_models[1][family]
    stack, state = _compiled_stack(entry, tmp_path)
    if family in EAGER:
        assert state.startswith("eager: ") and EAGER[family] in state, state
        return
    assert state.startswith("compiled in "), state
    toks, logits = _greedy(LayeredHead(entry), stack, PROMPT, DECODE)
    assert stack.compiled.calls == DECODE  # every decode step ran compiled
    with torch.no_grad():
        ref = family_reference(entry)(torch.tensor([PROMPT + toks[:-1]])).logits[
            0, len(PROMPT) - 1:]
    diff = (logits - ref).abs().max().item()
    assert diff < 1e-4, f"{family}: compiled step's logits differ by {diff}"
    assert ref.argmax(-1).tolist() == toks
    if family == "llama":  # one family is enough for the step of speculative passes
        _speculative_pass_compiled(entry, stack, family_reference)


def _speculative_pass_compiled(entry, stack, family_reference):
    """A pass of a few rows (the last token and proposals, DESIGN.md decision 16) runs a
    compiled step of its own, asked for by the first such pass, with transformers' logits."""
    head = LayeredHead(entry)
    ids = [*PROMPT, 302, 303, 304, 305, 306]
    session = stack.open_session(0, stack.hi, 32)
    session.forward(head.embed(ids[:3]), 0)
    assert stack.compiled.rows_step_for(session, 4, 7) is None  # eager while it compiles
    assert stack.compiled.wait_extra("verify", 0, stack.hi).startswith("compiled in ")
    calls = stack.compiled.calls
    rows = head.logits_rows([session.forward(head.embed(ids[3:7]), 3)])[0]  # positions 3..6
    assert stack.compiled.calls == calls + 1
    with torch.no_grad():
        ref = family_reference(entry)(torch.tensor([ids[:7]])).logits[0, 3:7]
    assert (rows - ref).abs().max().item() < 1e-4
    session.close()


def _rounds(head, stack, prompts, steps):
    """Greedy decode of each prompt, its steps as decode rounds of every session
    (`LayeredStack.decode_batch`); each round's tokens and its output rows."""
    sessions = [stack.open_session(0, stack.hi, 16) for _ in prompts]
    last = [int(head.logits(s.forward(head.embed(p), 0)).argmax())
            for s, p in zip(sessions, prompts, strict=True)]
    toks, outs = [], []
    for step in range(steps):
        out = stack.decode_batch(sessions, [head.embed([t]) for t in last],
                                 [len(p) + step for p in prompts])
        last = [int(head.logits(out[b:b + 1]).argmax()) for b in range(len(prompts))]
        toks.append(last)
        outs.append(out)
    for s in sessions:
        s.close()
    return toks, torch.cat(outs)


def _with_rounds(entry, tmp_path, how):
    """A stack whose decode step and, right after it, decode round are built (as a node's
    are) in `tmp_path`'s compiled dir; both states begin with `how`."""
    stack = LayeredStack(entry, 0, entry.num_layers - 1, compile_decode=True,
                         compile_dir=tmp_path / "compiled")
    stack.compiled.after_decode = ("round",)
    stack.compiled.start(0, stack.hi)
    assert stack.compiled.wait(0, stack.hi).startswith(how)
    assert stack.compiled.extra_state("round")[f"0-{stack.hi}"].startswith(how)
    return stack


def test_a_decode_round_of_sessions_runs_compiled_as_the_eager_round(family_models,
                                                                     tmp_path):
    """A round of one position of each of several sessions (different lengths, each over
    its own cache) has a compiled step of its own — built right after the decode step
    where asked for (a node) — that answers as the eager round does, for rounds of any
    number of sessions; its state says so."""
    entry = family_models[1]["llama"]
    stack = _with_rounds(entry, tmp_path, "compiled in ")
    assert not stack.compiled.extra_state("verify")  # not asked for
    head = LayeredHead(entry)
    eager = LayeredStack(entry, 0, entry.num_layers - 1)
    for prompts in ([[300, 301], [302, 303, 304], [305, 306, 307, 308, 309]],
                    [[310, 311], [312, 313, 314]]):
        before = stack.compiled.calls
        toks, outs = _rounds(head, stack, prompts, 3)
        assert stack.compiled.calls - before == 3  # every round ran compiled
        want, want_outs = _rounds(head, eager, prompts, 3)
        assert toks == want
        assert (outs - want_outs).abs().max() < 1e-4 * want_outs.abs().max()
    assert (saved := list((tmp_path / "compiled").glob("round-*.bin")))
    assert saved[0].stat().st_size > 0
    # a restart (another stack on the same store) loads the saved round and runs it
    toks, outs = _rounds(head, _with_rounds(entry, tmp_path, "loaded in "), prompts, 3)
    assert toks == want and (outs - want_outs).abs().max() < 1e-4 * want_outs.abs().max()


@pytest.mark.parametrize("weights", ["int4", pytest.param("int8", marks=IN_MAKE_BENCH)])
def test_quantised_formats_compile_to_their_eager_tokens(weights, family_models, tmp_path,
                                                        monkeypatch):
    """int4's linears (the GGUF-block and re-quantised kernel) trace into the compiled
    step — built as shipped, with inductor's C++ wrapper, its kernels kept in the model
    store's compiled dir though inductor already wrote its /tmp default into the
    environment — which answers as the same format's eager layers do; so does int8 where it
    runs in `int8-vnni`, and says why it stays eager in a packed GEMM torch cannot trace."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv(compiled_mod.WRAPPER_ENV)
    monkeypatch.setenv(compiled_mod.INDUCTOR_CACHE_ENV, default_cache_dir())
    entry = family_models[1]["llama"]
    stack, state = _compiled_stack(entry, tmp_path, weights)
    kernel = quant.kernel_of(weights)
    if weights == "int8" and kernel != "int8-vnni":
        assert state == (f"eager: int8 runs in {kernel}'s packed integer GEMM, which "
                         "torch.compile cannot trace")
        return
    assert state.startswith("compiled in "), state
    kernels = tmp_path / "compiled" / "inductor"
    assert os.environ[compiled_mod.INDUCTOR_CACHE_ENV] == str(kernels)
    assert any(kernels.rglob("*.so"))  # a reboot that empties /tmp keeps them
    head = LayeredHead(entry)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        toks, logits = _greedy(head, stack, PROMPT, DECODE)
    assert stack.compiled.calls == DECODE
    # siblings held as one matrix (gate|up here) run once per compiled step, not once per
    # member: every int4 matrix the layers hold, once per position
    held = {m for m in stack.layers.modules() if isinstance(m, (Int4Linear, Int8Linear))}
    assert any(isinstance(m, FusedLinear) for m in stack.layers.modules())
    if weights == "int8":  # int8-vnni: the kernel's 8-bit path
        kernel = "hearthnet::q8_mm"
    else:  # int4-vnni where this process chose it
        kernel = "hearthnet::q4_mm" if all(m.vnni for m in held) \
            else "aten::_weight_int4pack_mm_for_cpu"
    products = sum(e.count for e in prof.key_averages() if e.key == kernel)
    assert products == len(held) * (1 + DECODE)  # the eager prefill, then each step
    eager_toks, eager_logits = _greedy(head, LayeredStack(entry, 0, entry.num_layers - 1,
                                                          weights), PROMPT, DECODE)
    assert toks == eager_toks
    assert (logits - eager_logits).abs().max() < 1e-2 * eager_logits.abs().max()


def test_restart_loads_the_saved_step(family_models, tmp_path):
    entry = family_models[1]["llama"]
    _, first = _compiled_stack(entry, tmp_path)
    assert first.startswith("compiled in "), first
    saved = list((tmp_path / "compiled").glob("decode-*.bin"))
    assert len(saved) == 1
    stack, again = _compiled_stack(entry, tmp_path)  # a new stack: a restarted node
    assert again.startswith("loaded in "), again
    toks, _ = _greedy(LayeredHead(entry), stack, PROMPT, DECODE)
    assert stack.compiled.calls == DECODE
    eager = LayeredStack(entry, 0, entry.num_layers - 1)
    assert toks == _greedy(LayeredHead(entry), eager, PROMPT, DECODE)[0]
    saved[0].write_bytes(b"not a compiled step")  # torn or foreign: compiled afresh
    _, third = _compiled_stack(entry, tmp_path)
    assert third.startswith("compiled in ") and "(the saved step did not load: " in third


def _compiled_head(entry, tmp_path, weights="fp32"):
    head = LayeredHead(entry, weights, compile_dir=tmp_path / "compiled")
    assert head.compiled is not None
    return head, head.compiled.wait()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_head_gives_transformers_logits(family, family_models, family_reference,
                                                 tmp_path, monkeypatch):
    """The head's embedding and final norm + lm_head (+ Gemma-2's soft-cap) run compiled
    (M26 §5.7) with transformers' logits — one row a step, and several chats' rows in one
    step as the head's batcher sends them — and a restart loads the saved steps."""
    # fp32 logits traced both ways they run: the weights on the left (llama), linear
    monkeypatch.setattr(head_mod, "weights_left_faster", lambda: family == "llama")
    entry = family_models[1][family]
    head, state = _compiled_head(entry, tmp_path)
    assert head.weights_left == (family == "llama")
    assert sorted(state) == ["embed", "logits"], state
    assert all(v.startswith("compiled in ") for v in state.values()), state
    assert len(list((tmp_path / "compiled").glob("head-*.bin"))) == 2
    eager_layers = LayeredStack(entry, 0, entry.num_layers - 1)  # the head alone compiled
    toks, logits = _greedy(head, eager_layers, PROMPT, DECODE)
    assert head.compiled.calls == 2 * (1 + DECODE)  # an embedding and logits per position
    with torch.no_grad():
        ref = family_reference(entry)(torch.tensor([PROMPT + toks[:-1]])).logits[
            0, len(PROMPT) - 1:]
    assert (logits - ref).abs().max().item() < 1e-4
    assert ref.argmax(-1).tolist() == toks
    eager = LayeredHead(entry)
    session = eager_layers.open_session(0, eager_layers.hi, 8)
    hidden = [session.forward(eager.embed(PROMPT + toks[:2]), 0),
              torch.randn(1, 1, head.hidden_size)]
    session.close()
    rows = head.logits_rows(hidden)
    assert [r.shape[0] for r in rows] == [len(PROMPT) + 2, 1]
    for got, want in zip(rows, eager.logits_rows(hidden), strict=True):
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
    again, state = _compiled_head(entry, tmp_path)  # a restarted node's head
    assert all(v.startswith("loaded in ") for v in state.values()), state
    assert _greedy(again, eager_layers, PROMPT, DECODE)[0] == toks


def test_a_head_another_process_builds_is_waited_for_then_loaded(family_models, tmp_path):
    """Nodes sharing a store build a step once: while another process holds a step's build
    lock, a head waits for it and loads the file it leaves instead of compiling it too."""
    entry = family_models[1]["llama"]
    _, state = _compiled_head(entry, tmp_path)
    assert state["logits"].startswith("compiled in "), state
    path = next((tmp_path / "compiled").glob("head-logits-*.bin"))
    saved = path.read_bytes()
    path.unlink()
    with compiled_mod.build_lock(path):  # the other process, building it
        head = LayeredHead(entry, compile_dir=tmp_path / "compiled")
        assert head.compiled is not None and head.compiled.state()["logits"] == "compiling"
        path.write_bytes(saved)  # … and saving it
    state = head.compiled.wait()
    assert state["logits"].startswith("loaded in "), state  # not compiled a second time


def test_fp32_logits_with_the_weights_on_the_left_are_the_linear_ones(family_models,
                                                                     monkeypatch):
    """Where the probe finds ``(W @ rows.T).T`` faster (this CPU's BLAS reads the matrix
    once per row in `F.linear` for a few rows), the fp32 head's logits are the same
    product to fp32's rounding, for one row (padded) and for rounds of several chats."""
    entry = family_models[1]["llama"]
    probe = head_mod.weights_left_faster.__wrapped__()  # the probe itself: one answer
    assert isinstance(probe, bool)
    monkeypatch.setattr(head_mod, "weights_left_faster", lambda: True)
    left = LayeredHead(entry)
    monkeypatch.setattr(head_mod, "weights_left_faster", lambda: False)
    linear = LayeredHead(entry)
    assert left.weights_left and not linear.weights_left
    assert not LayeredHead(entry, "int8").weights_left  # an int8 head has its own kernel
    g = torch.Generator().manual_seed(0)
    for sizes in ([1], [2], [3], [1, 1, 1], [5, 1, 2], [9]):
        hidden = [torch.randn(1, n, left.hidden_size, generator=g) for n in sizes]
        for got, want in zip(left.logits_rows(hidden), linear.logits_rows(hidden),
                             strict=True):
            assert got.shape == want.shape == (want.shape[0], left.config.vocab_size)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_an_int8_head_compiles_what_it_can_and_says_why(family_models, tmp_path):
    """int8 per output channel: the embedding (rows of the int8 matrix) compiles; the
    logits compile where the product is traceable and say why not where it runs in a
    packed integer GEMM; the tokens are the eager int8 head's either way."""
    entry = family_models[1]["llama"]
    head, state = _compiled_head(entry, tmp_path, "int8")
    assert state["embed"].startswith("compiled in "), state
    lm = head.lm_head_q
    assert lm is not None
    if getattr(lm, "kernel", "") in ("onednn", "fbgemm"):
        assert state["logits"] == (f"eager: int8 per output channel runs in {lm.kernel}'s "
                                   "packed integer GEMM, which torch.compile cannot trace")
    else:
        assert state["logits"].startswith("compiled in "), state
    stack = LayeredStack(entry, 0, entry.num_layers - 1)
    assert _greedy(head, stack, PROMPT, DECODE)[0] == \
        _greedy(LayeredHead(entry, "int8"), stack, PROMPT, DECODE)[0]
    assert head.compiled.calls >= 1 + DECODE  # at least every embedding ran compiled


def test_a_head_that_cannot_compile_runs_eagerly_and_says_why(family_models, tmp_path,
                                                             monkeypatch):
    def broken(*_):
        raise RuntimeError("no kernel for this op")

    entry = family_models[1]["llama"]
    monkeypatch.setattr(compiled_head_mod, "_aot_compile", broken)
    head, state = _compiled_head(entry, tmp_path)
    assert state == {k: "eager: compilation failed: RuntimeError: no kernel for this op"
                     for k in ("logits", "embed")}
    stack = LayeredStack(entry, 0, entry.num_layers - 1)
    assert _greedy(head, stack, PROMPT, DECODE)[0] == \
        _greedy(LayeredHead(entry), stack, PROMPT, DECODE)[0]
    assert head.compiled.calls == 0
    monkeypatch.setenv(COMPILE_ENV, "0")
    _, state = _compiled_head(entry, tmp_path / "off")
    assert state == {"logits": "eager: HEARTHNET_COMPILE=0", "embed": "eager: HEARTHNET_COMPILE=0"}
    assert not (tmp_path / "off").exists()  # nothing compiled, nothing written


def test_a_failed_compile_runs_eagerly_and_says_why(family_models, tmp_path, monkeypatch):
    def broken(*_):
        raise RuntimeError("no kernel for this op")

    monkeypatch.setattr(compiled_mod, "_aot_compile", broken)
    entry = family_models[1]["qwen3"]
    stack, state = _compiled_stack(entry, tmp_path)
    assert state == "eager: compilation failed: RuntimeError: no kernel for this op"
    assert stack.compile_state() == {f"0-{entry.num_layers - 1}": state}
    head = LayeredHead(entry)
    eager = LayeredStack(entry, 0, entry.num_layers - 1)
    assert _greedy(head, stack, PROMPT, DECODE)[0] == _greedy(head, eager, PROMPT, DECODE)[0]
    assert stack.compiled.calls == 0


def test_a_step_that_differs_from_eager_is_not_used(family_models, tmp_path, monkeypatch):
    monkeypatch.setitem(compiled_mod.TOLERANCE, torch.float32, -1.0)  # any difference fails
    entry = family_models[1]["llama3"]
    stack, state = _compiled_stack(entry, tmp_path)
    assert state.startswith("eager: the compiled step differs from the eager layers"), state
    head, head_state = _compiled_head(entry, tmp_path)
    assert all(v.startswith("eager: the compiled step differs from the eager head")
               for v in head_state.values()), head_state
    assert not list((tmp_path / "compiled").glob("*.bin"))  # not kept for a restart
    _greedy(head, stack, PROMPT, DECODE)
    assert stack.compiled.calls == 0  # every step ran eagerly
    assert head.compiled.calls == 0


def test_a_bad_wrapper_setting_runs_eagerly_and_says_why(family_models, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv(compiled_mod.WRAPPER_ENV, "rust")
    _, state = _compiled_stack(family_models[1]["llama"], tmp_path)
    assert state == "eager: HEARTHNET_COMPILE_WRAPPER='rust': expected one of cpp, python"


def test_turned_off(family_models, tmp_path, monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "0")
    stack, state = _compiled_stack(family_models[1]["llama"], tmp_path)
    assert state == "eager: HEARTHNET_COMPILE=0"
    assert stack.compile_state() == {"0-5": state}
    assert not (tmp_path / "compiled").exists()  # nothing compiled, nothing written


def test_sessions_decode_while_the_step_compiles_then_switch(family_models, tmp_path):
    """Compilation runs in the background: sessions decode eagerly meanwhile (on this
    thread, beside the compiling one) and compiled once it is ready, with the same tokens."""
    entry = family_models[1]["qwen3"]
    head = LayeredHead(entry)
    want = _greedy(head, LayeredStack(entry, 0, entry.num_layers - 1), PROMPT, DECODE)[0]
    stack = LayeredStack(entry, 0, entry.num_layers - 1, compile_decode=True,
                         compile_dir=tmp_path / "compiled")
    stack.compiled.start(0, entry.num_layers - 1)  # in a background thread
    eager_runs = 0
    while stack.compile_state()["0-5"] == "compiling":
        assert _greedy(head, stack, PROMPT, DECODE)[0] == want
        eager_runs += 1
    assert eager_runs > 0  # chats decoded while it compiled
    assert stack.compiled.wait(0, 5).startswith("compiled in ")
    before = stack.compiled.calls  # (the last eager run may have switched midway)
    assert _greedy(head, stack, PROMPT, DECODE)[0] == want
    assert stack.compiled.calls - before == DECODE


def test_a_one_shot_cli_exits_cleanly_while_its_step_still_compiles(smollm2, tmp_path):
    """`hearthnet chat --local` answers before its decode step has compiled: the process
    must still end with exit code 0 (an interpreter tearing down the compiling thread
    aborted with 134 after the answer)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, COMPILE_ENV: "1"}
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "chat", "--local",
                        "--max-tokens", "4", "Hi."], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tok/s" in r.stderr and "terminate called" not in r.stderr

