"""Shared prompt prefixes: a chat whose prompt begins as another running chat's copies those
positions' keys and values on every stage instead of computing them (DESIGN.md decision 12).
Over the in-process transport, real SmolLM2 layers: answers stay the local engine's."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.observability import Metrics
from tests.helpers.inprocess import InProcessMesh

NOTE = ("Here is the note my neighbour left on the kitchen table this morning: the blue "
        "bicycle in the shed needs a new chain, the cat has been fed twice already, and the "
        "plumber comes on Thursday at ten to look at the leaking tap upstairs. ")
QUESTIONS = [NOTE + "When does the plumber come?", NOTE + "What does the bicycle need?"]
TOKENS = 12


def _mesh(smollm2, device: str = "cpu") -> InProcessMesh:
    """Layers 0-14 on node-b, 15-29 on node-c, which advertises `device`."""
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29, device=device)
    return mesh


def _orch(mesh: InProcessMesh, model_store, **kw) -> tuple[PipelineOrchestrator, Metrics]:
    m = Metrics()
    return PipelineOrchestrator(models=model_store, router=mesh.router(), health=mesh.health,
                                metrics=m, connect=mesh.connect,
                                executor=ThreadPoolExecutor(1), **kw), m


async def _run(orch: PipelineOrchestrator, question: str) -> list[dict]:
    params = DistributedChatParams(sampling=SamplingParams(max_tokens=TOKENS),
                                   wire_dtype="fp32", speculate="off")
    request = ChatRequest("smollm2", [{"role": "user", "content": question}])
    return [f.to_wire() async for f in orch.chat(request, params)]


def _tokens(frames: list[dict]) -> list[int]:
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]


def _recording(mesh: InProcessMesh) -> list[dict]:
    opens: list[dict] = []
    connect = mesh.connect

    async def recording(uri, params, deadline_s):
        opens.append(dict(params))
        return await connect(uri, params, deadline_s)

    mesh.connect = recording  # type: ignore[method-assign]
    return opens


async def _note_chats(mesh: InProcessMesh, model_store, local_answer
                      ) -> tuple[list[list[dict]], list[dict], list[tuple[str, int]],
                                 PipelineOrchestrator, Metrics]:
    """The two chats about one note, started at once, each answer checked against the
    local engine's: their frames, the stages' opens, the steps both stages received in
    order (node id, first position), the orchestrator and its metrics."""
    opens = _recording(mesh)
    trace: list[tuple[str, int]] = []
    for host in mesh.hosts.values():
        host.trace = trace
    orch, m = _orch(mesh, model_store)
    answers = await asyncio.gather(*(_run(orch, q) for q in QUESTIONS))
    for q, frames in zip(QUESTIONS, answers, strict=True):
        assert frames[-1]["type"] == "done", frames[-1]
        assert _tokens(frames) == local_answer(q, TOKENS), q
    return answers, opens, trace, orch, m


async def test_chats_that_start_together_compute_their_shared_prompt_once(
        smollm2, model_store, local_answer):
    """Two chats about one note, started at once: the second opens its stages after the
    first has sent the shared positions and copies them from it on both shards, its `done`
    says how many (and `/metrics`), and both answers equal the local engine's. The first
    sends the rest of its prompt right behind the shared positions."""
    mesh = _mesh(smollm2)
    answers, opens, trace, orch, m = await _note_chats(mesh, model_store, local_answer)
    cached = [f[-1]["usage"].get("cached_prompt_tokens", 0) for f in answers]
    first, second = sorted(cached)
    assert first == 0 and second >= 40, cached  # the template's preamble and the note
    prompt = answers[cached.index(second)][-1]["usage"]["prompt_tokens"]
    assert second < prompt
    assert m.prefix_reused_tokens_total._value.get() == second
    forks = [o["fork"] for o in opens if "fork" in o]
    assert len(forks) == 2 and {f["positions"] for f in forks} == {second}
    refs = {o["ref"] for o in opens}
    assert len(refs) == 4 and {f["ref"] for f in forks} <= refs  # the first call's sessions
    # the first call sent the shared positions as a step of their own, then the rest of
    # its prompt: both calls' next steps start where the copy ends
    assert trace[0] == ("node-b", 0)
    assert trace.count(("node-b", second)) == 2, trace
    # and the rest right behind: the first stage had it before the second stage had the
    # shared positions (the stages compute at once; the copy waits for the second stage)
    assert trace.index(("node-b", second)) < trace.index(("node-c", 0)), trace
    assert not orch._live and not orch._constructing
    assert all(not h.by_ref for h in mesh.hosts.values())  # every session closed


async def test_a_shared_part_longer_than_a_chunk_flows_and_is_copied(
        smollm2, model_store, local_answer):
    """With prefill chunks of 16 positions the shared part is several chunks: they flow
    through both stages with the rest of the first prompt behind them, a chunk ends where
    the shared part does, and the second call copies all of it (not a whole prompt each)."""
    mesh = _mesh(smollm2)
    trace: list[tuple[str, int]] = []
    for host in mesh.hosts.values():
        host.trace = trace
    orch, _ = _orch(mesh, model_store, prefill_chunk_tokens=16)
    answers = await asyncio.gather(*(_run(orch, q) for q in QUESTIONS))
    for q, frames in zip(QUESTIONS, answers, strict=True):
        assert frames[-1]["type"] == "done", frames[-1]
        assert _tokens(frames) == local_answer(q, TOKENS), q
    first, second = sorted(f[-1]["usage"].get("cached_prompt_tokens", 0) for f in answers)
    assert first == 0 and second >= 40
    starts = [p for node, p in trace if node == "node-b"]
    chunks = [*range(0, second, 16), second]  # the last shared chunk ends at the copy's end
    assert starts[:len(chunks)] == chunks, starts
    assert starts.count(second) == 2, starts  # the first call's rest and the copy's own
    # the second stage had the first chunk before the first stage had the last shared one
    assert trace.index(("node-c", 0)) < trace.index(("node-b", second - second % 16)), trace


async def test_each_chat_copies_from_the_one_that_shares_most_with_it(
        smollm2, model_store, local_answer):
    """Four chats that start together, two prompts twice (a note and two questions about
    it): the first computes its prompt, a chat with the other question copies the note
    from it, and each repeated prompt is copied whole (all but its last position) from the
    chat with the same prompt — also from one that itself copied the note and was still
    computing its own part, and from the first once it holds all of its prompt — not
    only the note from the first."""
    mesh = _mesh(smollm2)
    opens = _recording(mesh)
    orch, m = _orch(mesh, model_store)
    questions = [QUESTIONS[0], QUESTIONS[1], QUESTIONS[0], QUESTIONS[1]]
    answers = await asyncio.gather(*(_run(orch, q) for q in questions))
    for q, frames in zip(questions, answers, strict=True):
        assert frames[-1]["type"] == "done", frames[-1]
        assert _tokens(frames) == local_answer(q, TOKENS), q
    usage = [f[-1]["usage"] for f in answers]
    cached = {q: sorted(u.get("cached_prompt_tokens", 0) for u, qq in zip(usage, questions,
                                                                         strict=True)
                        if qq == q) for q in QUESTIONS}
    prompt = {q: next(u["prompt_tokens"] for u, qq in zip(usage, questions, strict=True)
                      if qq == q) for q in QUESTIONS}
    note = cached[QUESTIONS[1]][0]
    assert cached[QUESTIONS[0]] == [0, prompt[QUESTIONS[0]] - 1], cached
    assert 40 <= note < prompt[QUESTIONS[1]] - 1, cached
    assert cached[QUESTIONS[1]][1] == prompt[QUESTIONS[1]] - 1, cached
    assert m.prefix_reused_tokens_total._value.get() == sum(sum(v) for v in cached.values())
    # three calls forked: the repeated second question from the sessions of the call that
    # itself forked the note
    forks = [o for o in opens if "fork" in o]
    assert len(forks) == 6, forks
    forked_refs = {o["ref"] for o in forks}
    assert any(o["fork"]["ref"] in forked_refs for o in forks), forks
    assert not orch._live and not orch._constructing


async def test_a_forked_call_fails_over_with_the_copied_positions_replayed(
        smollm2, model_store, local_answer):
    """The last stage of a call that copied its prompt's first positions dies mid-answer:
    the replacement is replayed the copied positions too (the call's record starts with
    the source's inputs), and the answer stays the local engine's."""
    from hearthnet.errors import ConnectionLost

    mesh = _mesh(smollm2)
    connect = mesh.connect

    async def dying_fork(uri, params, deadline_s):
        ch = await connect(uri, params, deadline_s)
        if "fork" in params and params["start"] == 15:  # the forked call's last stage
            # a spare overlapping C, there from now on (before, the router would spread
            # the two calls over C and it)
            mesh.add("node-d", 10, 29)
            step, steps = ch.step, 0

            async def failing(*a, **kw):
                nonlocal steps
                steps += 1
                if steps == 3:
                    raise ConnectionLost(f"{ch.host.node_id} went away")
                return await step(*a, **kw)

            ch.step = failing  # type: ignore[method-assign]
        return ch

    mesh.connect = dying_fork  # type: ignore[method-assign]
    orch, m = _orch(mesh, model_store)
    first = asyncio.create_task(_run(orch, QUESTIONS[0]))
    while not orch._live or not next(iter(orch._live.values())).prefix_ready.is_set():
        await asyncio.sleep(0)
    second = await _run(orch, QUESTIONS[1])
    assert _tokens(await first) == local_answer(QUESTIONS[0], TOKENS)
    assert second[-1]["type"] == "done", second[-1]
    assert second[-1]["usage"].get("cached_prompt_tokens", 0) >= 40
    assert m.failovers_total._value.get() == 1
    assert _tokens(second) == local_answer(QUESTIONS[1], TOKENS)


async def test_prefix_sharing_off_and_prompts_sharing_only_the_preamble(
        smollm2, model_store, local_answer):
    """`prefix_sharing = false`: no fork is asked for. On, prompts that share only the chat
    template's preamble copy no more than that preamble."""
    from hearthnet.distributed_inference.orchestrator.calls import shared_prefix

    for sharing, questions in ((False, QUESTIONS), (True, ["Name three colours.",
                                                           "What is the capital of France?"])):
        mesh = _mesh(smollm2)
        opens = _recording(mesh)
        orch, _ = _orch(mesh, model_store, prefix_sharing=sharing)
        answers = await asyncio.gather(*(_run(orch, q) for q in questions))
        head = (await orch._head(smollm2)).head
        preamble = shared_prefix(*(head.chat_prompt_ids([{"role": "user", "content": q}])
                                   for q in questions))
        for q, frames in zip(questions, answers, strict=True):
            assert _tokens(frames) == local_answer(q, TOKENS), q
            assert frames[-1]["usage"].get("cached_prompt_tokens", 0) <= preamble
        if sharing:
            assert 0 < preamble < 40
        else:
            assert not any("fork" in o for o in opens)
            assert all("cached_prompt_tokens" not in f[-1]["usage"] for f in answers)


async def test_no_prompt_is_shared_through_a_stage_on_a_gpu(smollm2, model_store, local_answer):
    """A stage that computes on a GPU rounds a prompt cut in two pieces differently from
    the whole (half-precision products of other row counts): the two chats about one note
    then ask no fork, and each sends its prompt as one step, as alone."""
    mesh = _mesh(smollm2, device="cuda")
    answers, opens, trace, orch, m = await _note_chats(mesh, model_store, local_answer)
    assert all("cached_prompt_tokens" not in f[-1]["usage"] for f in answers)
    assert not any("fork" in o for o in opens)
    assert m.prefix_reused_tokens_total._value.get() == 0
    shortest = min(f[-1]["usage"]["prompt_tokens"] for f in answers)
    # each prompt went as one step from position 0; every later step is a decode step
    starts = [pos for node, pos in trace if node == "node-b"]
    assert starts.count(0) == 2 and all(p == 0 or p >= shortest for p in starts), starts
    assert not orch._live and not orch._constructing


def test_a_session_copies_another_sessions_first_positions(smollm2):
    """`copy_prefix`: the positions a session takes from another of the same stack and
    sub-range make its next step's output the one a full prefill gives; a session of
    another sub-range, or one holding positions already, takes none."""
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    stack = LayeredStack(smollm2, 0, 3, "fp32")
    x = torch.randn(1, 24, stack.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = stack.open_session(0, 3, 64)
    want = whole.forward(x, 0)
    fork = stack.open_session(0, 3, 64)
    assert fork.copy_prefix(whole, 16) == 16 and fork.length == 16
    got = fork.forward(x[:, 16:], 16)
    torch.testing.assert_close(got, want[:, 16:], rtol=1e-4, atol=1e-4)
    other = stack.open_session(0, 2, 64)
    assert other.copy_prefix(whole, 16) == 0
    assert fork.copy_prefix(whole, 8) == 0  # holds positions already
    short = stack.open_session(0, 3, 64)
    assert short.copy_prefix(whole, 100) == 24  # no more than the source holds
    for s in (whole, fork, other, short):
        s.close()
