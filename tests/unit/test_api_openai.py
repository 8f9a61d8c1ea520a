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

from hearthnet.api.openai_compat import (
    CompletionBuilder,
    Limits,
    parse_chat_request,
    parse_completion_request,
)
from hearthnet.api.server import ApiServer
from hearthnet.errors import BadRequest, ModelNotFound
from hearthnet.frames import Done, StreamFrame, from_wire
from hearthnet.observability import Metrics

KEY = "k" * 24
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a model id holds a "/"
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
            "alias": "smollm2", "model_id": MODEL_ID, "weights_sha256": "ab" * 32,
            "num_layers": 30, "fully_covered": True, "uncovered": [],
            "coverage": [{"layers": [0, 29], "hosts": ["b"]}]}],
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


async def test_prompt_tokens_copied_from_another_chat_are_cached_tokens(served):
    """A `done` whose stages copied prompt positions from another chat (a shared prefix)
    reports them as OpenAI's `prompt_tokens_details.cached_tokens`; without, none."""
    cached = {**DONE, "usage": {**DONE["usage"], "cached_prompt_tokens": 4}}
    _, client = await served([tok("Hel", 0), tok("lo", 1), cached])
    r = await client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2)
    assert r.usage.prompt_tokens == 5 and r.usage.prompt_tokens_details.cached_tokens == 4
    _, plain = await served([tok("Hel", 0), tok("lo", 1), DONE])
    r = await plain.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2)
    assert r.usage.prompt_tokens_details is None


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


