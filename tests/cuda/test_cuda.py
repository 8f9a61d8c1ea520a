"""The GPU path on a real CUDA device (issue 13): weights, caches, graphs, budget, OOM.

Every test is marked `cuda` and skipped with a reason where torch sees no GPU
(tests/cuda/conftest.py). Run on a GPU machine with:
``HEARTHNET_TEST_TOKENIZER=<folder with SmolLM2's tokenizer.json> pytest -m cuda tests/cuda``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hearthnet.distributed_inference.engine.device import Staging
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.engine.local import LocalEngine
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.engine.speculation import Speculator
from hearthnet.distributed_inference.shard.server import OpenRequest, ShardServer, ShardSettings
from hearthnet.errors import ShardUnavailable
from tests.helpers.faults import FaultyStack
from tests.helpers.scripted_stream import ScriptedStream, Step

pytestmark = pytest.mark.cuda

MSGS = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "gemma3", "phi3"]


def _tokens(engine: LocalEngine, n: int = 24) -> list[int]:
    return [ev.token_id for ev in engine.generate(MSGS, SamplingParams(max_tokens=n))]


def test_weights_and_caches_live_on_the_gpu_and_the_budget_is_the_real_allocation(tiny):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    stack = LayeredStack(tiny("llama"), 0, 5, device="cuda")
    assert all(p.device.type == "cuda" for p in stack.layers.parameters())
    weights = torch.cuda.memory_allocated() - before
    assert stack.held_bytes() == stack.param_bytes()
    assert abs(weights - stack.held_bytes()) <= 64 * 1024 + stack.held_bytes() // 50
    first = stack.open_session(0, 5, 1000)  # (also builds the rotary tables, once)
    mid = torch.cuda.memory_allocated()
    s = stack.open_session(0, 5, 1000)  # a second cache of the same size
    cache = torch.cuda.memory_allocated() - mid
    assert s.slot.keys[0].device.type == "cuda" and s.slot is not first.slot
    assert abs(cache - s.cache_bytes) <= 4096  # allocator rounding, nothing else
    assert stack.held_bytes() == stack.param_bytes() + 2 * s.cache_bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_gives_the_eager_tokens(tiny, family):
    """Sliding windows (qwen2, mistral, gemma), per-type rotary (gemma3), soft-capping with
    eager attention (gemma2), longrope computed per step (phi3) — graphs or not."""
    entry = tiny(family)
    graphs = LocalEngine(entry, device="cuda")
    eager = LocalEngine(entry, device="cuda", cuda_graphs=False)
    cpu = LocalEngine(entry, device="cpu")
    assert graphs.stack.graphs is (family != "phi3")
    got = _tokens(graphs)
    assert got == _tokens(eager) == _tokens(cpu)
    assert _tokens(graphs) == got  # a second session replays the first one's graph


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma2"])
def test_batched_rows_on_the_gpu_equal_solo_steps(tiny, family, graphs):
    """Eager: rows of several sessions in one forward, each attending over its own cache
    where it lies (sdpa; eager soft-capping), equal each session's solo steps. With graphs:
    each row replays its own session's graph, so a batched answer is exactly its solo one."""
    stack = LayeredStack(tiny(family), 0, 5, device="cuda", cuda_graphs=graphs)
    prompts = [9, 3, 14]  # shorter and longer than the sliding windows
    g = torch.Generator().manual_seed(0)
    solo = [stack.open_session(0, 5, 64) for _ in prompts]
    batch = [stack.open_session(0, 5, 64) for _ in prompts]
    for a, b, n in zip(solo, batch, prompts, strict=True):
        x = torch.randn(1, n, stack.hidden_size, generator=g)
        torch.testing.assert_close(a.forward(x, 0), b.forward(x, 0))
    for t in range(4):
        xs = [torch.randn(1, 1, stack.hidden_size, generator=g) for _ in prompts]
        starts = [n + t for n in prompts]
        want = torch.cat([s.forward(x, p) for s, x, p in zip(solo, xs, starts, strict=True)])
        got = stack.decode_batch(batch, xs, starts)
        assert got.device.type == "cuda"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got, want) or not graphs
    assert all((s.slot.graph is not None) is graphs for s in batch)


