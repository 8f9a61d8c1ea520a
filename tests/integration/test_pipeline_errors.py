"""How a distributed chat ends when it fails before its first shard step (DESIGN.md Errors).

A tiny Llama with SmolLM2's tokenizer and a chat template that refuses a system message
(`raise_exception`, as Gemma's and Mistral's templates do) and divides by zero on one
trigger message (a broken template: a foreign exception, not the caller's doing). The
caller gets exactly one typed `error` frame — `bad_request` naming the template's message
for the refusal, `internal` without a traceback for the bug — and the orchestrator then
serves the next call as if nothing happened.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hearthnet.distributed_inference.engine.local import LocalEngine
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.errors import BadRequest
from hearthnet.observability import Metrics
from tests.helpers.inprocess import InProcessMesh
from tests.helpers.tiny_models import make_tiny_model

REFUSING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if message['content'] == 'divide by zero' %}{{ 1 // 0 }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER = {"role": "user", "content": "Name three colours."}
N = 8


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory, smollm2: Any) -> Any:
    """The tiny model with `REFUSING_TEMPLATE`, imported into a store of its own."""
    from hearthnet.models import ModelStore
    from hearthnet.models.importer import import_folder

    root: Path = tmp_path_factory.mktemp("refusing")
    src = make_tiny_model("llama", root / "src", smollm2.path, layers=2, seed=7)
    (src / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    store = ModelStore(root / "models")
    return store, import_folder(store, src, alias="refusing")


@pytest.fixture
def orchestrator(refusing: Any) -> Any:
    store, entry = refusing
    mesh = InProcessMesh(entry)
    mesh.add("node-b", 0, 1)
    m = Metrics()
    with ThreadPoolExecutor(1) as pool:
        yield PipelineOrchestrator(models=store, router=mesh.router(), health=mesh.health,
                                   metrics=m, connect=mesh.connect, executor=pool), m


async def _frames(orch: PipelineOrchestrator, messages: list[dict[str, str]]) -> list[Any]:
    params = DistributedChatParams(sampling=SamplingParams(max_tokens=N), wire_dtype="fp32")
    return [f.to_wire() async for f in orch.chat(ChatRequest("refusing", messages), params)]


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