async def test_models_retrieve_gives_the_listed_object_and_404_for_an_unknown(served):
    _, client = await served([DONE])
    listed = (await client.models.list()).data[0]
    for name in ("smollm2", MODEL_ID, "ab" * 32):  # the names a chat call takes
        got = await client.models.retrieve(name)
        assert got.model_dump() == listed.model_dump() and got.id == "smollm2"
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("no-such-model")
    assert e.value.body == {"message": e.value.body["message"], "type": "invalid_request_error",
                            "param": "model", "code": "model_not_found"}
    assert "no-such-model" in e.value.body["message"]
    url = str(client.base_url) + "models/" + MODEL_ID  # a "/" sent as it is, not %2F
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200 and (await r.json())["id"] == "smollm2"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# (field, value, the param the 400 names): each asks for something the server does not do
REFUSED = [
    ("logprobs", "yes", "logprobs"), ("logprobs", 1, "logprobs"),
    ("top_logprobs", 3, "top_logprobs"),  # without logprobs: true
    ("top_logprobs", 1.0, "top_logprobs"),
    ("frequency_penalty", 0.5, "frequency_penalty"),
    ("presence_penalty", -1, "presence_penalty"),
    ("logit_bias", {"50256": -100}, "logit_bias"),
    ("tool_choice", "required", "tool_choice"),  # without tools
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    ("parallel_tool_calls", "yes", "parallel_tool_calls"),
    ("functions", [TOOL["function"]], "functions"),
    ("function_call", {"name": "f"}, "function_call"),
    ("n", 2, "n"), ("n", 1.0, "n"), ("n", True, "n"),
    ("modalities", ["text", "audio"], "modalities"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
    ("prediction", {"type": "content", "content": "x"}, "prediction"),
    ("reasoning_effort", "low", "reasoning_effort"), ("verbosity", "low", "verbosity"),
    ("web_search_options", {}, "web_search_options"), ("store", True, "store"),
    ("metadata", {"k": "v"}, "metadata"), ("service_tier", "flex", "service_tier"),
    ("stream_options", {"include_obfuscation": True}, "stream_options.include_obfuscation"),
    ("stream_options", {"chunk_size": 4}, "stream_options.chunk_size"),
    ("top_k", 5, "top_k"),  # not an OpenAI field: refused, as OpenAI does, not ignored
    ("user", 7, "user"),
]
# (field, value): values that ask for nothing, so the call is the one without the field
ACCEPTED_OFF = [
    ("logprobs", False), ("top_logprobs", 0), ("frequency_penalty", 0),
    ("frequency_penalty", 0.0), ("presence_penalty", 0), ("logit_bias", {}), ("tools", []),
    ("tool_choice", "none"), ("tool_choice", "auto"), ("parallel_tool_calls", False),
    ("parallel_tool_calls", True), ("functions", []), ("function_call", "none"),
    ("response_format", {"type": "text"}), ("n", 1), ("modalities", ["text"]),
    ("store", False), ("metadata", {}), ("service_tier", "auto"),
    ("service_tier", "default"), ("stream_options", {"include_obfuscation": False}),
    ("user", "alice"), ("safety_identifier", "h-123"), ("prompt_cache_key", "k"),
    *((k, None) for k in ("logprobs", "top_logprobs", "frequency_penalty", "tools",
                          "tool_choice", "response_format", "n", "audio", "prediction",
                          "reasoning_effort", "verbosity", "web_search_options", "store",
                          "metadata", "service_tier", "seed", "user")),
]
LIM = Limits(max_messages=4, max_tokens=16)
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


@pytest.mark.parametrize(("key", "value", "param"), REFUSED,
                         ids=[f"{k}={json.dumps(v)[:24]}" for k, v, _ in REFUSED])
def test_a_field_the_server_does_not_honour_is_refused_naming_it(key, value, param):
    with pytest.raises(BadRequest) as e:
        parse_chat_request({**BASE, key: value}, LIM)
    assert e.value.details["param"] == param and param in e.value.message
    assert any(w in e.value.message for w in ("not supported", "refused", "must be"))


@pytest.mark.parametrize(("key", "value"), ACCEPTED_OFF,
                         ids=[f"{k}={json.dumps(v)}" for k, v in ACCEPTED_OFF])
def test_a_value_that_asks_for_nothing_is_accepted_as_the_plain_call(key, value):
    plain = parse_chat_request(BASE, LIM)
    got = parse_chat_request({**BASE, key: value}, LIM)
    assert got.args == plain.args and got.stream == plain.stream


def test_a_message_field_beyond_role_and_content_is_refused_unless_empty():
    echoed = {"role": "assistant", "content": "Paris.", "refusal": None, "tool_calls": None,
              "function_call": None, "audio": None, "annotations": [], "name": None}
    ok = parse_chat_request({**BASE, "messages": [*BASE["messages"], echoed,
                                                  {"role": "user", "content": "and?"}]}, LIM)
    assert ok.args["request"]["messages"][1] == {"role": "assistant", "content": "Paris."}
    for extra, param in (({"name": "bob"}, "messages[0].name"),
                         ({"tool_call_id": "c1"}, "messages[0].tool_call_id"),
                         ({"weight": 2}, "messages[0].weight")):
        with pytest.raises(BadRequest) as e:
            parse_chat_request({**BASE, "messages": [{**BASE["messages"][0], **extra}]}, LIM)
        assert e.value.details["param"] == param


async def test_refusals_reach_the_openai_client_before_any_work(served):
    node, client = await served([tok("a", 0), DONE])
    for kw, param in (({"logit_bias": {"1": 5}}, "logit_bias"),
                      ({"functions": [TOOL["function"]]}, "functions"),
                      ({"frequency_penalty": 1.0}, "frequency_penalty")):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="smollm2", messages=MSG, **kw)
        assert e.value.body["param"] == param and e.value.body["code"] == "bad_request"
        assert "not supported" in e.value.body["message"], e.value.body
    assert node.calls == []
    r = await client.chat.completions.create(
        model="smollm2", messages=MSG, logprobs=False, frequency_penalty=0,
        presence_penalty=0, response_format={"type": "text"}, tool_choice="none", n=1)
    assert r.choices[0].message.content == "a" and len(node.calls) == 1


@pytest.mark.parametrize(("reason", "openai_reason"),
                         [("eos", "stop"), ("stop", "stop"), ("length", "length")])
async def test_finish_reason_speaks_openai_over_http(served, reason, openai_reason):
    done = {**DONE, "finish_reason": reason}
    _, client = await served([tok("a", 0), done])
    r = await client.chat.completions.create(model="smollm2", messages=MSG)
    assert r.choices[0].finish_reason == openai_reason
    stream = await client.chat.completions.create(model="smollm2", messages=MSG, stream=True)
    finishes = [c.choices[0].finish_reason async for c in stream if c.choices]
    assert finishes[-1] == openai_reason and set(finishes[:-1]) == {None}


