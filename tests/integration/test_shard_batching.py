"""A shard batches concurrent sessions' decode steps (issue 16 §1-2), over real transport.

`ShardServer` hosting a tiny random-weight Llama (all 6 layers, fp32) on 127.0.0.1;
several `TensorChannel` sessions step at once. Every answer equals the same session run
alone on a separate stack; the batch size histogram shows the rows really shared a
forward; a NaN row, a failing batched forward, a stalled and a vanished session each
leave the other sessions' answers intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.shard import server as shard_server
from hearthnet.distributed_inference.shard.server import ShardServer, ShardSettings, StepJob
from hearthnet.errors import BadRequest, HearthNetError, StepFailed, StreamStalled
from hearthnet.observability import Metrics
from hearthnet.transport import websocket
from hearthnet.transport.websocket import ServerStream, TensorChannel, serve
from tests.helpers.waiting import wait_until

PROMPTS = [5, 2, 9]  # positions each session prefills before decoding together


@pytest.fixture(scope="module")
def llama(family_models: Any) -> Any:
    return family_models[1]["llama"]


@contextlib.asynccontextmanager
async def _serving(llama: Any, chunk: int, mixed: int
                   ) -> AsyncIterator[tuple[ShardServer, str]]:
    """A shard of the tiny Llama on 127.0.0.1 with these prefill sizes, and its URI."""
    with ThreadPoolExecutor(1) as pool:
        server = ShardServer(llama, 0, 5, node_id="node-s", endpoint="ws://127.0.0.1:1",
                             settings=ShardSettings(batch_window_ms=30_000,
                                                    prefill_chunk_tokens=chunk,
                                                    mixed_prefill_tokens=mixed),
                             executor=pool, metrics=Metrics())
        await server.start()

        async def handler(stream: ServerStream) -> None:
            await server.serve_session(stream, server.validate_open(stream.open_params))

        async with await serve(handler, "127.0.0.1", 0) as ws:
            yield server, f"ws://127.0.0.1:{ws.sockets[0].getsockname()[1]}/shard"
        await server.close_all()


@pytest.fixture
async def shard(llama: Any) -> AsyncIterator[tuple[ShardServer, str]]:
    async with _serving(llama, 4, 4) as served:
        yield served


def _x(seed: int, n: int) -> torch.Tensor:
    return torch.randn(1, n, 64, generator=torch.Generator().manual_seed(seed))


async def _open(server: ShardServer, uri: str, **extra: Any) -> TensorChannel:
    params = {"shard_id": server.shard_id, "model_id": server.entry.model_id,
              "weights_sha256": server.entry.weights_sha256, "start": 0, "end": 5,
              "max_length": 32, "wire_dtype": "fp32", **extra}
    return await TensorChannel.connect(uri, params, deadline_s=30)


def _solo(llama: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same steps on a stack of their own, one session, no batching."""
    s = LayeredStack(llama, 0, 5).open_session(0, 5, 32)
    pos, out = 0, []
    for x in inputs:
        out.append(s.forward(x, pos))
        pos += x.shape[1]
    return out


def _batched_steps(server: ShardServer) -> tuple[float, float]:
    """(rows, forwards) of the shard's batch size histogram."""
    m = server.metrics.shard_batch_size.labels(server.shard_id)
    samples = {s.name: s.value for s in m.collect()[0].samples}
    return samples[m._name + "_sum"], samples[m._name + "_count"]  # type: ignore[attr-defined]


