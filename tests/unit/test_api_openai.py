"""The OpenAI-compatible API against a scripted node, driven by the official `openai` client.

The node side is a fake (`ScriptedNode`) that plays given frames, so these tests check the
HTTP layer alone: shapes, statuses, auth, limits, disconnects. The same API against a real
mesh is in tests/integration/test_api_mesh.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from hearthnet.api.openai_compat import Limits, parse_chat_request
from hearthnet.api.server import ApiServer
from hearthnet.errors import BadRequest, ModelNotFound
from hearthnet.frames import StreamFrame, from_wire
from hearthnet.observability import Metrics

KEY = "k" * 24
DONE = {"type": "done", "finish_reason": "length", "usage": {"prompt_tokens": 5,
                                                             "completion_tokens": 2},
        "timings": {"first_token_ms": 3.0}, "pipeline": ["m:0-14@b", "m:15-29@c"],
        "failovers": 1}
FAILOVER = {"type": "shard_failover", "failed": "m:15-29@c", "replacement": ["m:15-29@d"],
            "pipeline": ["m:0-14@b", "m:15-29@d"], "replayed_positions": 7, "ms": 12.0}


def tok(text: str, i: int) -> dict[str, Any]:
    return {"type": "token_delta", "text": text, "token_id": 100 + i, "index": i}


class ScriptedNode:
    """An `ApiHost` whose chat plays `frames`, optionally waiting on `gate` after two."""

    node_id = "node-a"

    def __init__(self, frames: list[dict[str, Any]]) -> None:
        self.metrics = Metrics()
        self.frames = frames
        self.free = True
        self.calls: list[dict[str, Any]] = []
        self.closed = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def chat(self, args: dict[str, Any]) -> AsyncIterator[StreamFrame]:
        self.calls.append(args)
        try:
            for i, f in enumerate(self.frames):
                if i == 2 and self.gate is not None:
                    await self.gate.wait()
                yield from_wire(f)  # typed, as the node's in-process chat gives them
        finally:
            self.closed.set()  # the node's shard sessions would close here

    def model_known(self, name: str) -> None:
        if name != "smollm2":
            raise ModelNotFound(f"unknown model {name!r}")

    def pipelines_free(self) -> bool:
        return self.free

    async def status(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "models": [{
            "alias": "smollm2", "model_id": "m", "num_layers": 30, "fully_covered": True,
            "uncovered": [], "coverage": [{"layers": [0, 29], "hosts": ["b"]}]}],
            "shards": [], "peers": []}


async def _serve(node: ScriptedNode, *, host: str = "127.0.0.1", keys: list[str] | None = None,
                 require_key: bool = False, max_body: int = 4096) -> ApiServer:
    srv = ApiServer(node, listen_host=host, listen_port=0, keys=keys or [],
                    limits=Limits(max_messages=4, max_tokens=64), max_body_bytes=max_body,
                    require_key=require_key)
    await srv.start()
    return srv


@pytest.fixture
async def served():
    servers: list[ApiServer] = []
    clients: list[openai.AsyncOpenAI] = []

    async def make(frames, **kw) -> tuple[ScriptedNode, openai.AsyncOpenAI]:
        node = ScriptedNode(frames)
        srv = await _serve(node, **kw)
        servers.append(srv)
        clients.append(openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY,
                                          max_retries=0))
        return node, clients[-1]

    yield make
    for c in clients:
        await c.close()
    for s in servers:
        await s.stop()


MSG = [{"role": "user", "content": "hi"}]


async def test_non_streaming_shape_usage_finish_and_extension(served):
    node, client = await served([tok("Hel", 0), tok("lo", 1), FAILOVER, DONE])
    r = await client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2,
                                             temperature=0, seed=3, stop=["\n"], top_p=0.5)
    assert r.choices[0].message.content == "Hello"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 2, 7)
    ext = r.model_extra["hearthnet"]
    assert ext["failovers"] == 1 and ext["pipeline"] == DONE["pipeline"]
    assert ext["events"][0]["type"] == "shard_failover"
    s = node.calls[0]["params"]["sampling"]
    assert s == {"max_tokens": 2, "temperature": 0.0, "top_p": 0.5, "seed": 3, "stop": ["\n"]}


async def test_streaming_one_chunk_per_token_then_extension_usage_done(served):
    _, client = await served([tok("Hel", 0), tok("lo", 1), DONE])
    stream = await client.chat.completions.create(
        model="smollm2", messages=MSG, stream=True, stream_options={"include_usage": True},
        max_completion_tokens=2)
    chunks = [c async for c in stream]
    texts = [c.choices[0].delta.content for c in chunks if c.choices]
    assert texts == ["", "Hel", "lo", None]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-2].model_extra["hearthnet"]["pipeline"] == DONE["pipeline"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7


async def test_errors_in_openai_shape_with_statuses(served):
    node, client = await served([{"type": "pipeline_aborted", "reason": "no cover",
                                  "continuing": None, "tokens_so_far": 0},
                                 {"type": "error", "code": "shard_unavailable",
                                  "message": "no shard covers layers 15-29"}])
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="nope", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=10**6)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="smollm2", messages=MSG * 5)  # > 4
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="smollm2", messages=MSG, n=2)
    with pytest.raises(openai.InternalServerError) as e:  # 503 before the first token
        await client.chat.completions.create(model="smollm2", messages=MSG, stream=True)
    assert e.value.status_code == 503 and e.value.body["code"] == "shard_unavailable"
    node.free = False
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="smollm2", messages=MSG)
    assert len(node.calls) == 1  # every refusal came before any work


async def test_error_mid_stream_reaches_the_client(served):
    _, client = await served([tok("a", 0), {"type": "error", "code": "pipeline_stalled",
                                            "message": "no progress"}])
    stream = await client.chat.completions.create(model="smollm2", messages=MSG, stream=True)
    with pytest.raises(openai.APIError, match="no progress"):
        async for _ in stream:
            pass


async def test_body_and_json_bounds_before_work(served):
    node, client = await served([DONE], max_body=2048)
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x" * 4000}])
    assert e.value.status_code == 413
    async with aiohttp.ClientSession() as s:
        url = str(client.base_url) + "chat/completions"
        async with s.post(url, data=b"{not json",
                          headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "bad_request"
    assert node.calls == []


async def test_lan_listener_needs_a_key_compared_and_counted(served):
    node, client = await served([tok("ok", 0), DONE], require_key=True, keys=[KEY])
    async with openai.AsyncOpenAI(base_url=str(client.base_url), max_retries=0,
                                  api_key="wrong-key-0123456789") as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="smollm2", messages=MSG)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
    assert node.calls == []
    text = node.metrics.render().decode()
    assert 'hearthnet_auth_failures_total{reason="api_key"} 2.0' in text
    r = await client.chat.completions.create(model="smollm2", messages=MSG)
    assert r.choices[0].message.content == "ok"
    page_url = str(client.base_url).removesuffix("v1/")
    async with aiohttp.ClientSession() as s:
        async with s.get(page_url) as page:  # the page holds no mesh data: no key
            assert page.status == 200 and "HearthNet" in await page.text()
        async with s.get(page_url + "static/app.js") as js, s.get(page_url + "favicon.ico") as ico:
            assert js.status == 200 and ico.status == 404  # a browser's favicon probe
    assert 'hearthnet_auth_failures_total{reason="api_key"} 2.0' in node.metrics.render().decode()


async def test_models_lists_coverage(served):
    _, client = await served([DONE])
    models = await client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert models.data[0].model_extra["hearthnet"]["fully_covered"] is True


async def test_client_disconnect_mid_stream_closes_the_call(served):
    node, client = await served([tok("a", 0), tok("b", 1), tok("c", 2), DONE])
    node.gate = asyncio.Event()  # the call blocks after two frames, as a slow pipeline
    async with aiohttp.ClientSession() as s:
        url = str(client.base_url) + "chat/completions"
        r = await s.post(url, json={"model": "smollm2", "messages": MSG, "stream": True})
        first = await r.content.readline()
        assert first.startswith(b"data: ") and json.loads(first[6:])["object"] == \
            "chat.completion.chunk"
        r.close()  # the host app goes away mid-answer
    await asyncio.wait_for(node.closed.wait(), 30)  # the node-side call was closed


def test_parse_rejects_bad_values_before_work():
    lim = Limits(max_messages=2, max_tokens=16)
    ok = parse_chat_request({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "hi"}], "stop": "x"}, lim)
    assert ok.args["request"]["messages"][0] == {"role": "system", "content": "be brief"}
    assert ok.args["params"]["sampling"]["stop"] == ["x"]
    assert ok.args["params"]["sampling"]["max_tokens"] == 16  # default capped to the bound
    for bad in ({}, {"model": "m"}, {"model": "m", "messages": []},
                {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
                {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                {"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "temperature": 3},
                {"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": "1"},
                {"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "stream": "yes"},
                {"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "hearthnet": {"evil": 1}}):
        with pytest.raises(BadRequest):
            parse_chat_request(bad, lim)


def test_the_weights_policy_rides_in_the_hearthnet_field_and_the_node_checks_it():
    """Issue 12 §2's call param `weights` from a host app: which shard formats it accepts."""
    from hearthnet.distributed_inference.orchestrator.request import DistributedChatParams

    lim = Limits(max_messages=2, max_tokens=16)
    msgs = [{"role": "user", "content": "hi"}]
    for policy in ("exact", "bf16", "int8"):
        args = parse_chat_request({"model": "m", "messages": msgs,
                                   "hearthnet": {"weights": policy}}, lim).args
        assert args["params"]["weights"] == policy
        assert DistributedChatParams.from_dict(args["params"],
                                               DistributedChatParams()).weights == policy
    args = parse_chat_request({"model": "m", "messages": msgs,
                               "hearthnet": {"weights": "int3"}}, lim).args
    with pytest.raises(BadRequest, match="weights must be 'lossless', 'exact' or a minimum format"):
        DistributedChatParams.from_dict(args["params"], DistributedChatParams())