class _Answer:
    """A proposer that knows the plain answer: proposes its next tokens, with every third
    proposal run's last token wrong, so passes are taken whole and in part (the cache cut
    back past the wrong one)."""

    def __init__(self, answer: list[int]) -> None:
        self.answer, self.calls = answer, 0
        self.top = max(answer) + 1  # a wrong token that is still in the vocabulary

    def propose(self, gen, k: int) -> list[int]:
        self.calls += 1
        out = list(self.answer[len(gen.tokens):len(gen.tokens) + k])
        if out and self.calls % 3 == 0:
            out[-1] = (out[-1] + 1) % self.top
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_speculative_passes_replay_the_decode_graph_bit_for_bit(tiny, family):
    """A pass of the last token and k proposals replays the slot's one captured step (its
    rows padded to the same count), so its rows are bit for bit the plain decode steps' —
    in bf16 too, where a product of more rows rounds differently — and accepted, cut-back
    and rejected passes give the plain answer."""
    entry = tiny(family)
    engine = LocalEngine(entry, "bf16", device="cuda")
    plain = _tokens(engine, 40)
    spec = Speculator("test", _Answer(plain), max_k=6)
    gen = engine.new_generation(MSGS, SamplingParams(max_tokens=40))
    assert [ev.token_id for ev in engine.run(gen, speculator=spec)] == plain
    assert spec.stats.passes < 40 and spec.stats.accepted < spec.stats.proposed

    n, stack = entry.num_layers - 1, engine.stack
    a, b = stack.open_session(0, n, 32), stack.open_session(0, n, 32)
    torch.manual_seed(0)
    x = torch.randn(1, 12, stack.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(a.forward(x[:, :7], 0), b.forward(x[:, :7], 0))
    steps = torch.cat([a.forward(x[:, i:i + 1], i) for i in range(7, 12)], dim=1)
    assert torch.equal(b.forward(x[:, 7:12], 7), steps)  # one pass of 5 rows
    assert torch.equal(b.forward(x[:, 9:11], 9), steps[:, 2:4])  # cut back, 2 rows again
    assert a.slot.graph is not None and b.slot.graph is not a.slot.graph
    eager = LayeredStack(entry, 0, n, "bf16", device="cuda", cuda_graphs=False)
    c = eager.open_session(0, n, 32)
    c.forward(x[:, :7], 0)
    torch.testing.assert_close(c.forward(x[:, 7:12], 7), steps, rtol=0.05, atol=0.05)


def test_split_stacks_equal_the_local_engine_on_cuda(tiny):
    entry = tiny("qwen2")
    local = LocalEngine(entry, device="cuda")
    want = _tokens(local, 32)
    n = entry.num_layers
    stacks = [LayeredStack(entry, 0, 2, device="cuda"), LayeredStack(entry, 3, n - 1,
                                                                     device="cuda")]
    gen = local.new_generation(MSGS, SamplingParams(max_tokens=32))
    ml = len(gen.prompt_ids) + 33
    sessions = [stacks[0].open_session(0, 2, ml), stacks[1].open_session(3, n - 1, ml)]
    x, pos = local.head.embed_host(gen.prompt_ids), 0
    while not gen.done:
        h = x
        for s in sessions:  # through the host, as over the wire (fp32 both ways)
            h = Staging(s.stack.device).to_host(s.forward(h.cuda(), pos), torch.float32)
        ev = gen.step(local.head.logits(h))
        pos += x.shape[1]
        x = local.head.embed_host([ev.token_id])
    assert gen.tokens == want


def test_redo_after_graph_decoding_rewinds_the_cache(tiny):
    stack = LayeredStack(tiny("qwen2"), 0, 5, device="cuda")
    torch.manual_seed(0)
    xs, alt = torch.randn(1, 12, 64, device="cuda"), torch.randn(1, 1, 64, device="cuda")
    s = stack.open_session(0, 5, 32)
    s.forward(xs[:, :6], 0)
    for i in range(6, 12):  # graph replays
        s.forward(xs[:, i:i + 1], i)
    redo = s.forward(alt, 7)  # one position again: a graph replay at an earlier position
    nxt = s.forward(xs[:, 11:12], 8)
    fresh = stack.open_session(0, 5, 32).forward(
        torch.cat([xs[:, :7], alt, xs[:, 11:12]], dim=1), 0)
    torch.testing.assert_close(torch.cat([redo, nxt], dim=1), fresh[:, 7:], rtol=1e-4,
                               atol=1e-4)


def test_head_on_the_gpu_matches_the_cpu(tiny):
    entry = tiny("gemma2")  # scaled embeddings and final-logit soft-capping
    gpu, cpu = LayeredHead(entry, device="cuda"), LayeredHead(entry)
    ids = gpu.chat_prompt_ids(MSGS)
    h = gpu.embed(ids)
    assert h.device.type == "cuda" and gpu.embed_host(ids).device.type == "cpu"
    torch.testing.assert_close(h.cpu(), cpu.embed(ids), rtol=1e-5, atol=1e-5)
    logits = gpu.logits(h)
    assert logits.device.type == "cpu"
    torch.testing.assert_close(logits, cpu.logits(h.cpu()), rtol=1e-4, atol=1e-4)


def test_pinned_staging_buffers_are_reused():
    s = Staging(torch.device("cuda"))
    outs = []
    for _ in range(3):
        y = torch.randn(1, 1, 2048, device="cuda")
        host = s.to_host(y, torch.bfloat16)
        assert host.is_pinned() and torch.equal(host, y.bfloat16().cpu())
        outs.append(host.data_ptr())
        x = torch.randn(1, 2, 2048)
        assert torch.equal(s.to_device(x, torch.float32).cpu(), x)
    assert len(set(outs)) == 1  # one buffer, reused


def test_an_open_larger_than_free_gpu_memory_is_refused(tiny):
    stack = LayeredStack(tiny("llama"), 0, 5, device="cuda")  # no configured budget
    with pytest.raises(ShardUnavailable, match="free") as e:
        stack.open_session(0, 5, 10**8)  # 100 GB of cache: refused before allocating
    assert e.value.details["reason"] == "device_memory"
    stack.open_session(0, 5, 64)  # and the stack goes on serving


async def test_a_real_cuda_out_of_memory_ends_one_session_and_the_shard_serves_on(tiny):
    entry = tiny("llama")
    with ThreadPoolExecutor(1) as ex:
        server = ShardServer(entry, 0, 5, node_id="n1", endpoint="ws://127.0.0.1:1",
                             settings=ShardSettings(device="cuda", weights="bf16"),
                             executor=ex)
        await server.start()
        assert server.descriptor.device == "cuda" and server.descriptor.device_memory_mb > 0
        req = OpenRequest(server.shard_id, 0, 5, 32, "bf16", "test")
        x = torch.randn(1, 4, 64)

        def hog(out: torch.Tensor) -> torch.Tensor:
            torch.empty(1 << 47, dtype=torch.uint8, device="cuda")  # 128 TiB: a real OOM
            return out

        real = server.stack
        server.stack = FaultyStack(real, hog)
        hit = ScriptedStream([Step(0, 0, x)])
        await server.serve_session(hit, req)
        assert [e.details["reason"] for e in hit.errors] == ["device_out_of_memory"]
        server.stack = real
        ok = ScriptedStream([Step(0, 0, x), Step(1, 4, x[:, :1])])
        await asyncio.wait_for(server.serve_session(ok, req), 120)
        assert len(ok.sent) == 2 and not ok.errors and ok.sent[0][1].dtype == torch.bfloat16
        assert ok.accepted is not None and ok.accepted["device"] == "cuda" and server.active == 0
