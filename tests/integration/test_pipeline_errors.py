"""How a distributed chat ends when it fails before its first shard step (DESIGN.md Errors).

A tiny Llama with SmolLM2's tokenizer and a chat template that refuses a system message
and roles that do not alternate (`raise_exception`, as Gemma's, Llama-2's and Mistral's
templates do) and divides by zero on one trigger message (a broken template: a foreign
exception, not the caller's doing). The caller gets exactly one typed `error` frame —
`bad_request` naming the template's message for the refusal, on every path (mesh, local
engine, fallback to local, the bus, HTTP 400), `internal` without a traceback for the bug —
and the orchestrator then serves the next call as if nothing happened. The same weights
under a second alias with SmolLM2's template (``lenient``) take what ``refusing`` refuses.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from hearthnet.distributed_inference.engine.local import LocalEngine
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.errors import BadRequest
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from hearthnet.observability import Metrics
from tests.helpers.inprocess import InProcessMesh
from tests.helpers.tiny_models import make_tiny_model

REFUSING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"  # Llama-2's rule
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['content'] == 'divide by zero' %}{{ 1 // 0 }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER = {"role": "user", "content": "Name three colours."}
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
NOT_ALTERNATING = {
    "user-user": [USER, {"role": "user", "content": "And three more."}],
    "assistant-first": [{"role": "assistant", "content": "Hello."}, USER]}
MODEL_ID = "tiny/refusing"
N = 8


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory, smollm2: Any) -> Any:
    """The tiny model with `REFUSING_TEMPLATE`, imported into a store of its own, beside the
    same weights with SmolLM2's template (``lenient``)."""
    from hearthnet.models import ModelStore
    from hearthnet.models.importer import import_folder

    root: Path = tmp_path_factory.mktemp("refusing")
    src = make_tiny_model("llama", root / "src", smollm2.path, layers=2, seed=7)
    shutil.copytree(src, root / "lenient")
    (src / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    store = ModelStore(root / "models")
    import_folder(store, root / "lenient", alias="lenient", model_id=MODEL_ID)
    return store, import_folder(store, src, alias="refusing", model_id=MODEL_ID)


@pytest.fixture
def orchestrator(refusing: Any) -> Any:
    store, entry = refusing
    mesh = InProcessMesh(entry)
    mesh.add("node-b", 0, 1)
    m = Metrics()
    with ThreadPoolExecutor(1) as pool:
        yield PipelineOrchestrator(models=store, router=mesh.router(), health=mesh.health,
                                   metrics=m, connect=mesh.connect, executor=pool), m


async def _frames(orch: PipelineOrchestrator, messages: list[dict[str, str]],
                  model: str = "refusing", **params: Any) -> list[Any]:
    p = DistributedChatParams(sampling=SamplingParams(max_tokens=N), wire_dtype="fp32",
                              **params)
    return [f.to_wire() async for f in orch.chat(ChatRequest(model, messages), p)]


def _refused(frames: list[Any]) -> None:
    """Exactly one `bad_request` frame naming the template's rule."""
    assert [f["type"] for f in frames] == ["error"], frames
    assert frames[0]["code"] == "bad_request"
    assert ALTERNATE in frames[0]["message"]
    _no_traceback(frames[0]["message"])


def _no_traceback(message: str) -> None:
    assert "Traceback" not in message and "File \"" not in message, message


async def test_a_refusing_template_is_a_bad_request_then_the_next_call_is_served(
        orchestrator: Any, refusing: Any) -> None:
    orch, m = orchestrator
    frames = await _frames(orch, [{"role": "system", "content": "Be brief."}, USER])
    assert [f["type"] for f in frames] == ["error"], frames
    assert frames[0]["code"] == "bad_request"
    assert "System role not supported" in frames[0]["message"]
    _no_traceback(frames[0]["message"])
    assert m.chats_total.labels("error")._value.get() == 1

    # the same orchestrator answers the next call, token for token as the local engine
    frames = await _frames(orch, [USER])
    assert frames[-1]["type"] == "done", frames[-1]
    want = [e.token_id for e in LocalEngine(refusing[1]).generate(
        [USER], SamplingParams(max_tokens=N))]
    assert [f["token_id"] for f in frames if f["type"] == "token_delta"] == want
    assert m.chats_total.labels("ok")._value.get() == 1


async def test_a_bug_before_the_first_step_ends_the_call_as_internal(orchestrator: Any) -> None:
    """A foreign exception before the prompt is tokenised (a broken template) used to
    escape as `UnboundLocalError` from the catch-all's own log line."""
    orch, m = orchestrator
    with capture_logs() as logs:
        frames = await _frames(orch, [{"role": "user", "content": "divide by zero"}])
    assert [f["type"] for f in frames] == ["error"], frames
    assert frames[0]["code"] == "internal"
    assert "see its log" in frames[0]["message"]
    _no_traceback(frames[0]["message"])
    failed = [e for e in logs if e["event"] == "chat_failed"]
    assert len(failed) == 1 and failed[0]["tokens"] == 0 and failed[0]["exc_info"]
    assert m.chats_total.labels("error")._value.get() == 1

    frames = await _frames(orch, [USER])  # still serving
    assert frames[-1]["type"] == "done", frames[-1]
    assert sum(f["type"] == "token_delta" for f in frames) > 0


def test_the_local_engine_refuses_the_same_messages_as_a_bad_request(refusing: Any) -> None:
    engine = LocalEngine(refusing[1])
    with pytest.raises(BadRequest, match="System role not supported"):
        engine.new_generation([{"role": "system", "content": "Be brief."}, USER],
                              SamplingParams(max_tokens=N))


# ---- roles that do not alternate (Llama-2's, Mistral's and Gemma's rule) on every path ----

@pytest.mark.parametrize("messages", NOT_ALTERNATING.values(), ids=NOT_ALTERNATING.keys())
async def test_roles_that_do_not_alternate_are_a_bad_request_over_shards(
        orchestrator: Any, messages: list[dict[str, str]]) -> None:
    orch, _ = orchestrator
    _refused(await _frames(orch, messages))
    # the same weights with a template that takes them: its own head, an answer
    frames = await _frames(orch, messages, model="lenient")
    assert frames[-1]["type"] == "done", frames[-1]


async def test_the_fallback_to_local_refuses_them_the_same_way(refusing: Any) -> None:
    store, entry = refusing
    mesh = InProcessMesh(entry)  # no shard: every call falls back to the local engine
    with ThreadPoolExecutor(1) as pool:
        orch = PipelineOrchestrator(models=store, router=mesh.router(), health=mesh.health,
                                    metrics=Metrics(), connect=mesh.connect, executor=pool)
        _refused(await _frames(orch, NOT_ALTERNATING["user-user"], fallback_to_local=True))
        frames = await _frames(orch, [USER], fallback_to_local=True)
    assert frames[0]["type"] == "pipeline_aborted" and frames[0]["continuing"] == "local"
    assert frames[-1]["type"] == "done" and frames[-1]["pipeline"] == ["local"]


@pytest.mark.parametrize("messages", NOT_ALTERNATING.values(), ids=NOT_ALTERNATING.keys())
def test_the_local_engine_refuses_them_naming_the_rule(
        refusing: Any, messages: list[dict[str, str]]) -> None:
    with pytest.raises(BadRequest, match="Conversation roles must alternate"):
        LocalEngine(refusing[1]).new_generation(messages, SamplingParams(max_tokens=N))


@pytest.fixture(scope="module")
def node(refusing: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One node process hosting both layers (as its own shard), with the API listening:
    the bus and HTTP paths of a call. ``lenient`` shares its shards (the same weights)."""
    store, _ = refusing
    spec = NodeSpec("node-a", [(0, 1)], extra_di={"allow_self_as_shard": True})
    with LocalMesh([spec], root=tmp_path_factory.mktemp("refusing-mesh"), model="refusing",
                   models=store.root) as mesh:
        yield mesh.nodes["node-a"]


async def test_over_the_bus_the_refusal_is_a_bad_request_frame(node: Any) -> None:
    args = chat_args("", "refusing", SamplingParams(max_tokens=N))
    for messages in NOT_ALTERNATING.values():
        args["request"]["messages"] = messages
        _refused([f async for f in bus_call(node.uri, CHAT_CAPABILITY, args)])
    args["request"]["model"] = "lenient"  # the node keeps one head per alias
    frames = [f async for f in bus_call(node.uri, CHAT_CAPABILITY, args)]
    assert frames[-1]["type"] == "done", frames[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_over_http_the_refusal_is_a_400_naming_the_rule(node: Any, stream: bool) -> None:
    body = {"model": "refusing", "messages": NOT_ALTERNATING["assistant-first"],
            "max_tokens": N, "stream": stream}
    async with aiohttp.ClientSession() as http:
        async with http.post(node.api + "/v1/chat/completions", json=body) as r:
            assert r.status == 400, await r.text()
            err = (await r.json())["error"]
        assert err["code"] == "bad_request" and err["type"] == "invalid_request_error"
        assert ALTERNATE in err["message"]
        _no_traceback(err["message"])
        async with http.post(node.api + "/v1/chat/completions",
                             json={**body, "model": "lenient"}) as r:
            assert r.status == 200, await r.text()


def test_transformers_refusing_the_messages_is_a_bad_request_too(refusing: Any,
                                                                  monkeypatch: Any) -> None:
    """transformers checks messages before rendering (a ValueError): the caller's too."""
    from hearthnet.distributed_inference.engine.head import LayeredHead

    head = LayeredHead(refusing[1], lm_head=False)

    def refuse(*a: Any, **kw: Any) -> Any:
        raise ValueError("continue_final_message is set but the conversation is empty!")

    monkeypatch.setattr(head.tokenizer, "apply_chat_template", refuse)
    with pytest.raises(BadRequest, match="conversation is empty"):
        head.chat_prompt_ids([USER])