def test_an_unknown_done_reason_reads_as_stop():
    out = CompletionBuilder("m")
    out.feed(Done("some_new_reason", {}, {}, ()))
    assert out.response()["choices"][0]["finish_reason"] == "stop"


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
                {"model": "m", "messages": [{"role": "function", "content": "x"}]},
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


def test_chat_logprobs_are_asked_of_the_node_within_openai_s_bounds():
    got = parse_chat_request({**BASE, "logprobs": True, "top_logprobs": 20}, LIM)
    assert got.logprobs == 20 and got.args["params"]["sampling"]["logprobs"] == 20
    assert parse_chat_request({**BASE, "logprobs": True}, LIM).logprobs == 0
    for kw in ({"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}):
        with pytest.raises(BadRequest) as e:
            parse_chat_request({**BASE, **kw}, LIM)
        assert e.value.details["param"] == "top_logprobs"


# the frames of a call that asked for 2 alternatives per token: " Paris" (logprob -0.25, the
# likeliest) and "\u00e9" as its first byte only (a token that is part of a character)
LP_TOKENS = [
    {**tok(" Paris", 0), "logprob": -0.25, "bytes": list(b" Paris"),
     "top_logprobs": [[100, -0.25, list(b" Paris")], [7, -1.75, list(b" Lyon")]]},
    {**tok("", 1), "logprob": -3.5, "bytes": [0xC3],
     "top_logprobs": [[9, -0.5, list(b".")], [8, -1.0, list(b"!")]]},
]


async def test_chat_logprobs_in_openai_s_shape_streaming_and_not(served):
    node, client = await served([*LP_TOKENS, DONE])
    r = await client.chat.completions.create(model="smollm2", messages=MSG, logprobs=True,
                                             top_logprobs=2)
    assert node.calls[0]["params"]["sampling"]["logprobs"] == 2
    content = r.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [
        (" Paris", -0.25, list(b" Paris")), ("\\xc3", -3.5, [0xC3])]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [(" Paris", -0.25),
                                                                       (" Lyon", -1.75)]
    stream = await client.chat.completions.create(model="smollm2", messages=MSG,
                                                  logprobs=True, top_logprobs=2, stream=True)
    chunks = [c async for c in stream]
    per_token = [c.choices[0].logprobs.content for c in chunks
                 if c.choices and c.choices[0].logprobs]
    assert [e.model_dump() for es in per_token for e in es] == [e.model_dump()
                                                                 for e in content]
    plain = await client.chat.completions.create(model="smollm2", messages=MSG)
    assert plain.choices[0].logprobs is None  # not asked: none given


async def test_text_completion_shape_streaming_and_not(served):
    node, client = await served([tok("Hel", 0), tok("lo", 1), FAILOVER, DONE])
    r = await client.completions.create(model="smollm2", prompt="Say", max_tokens=2,
                                        temperature=0, stop=["\n"])
    assert node.calls[0]["request"] == {"model": "smollm2", "prompt": "Say"}
    assert node.calls[0]["params"]["sampling"]["max_tokens"] == 2
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].logprobs) == \
        ("Hello", "length", None)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 2)
    assert r.model_extra["hearthnet"]["events"][0]["type"] == "shard_failover"
    stream = await client.completions.create(model="smollm2", prompt=["Say"], stream=True,
                                             stream_options={"include_usage": True})
    assert node.calls[1]["request"]["prompt"] == "Say"
    assert node.calls[1]["params"]["sampling"]["max_tokens"] == 16  # OpenAI's default
    chunks = [c async for c in stream]
    assert [c.choices[0].text for c in chunks if c.choices] == ["Hel", "lo", ""]
    assert {c.object for c in chunks} == {"text_completion"}
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7


