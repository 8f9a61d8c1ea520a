"""OpenAI tools against a live node, with the official `openai` client (M26 §5.4).

A one-node mesh with a tiny random Qwen2 whose chat template renders tools
(tests/unit/test_tools.py), from a store of its own (the suite's shared store keeps only the
models its meshes expect). No shard hosts it, so the node runs the call on its local path
(the fallback, continuing the same generation); the mesh path of a constrained call is
test_api_mesh.py's ``response_format`` test. Random weights write a valid call only when
the grammar forces it.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from hearthnet.models import ModelStore
from tests.unit.test_tools import TOOLS_ALIAS, WEATHER, check_weather_args, tools_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tools_node(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("tools-mesh")
    tools_model(ModelStore(root / "models"), root, smollm2.path)
    (root / "mesh").mkdir()
    m = LocalMesh([NodeSpec("node-t")], root=root / "mesh", model=TOOLS_ALIAS,
                  models=root / "models")
    try:
        m.start(wait_cover=False)  # nothing to cover: no shard hosts the model
        yield m.nodes["node-t"]
    finally:
        m.stop()


@pytest.fixture
async def oai(tools_node):
    async with openai.AsyncOpenAI(base_url=tools_node.api + "/v1", api_key="local",
                                  max_retries=0, timeout=120) as c:
        yield c


async def test_a_forced_tool_call_comes_back_as_tool_calls(oai):
    """A named ``tool_choice``: ``tool_calls`` whose arguments match the function's schema,
    streaming and not; ``finish_reason`` ``tool_calls``."""
    kw: dict[str, Any] = dict(
        model=TOOLS_ALIAS, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=64, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = await oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    check_weather_args(json.loads(call.function.arguments))
    assert r.model_extra["hearthnet"]["fallback"] is True  # the node's local path
    stream = await oai.chat.completions.create(**kw, stream=True)
    chunks = [c async for c in stream]
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert deltas[0].function.arguments == call.function.arguments  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the call and its result, echoed back in the history, render through the template
    history = [*kw["messages"], choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = await oai.chat.completions.create(**{**kw, "messages": history,
                                                 "tool_choice": "auto", "max_tokens": 2})
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + 20  # the call and result