def _assert_solo(llama: Any, runs: list[list[Any]]) -> None:
    """Every output of every run equals its session's solo answer."""
    for inputs, outs in runs:
        for got, want in zip(outs, _solo(llama, inputs), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


async def _session(server: ShardServer, uri: str, i: int, steps: int,
                   bad_at: int | None = None, together: asyncio.Barrier | None = None,
                   **open_params: Any) -> list[Any]:
    """Prefill PROMPTS[i] positions, then `steps` decode steps; the inputs and outputs
    (an exception in place of a failed step's output, after which it stops). With
    `together`, the sessions start decoding only once all have prefilled."""
    ch = await _open(server, uri, **open_params)
    inputs = [_x(i, PROMPTS[i])] + [_x(10 * i + t, 1) for t in range(steps)]
    if bad_at is not None:
        inputs[bad_at] = torch.full((1, 1, 64), float("nan"))
    outs: list[Any] = []
    pos = 0
    try:
        for k, x in enumerate(inputs):
            try:
                outs.append((await ch.step(k, pos, x)).tensor)
            except HearthNetError as e:
                outs.append(e)
                break
            pos += x.shape[1]
            if k == 0 and together is not None:
                await together.wait()
    finally:
        await ch.close()
    return [inputs, outs]


async def _together(server: ShardServer, uri: str, steps: int, bad: int | None = None
                    ) -> list[list[Any]]:
    """The 3 sessions at once, decoding in lockstep once all have prefilled (so their
    rows share batches); session `bad` sends NaN at its second decode step."""
    together = asyncio.Barrier(3)
    return list(await asyncio.gather(*(
        _session(server, uri, i, steps, bad_at=2 if i == bad else None, together=together)
        for i in range(3))))


async def test_concurrent_decode_steps_share_a_forward_and_match_solo(shard, llama):
    server, uri = shard
    runs = await _together(server, uri, 4)
    _assert_solo(llama, runs)
    rows, forwards = _batched_steps(server)
    assert (rows, forwards) == (12, 4)  # 3 sessions × 4 decode steps: 4 forwards of 3 rows
    await wait_until(lambda: server.active == 0, "every session closed")


async def test_sessions_in_different_lanes_make_rounds_of_their_own(shard, llama,
                                                                   monkeypatch):
    """An orchestrator puts its chats in one lane per pipeline stage: each lane's rows
    are batched together and apart from the other lane's, so the next stage can compute
    one lane while this one computes the other; answers are unchanged."""
    server, uri = shard
    calls = _spy_batches(server, monkeypatch)
    together = asyncio.Barrier(3)
    runs = list(await asyncio.gather(*(
        _session(server, uri, i, 4, together=together, lane=lane)
        for i, lane in [(0, 0), (1, 1), (2, 1)])))
    _assert_solo(llama, runs)
    decode = [rows for rows, _ in calls]
    # lane 1's two sessions share every forward; lane 0's lone session never joins them
    assert decode.count(2) >= 3 and 3 not in decode, calls
    assert set(server._lanes) == {0, 1}
    await wait_until(lambda: server.active == 0, "every session closed")
    assert not +server._lane_active  # every lane's count back to nothing


@pytest.mark.parametrize("lane", [-1, 8, "1", True, 1.0])
async def test_a_bad_lane_is_refused_before_any_work(shard, lane):
    server, _ = shard
    params = {"shard_id": server.shard_id, "model_id": server.entry.model_id,
              "weights_sha256": server.entry.weights_sha256, "start": 0, "end": 5,
              "max_length": 32, "wire_dtype": "fp32", "lane": lane}
    with pytest.raises(BadRequest, match=r"lane must be an integer in 0\.\.7"):
        server.validate_open(params)
    assert server.active == 0


@pytest.mark.parametrize("extra", [
    {"ref": ""}, {"ref": "r" * 65}, {"ref": 7},
    {"fork": "r"}, {"fork": {"ref": "r"}}, {"fork": {"ref": "r", "positions": 0}},
    {"fork": {"ref": "r", "positions": 32}}, {"fork": {"ref": "r", "positions": True}},
    {"fork": {"ref": None, "positions": 4}}, {"fork": {"ref": "r", "positions": 4, "x": 1}}])
async def test_a_bad_ref_or_fork_is_refused_before_any_work(shard, extra):
    server, _ = shard
    params = {"shard_id": server.shard_id, "model_id": server.entry.model_id,
              "weights_sha256": server.entry.weights_sha256, "start": 0, "end": 5,
              "max_length": 32, "wire_dtype": "fp32", **extra}
    with pytest.raises(BadRequest, match=r"ref|fork"):
        server.validate_open(params)
    assert server.active == 0


async def test_a_session_forks_the_first_positions_of_its_callers_session(shard, llama):
    """An open naming another open session of the same caller (`fork`) starts with that
    session's first positions: ACCEPT says how many, and the steps after them give what a
    session that computed every position gives. Another caller's session, a ref no
    longer open, or one past what the source holds: none, or as many as it holds."""
    server, uri = shard
    prompt = _x(1, 9)
    source = await _open(server, uri, ref="src")
    await source.step(1, 0, prompt)
    fork = await _open(server, uri, ref="f1", fork={"ref": "src", "positions": 6})
    assert fork.accepted["forked"] == 6
    # steps of several positions (chunks): this fixture's rounds of single positions would
    # wait out its long batch window for the source's step
    rest = [prompt[:, 6:], _x(2, 2)]
    outs = [(await fork.step(1, 6, rest[0])).tensor, (await fork.step(2, 9, rest[1])).tensor]
    want = _solo(llama, [prompt[:, :6], *rest])[1:]
    for got, w in zip(outs, want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    longer = await _open(server, uri, fork={"ref": "src", "positions": 20})
    assert longer.accepted["forked"] == 9  # all the source holds
    server._by_ref[("someone-else", "theirs")] = server._by_ref[("anonymous", "src")]
    other = await _open(server, uri, fork={"ref": "theirs", "positions": 6})
    assert other.accepted["forked"] == 0  # another member's session is out of reach
    del server._by_ref[("someone-else", "theirs")]
    for ch in (source, fork, longer, other):
        await ch.close()
    await wait_until(lambda: server.active == 0, "every session closed")
    assert not server._by_ref  # refs go with their sessions
    gone = await _open(server, uri, fork={"ref": "src", "positions": 6})
    assert gone.accepted["forked"] == 0
    await gone.close()


def _spy_batches(server: ShardServer, monkeypatch: Any, fail: bool = False
                 ) -> list[tuple[int, bool]]:
    """Record (rows, any row NaN) of every batched forward; with `fail`, each one raises
    after being recorded."""
    assert isinstance(server.stack, LayeredStack)
    calls: list[tuple[int, bool]] = []
    real = server.stack.forward_packed

    def spy(sessions: Any, xs: list[torch.Tensor], starts: Any) -> Any:
        calls.append((len(sessions), any(bool(x.isnan().any()) for x in xs)))
        if fail:
            raise RuntimeError("simulated failure of the batched forward")
        return real(sessions, xs, starts)

    monkeypatch.setattr(server.stack, "forward_packed", spy)
    return calls


async def test_a_nan_row_fails_only_its_own_session(shard, llama, monkeypatch):
    server, uri = shard
    calls = _spy_batches(server, monkeypatch)
    # decoding in lockstep: the bad row is in a batch with the two others
    runs = await _together(server, uri, 3, bad=1)
    bad = runs[1][1]
    assert isinstance(bad[-1], StepFailed) and "non-finite" in bad[-1].message
    _assert_solo(llama, [runs[0], runs[2]])
    assert (3, True) in calls, calls  # the NaN row really shared its forward


async def test_a_failed_batched_forward_runs_each_row_alone(shard, llama, monkeypatch):
    server, uri = shard
    calls = _spy_batches(server, monkeypatch, fail=True)
    runs = await _together(server, uri, 2)
    _assert_solo(llama, runs)
    # every round was a real batch that failed, then its rows ran alone
    assert calls == [(3, False), (3, False)], calls


async def test_stalled_and_vanished_sessions_leave_the_others_going(shard, llama):
    server, uri = shard
    server.batcher.window_s = 0.05  # a stalled session holds a round this long at most
    stalled = await _open(server, uri)
    await stalled.step(0, 0, _x(7, 3))  # opened, then silent
    vanished = await _open(server, uri)
    await vanished.step(0, 0, _x(8, 3))
    await vanished.close()  # gone mid-conversation
    runs = await asyncio.gather(*(_session(server, uri, i, 3) for i in range(2)))
    _assert_solo(llama, runs)
    out = await stalled.step(1, 3, _x(9, 1))  # still served afterwards
    torch.testing.assert_close(out.tensor, _solo(llama, [_x(7, 3), _x(9, 1)])[1],
                               rtol=1e-5, atol=1e-5)
    await stalled.close()


async def test_a_mixed_round_packs_prefill_chunks_with_decode_rows(shard, llama, monkeypatch):
    """Issue 16 §1 (mixed rounds): one round of two decode rows, a fresh prefill, a prefill
    chunk after an existing history and a bad chunk (a gap) runs as ONE packed forward;
    the bad row gets its `BadRequest` alone and every other row equals its solo step.
    A non-finite chunk in a round then fails its own session only: the rows share no
    attention, so the other row of that forward is still its solo step."""
    server, _ = shard
    stack = server.stack
    assert isinstance(stack, LayeredStack)
    calls: list[int] = []
    packed = stack.forward_packed

    def spy(sessions: Any, xs: Any, starts: Any) -> Any:
        calls.append(len(sessions))
        return packed(sessions, xs, starts)

    monkeypatch.setattr(stack, "forward_packed", spy)
    held = [5, 9, 0, 3, 2]
    sessions = [stack.open_session(0, 5, 32) for _ in held]
    for i, n in enumerate(held):
        if n:
            sessions[i].forward(_x(i, n), 0)
    xs = [_x(20, 1), _x(21, 1), _x(22, 6), _x(23, 4), _x(24, 3)]
    starts = [5, 9, 0, 3, 7]  # the last one is a gap: its session holds 2 positions
    jobs = [StepJob(s, None, x, p, 1, torch.float32)
            for s, x, p in zip(sessions, xs, starts, strict=True)]
    out = server._run_steps(jobs)
    assert calls == [4] and isinstance(out[4], BadRequest)
    for i in range(4):
        want = _solo(llama, [_x(i, held[i]), xs[i]] if held[i] else [xs[i]])[-1]
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)
    nan = StepJob(sessions[4], None, torch.full((1, 2, 64), float("nan")), 2, 2, torch.float32)
    good = StepJob(sessions[0], None, _x(25, 1), 6, 2, torch.float32)
    out = server._run_steps([good, nan])
    assert calls == [4, 2]  # one packed forward each, no re-run
    assert isinstance(out[1], StepFailed) and "non-finite" in out[1].message
    want = _solo(llama, [_x(0, 5), xs[0], _x(25, 1)])[-1]
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
    for s in sessions:
        s.close()


def _slow_rounds(server: ShardServer, monkeypatch: Any, round_s: float,
                 hold: threading.Event | None = None) -> None:
    """Each round of the shard's batcher takes `round_s` of compute (a slow machine); with
    `hold`, a round blocks until it is set (a stuck forward)."""
    real = server._run_steps

    def slow(jobs: Any) -> list[Any]:
        if hold is not None:
            hold.wait(60)
        time.sleep(round_s)
        return real(jobs)

    monkeypatch.setattr(server.batcher, "run_batch", slow)
    _ping_often(monkeypatch)


def _ping_often(monkeypatch: Any) -> None:
    """Progress PINGs (and the layers' beats) every 0.1 s instead of every second."""
    monkeypatch.setattr(websocket, "PROGRESS_EVERY_S", 0.1)
    monkeypatch.setattr(shard_server, "PROGRESS_EVERY_S", 0.1)


async def test_a_step_queued_behind_other_prefills_is_busy_not_stalled(shard, llama,
                                                                       monkeypatch):
    """docs/protocol.md §3.6a: a session's prompt waits behind another's long prefill for
    longer than its step deadline; the shard's progress PINGs keep it open and its output
    is its solo output — where a step deadline alone would have failed a busy shard."""
    server, uri = shard
    _slow_rounds(server, monkeypatch, 0.15)
    long_x, short_x = _x(1, 24), _x(2, 8)  # 6 and 2 chunks of 4 positions
    a, b = await _open(server, uri), await _open(server, uri)
    try:
        first = asyncio.ensure_future(a.step(0, 0, long_x))
        await wait_until(lambda: server.batcher.queued or server.queue_depth, "a's prefill")
        started = asyncio.get_running_loop().time()
        out = await b.step(0, 0, short_x, deadline_s=0.4)
        waited = asyncio.get_running_loop().time() - started
        await first
    finally:
        await a.close()
        await b.close()
    assert waited > 0.4 and b.progress_pings >= 1, (waited, b.progress_pings)
    torch.testing.assert_close(out.tensor, _solo(llama, [short_x])[0], rtol=1e-5, atol=1e-5)


async def test_a_stuck_forward_sends_no_progress_and_the_step_stalls(shard, monkeypatch):
    """A forward that never returns runs no further rounds, so nobody waiting behind it is
    PINGed: the step deadline fires as before (the failover hook, M26 §5.4)."""
    server, uri = shard
    hold = threading.Event()
    _slow_rounds(server, monkeypatch, 0.0, hold)
    ch = await _open(server, uri)
    try:
        with pytest.raises(StreamStalled):
            await ch.step(0, 0, _x(3, 2), deadline_s=0.4)
        assert ch.progress_pings == 0
    finally:
        hold.set()
        await ch.close()
    await wait_until(lambda: server.active == 0, "the stalled session ended on the shard")


async def test_a_forward_longer_than_the_deadline_beats_through_its_layers(shard, llama,
                                                                          monkeypatch):
    """docs/protocol.md §3.6a: one forward that takes longer than the step deadline (a slow
    machine, a long chunk) is not a stall while its layers go on: each layer beats, the
    shard PINGs, the client re-arms. Without the beats the same step stalls."""
    server, uri = shard
    assert isinstance(server.stack, LayeredStack)
    hooks = [layer.register_forward_hook(lambda *a: time.sleep(0.12))
             for layer in server.stack.layers]  # 6 layers: a 0.7 s forward
    _ping_often(monkeypatch)
    x = _x(4, 3)
    try:
        ch = await _open(server, uri)
        try:
            out = await ch.step(0, 0, x, deadline_s=0.4)
            assert ch.progress_pings >= 1
        finally:
            await ch.close()
        torch.testing.assert_close(out.tensor, _solo(llama, [x])[0], rtol=1e-5, atol=1e-5)
        server.stack.on_layer = None  # no beats: the same step is a stall
        ch = await _open(server, uri)
        try:
            with pytest.raises(StreamStalled):
                await ch.step(0, 0, x, deadline_s=0.4)
        finally:
            await ch.close()
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture
async def pieced(llama: Any) -> AsyncIterator[tuple[ShardServer, str, list[list[int]]]]:
    """A shard whose prefills go in chunks of 8 positions alone and in pieces of 2 beside
    other sessions' decode rows; the third item records each round's positions per job."""
    async with _serving(llama, 8, 2) as (server, uri):
        rounds: list[list[int]] = []
        real = server._run_steps

        def recording(jobs: Any) -> list[Any]:
            rounds.append([int(j.x.shape[1]) for j in jobs])
            return real(jobs)

        server.batcher.run_batch = recording
        yield server, uri, rounds


async def _prompt_beside_decoding(server: ShardServer, uri: str, rounds: list[list[int]],
                                  llama: Any) -> list[list[int]]:
    """An 8-position prompt sent while another session decodes: the rounds that ran
    meanwhile (positions per job). Both sessions' outputs equal their solo steps."""
    decoding = await _open(server, uri)
    first = [_x(1, 3)] + [_x(100 + t, 1) for t in range(60)]
    started = asyncio.Event()
    prompt_done = asyncio.Event()
    outs: list[torch.Tensor] = []

    async def decode() -> None:
        pos = 0
        for k, x in enumerate(first):
            outs.append((await decoding.step(k, pos, x)).tensor)
            pos += x.shape[1]
            if k == 2:
                started.set()  # it has a pace: it decodes
            if prompt_done.is_set():
                return

    task = asyncio.create_task(decode())
    await started.wait()
    rounds.clear()
    late = await _open(server, uri)
    prompt = _x(7, 8)
    got = (await late.step(0, 0, prompt)).tensor
    seen = list(rounds)
    await late.close()  # not waited for by the decoding session's rounds any more
    prompt_done.set()
    await task
    torch.testing.assert_close(got, _solo(llama, [prompt])[0], rtol=1e-5, atol=1e-5)
    _assert_solo(llama, [[first[:len(outs)], outs]])
    await decoding.close()
    await wait_until(lambda: server.active == 0, "the sessions closed")
    return seen


async def test_a_prefill_beside_decoding_sessions_goes_in_small_pieces(pieced, llama):
    """M26 §5.3 (prefill beside decode): an 8-position prompt that arrives while another
    session decodes is cut into pieces of `mixed_prefill_tokens` (2), so no round that
    session waits for carries more than 2 prefill positions; alone, the same prompt goes
    as one chunk (8 ≤ 8). Both sessions' outputs equal their solo steps."""
    server, uri, rounds = pieced
    seen = await _prompt_beside_decoding(server, uri, rounds, llama)
    pieces = [n for r in seen for n in r if n > 1]
    assert pieces == [2, 2, 2, 2], seen
    assert all(sum(n for n in r if n > 1) <= 2 for r in seen), seen

    rounds.clear()
    prompt = _x(7, 8)
    alone = await _open(server, uri)
    got = (await alone.step(0, 0, prompt)).tensor
    torch.testing.assert_close(got, _solo(llama, [prompt])[0], rtol=1e-5, atol=1e-5)
    assert rounds == [[8]]
    await alone.close()


async def test_a_shard_whose_products_round_by_row_count_never_cuts_by_load(pieced, llama):
    """On a GPU (`cuts_by_load` false: half-precision products of other row counts round
    differently) the same prompt beside a decoding session goes as one chunk, as alone,
    so its answer does not depend on who else is decoding."""
    server, uri, rounds = pieced
    server.cuts_by_load = False
    seen = await _prompt_beside_decoding(server, uri, rounds, llama)
    assert [n for r in seen for n in r if n > 1] == [8], seen