async def test_text_completion_logprobs_in_the_legacy_shape(served):
    node, client = await served([*LP_TOKENS, DONE])
    r = await client.completions.create(model="smollm2", prompt="The capital", logprobs=2)
    assert node.calls[0]["params"]["sampling"]["logprobs"] == 2
    lp = r.choices[0].logprobs
    assert lp.tokens == [" Paris", "\\xc3"] and lp.token_logprobs == [-0.25, -3.5]
    assert lp.text_offset == [0, 6]
    # the alternatives, and the sampled token even when it is not among them
    assert lp.top_logprobs == [{" Paris": -0.25, " Lyon": -1.75},
                               {".": -0.5, "!": -1.0, "\\xc3": -3.5}]
    stream = await client.completions.create(model="smollm2", prompt="The capital",
                                             logprobs=2, stream=True)
    got = [c.choices[0].logprobs for c in [c async for c in stream]
           if c.choices and c.choices[0].logprobs]
    assert [x for g in got for x in g.tokens] == lp.tokens
    assert [x for g in got for x in g.text_offset] == lp.text_offset


TEXT = {"model": "m", "prompt": "hi"}
# (field, value, the param the 400 names)
TEXT_REFUSED = [
    ("prompt", [1, 2, 3], "prompt"), ("prompt", [[1, 2]], "prompt"),
    ("prompt", ["a", "b"], "prompt"), ("prompt", [], "prompt"), ("prompt", None, "prompt"),
    ("suffix", "end", "suffix"), ("echo", True, "echo"), ("best_of", 2, "best_of"),
    ("n", 2, "n"), ("logprobs", 6, "logprobs"), ("logprobs", True, "logprobs"),
    ("frequency_penalty", 1, "frequency_penalty"), ("logit_bias", {"1": 1}, "logit_bias"),
    ("messages", [{"role": "user", "content": "x"}], "messages"),
    ("max_completion_tokens", 4, "max_completion_tokens"), ("top_logprobs", 2, "top_logprobs"),
]


@pytest.mark.parametrize(("key", "value", "param"), TEXT_REFUSED,
                         ids=[f"{k}={json.dumps(v)[:24]}" for k, v, _ in TEXT_REFUSED])
def test_a_text_completion_field_not_honoured_is_refused_naming_it(key, value, param):
    with pytest.raises(BadRequest) as e:
        parse_completion_request({**TEXT, key: value}, LIM)
    assert e.value.details["param"] == param


def test_a_text_completion_s_off_values_are_the_plain_call():
    plain = parse_completion_request(TEXT, LIM)
    for key, value in (("suffix", ""), ("echo", False), ("best_of", 1), ("n", 1),
                       ("frequency_penalty", 0), ("logit_bias", {}), ("logprobs", None),
                       ("user", "alice"), ("prompt", ["hi"])):
        got = parse_completion_request({**TEXT, key: value}, LIM)
        assert got.args == plain.args and got.logprobs is None, key
    assert parse_completion_request({**TEXT, "logprobs": 0}, LIM).logprobs == 0


async def test_text_completion_refusals_reach_the_client_before_any_work(served):
    node, client = await served([tok("a", 0), DONE])
    for kw, param in (({"prompt": [1, 2, 3]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                      ({"prompt": "x", "echo": True}, "echo"),
                      ({"prompt": "x", "best_of": 3}, "best_of"),
                      ({"prompt": "x", "suffix": "y"}, "suffix"),
                      ({"prompt": "x", "logprobs": 6}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="smollm2", **kw)
        assert e.value.body["param"] == param and e.value.body["code"] == "bad_request"
    assert node.calls == []


def test_the_node_takes_exactly_one_of_messages_and_a_raw_prompt():
    from hearthnet.distributed_inference.orchestrator.request import (
        ChatRequest,
        DistributedChatParams,
    )

    text = parse_completion_request({**TEXT, "logprobs": 3}, LIM).args
    req = ChatRequest.from_dict(text["request"])
    assert (req.prompt, req.messages, req.model) == ("hi", [], "m")
    params = DistributedChatParams.from_dict(text["params"], DistributedChatParams())
    assert params.sampling.logprobs == 3
    chat = ChatRequest.from_dict(parse_chat_request(BASE, LIM).args["request"])
    assert chat.prompt is None and chat.messages == BASE["messages"]
    for bad in ({"model": "m"}, {"model": "m", "prompt": "x", "messages": BASE["messages"]},
                {"model": "m", "prompt": ["x"]}, {"model": "m", "prompt": 7}):
        with pytest.raises(BadRequest):
            ChatRequest.from_dict(bad)
    with pytest.raises(BadRequest, match="logprobs"):
        DistributedChatParams.from_dict({"sampling": {"logprobs": 21}}, DistributedChatParams())
