"""Constrained decoding (M26 §5.4): OpenAI ``response_format`` checked at both doors, carried
over the bus, and enforced by the sampler's mask, which only removes tokens.

The mask itself (it only removes; a repeated schema is not compiled again), forced tool
calls, speculation's exactness under a grammar and ``length`` are in tests/unit/test_tools.py
(one tokenizer, compiled for llguidance once); SmolLM2's constrained answers, validated
against their schema, through a live mesh with the `openai` client in
tests/integration/test_api_mesh.py."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from hearthnet.api.openai_compat import Limits, parse_chat_request
from hearthnet.distributed_inference.engine.grammar import Constraint
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.request import (
    ChatRequest,
    DistributedChatParams,
)
from hearthnet.errors import BadRequest
from hearthnet.node.capabilities import chat_args

CITY = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lyon", "Marseille"]},
    "country": {"type": "string", "maxLength": 12},
    "capital": {"type": "boolean"}},
    "required": ["city", "country", "capital"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BASE = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


def _schema(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}


DOOR = [  # (fields, the param the 400 names)
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": _schema({"type": "nonsense"})}, "response_format.json_schema.schema"),
    ({"response_format": _schema({"$ref": "#/nowhere"})}, "response_format.json_schema.schema"),
    ({"response_format": _schema([1])}, "response_format.json_schema.schema"),
    ({"response_format": _schema({}, strict="yes")}, "response_format.json_schema.strict"),
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": TOOL["function"]}]}, "tools[0]"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "code": "x"}}]},
     "tools[0].function.code"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("fields", "param"), DOOR, ids=[p for _, p in DOOR])
def test_the_door_refuses_bad_schemas_tools_and_choices_naming_them(fields, param):
    with pytest.raises(BadRequest) as e:
        parse_chat_request({**BASE, **fields}, Limits())
    assert e.value.details["param"] == param, e.value.message


def test_the_node_checks_the_bus_arguments_again():
    defaults = DistributedChatParams()
    for grammar, param in (({"type": "regex"}, "params.sampling.grammar"),
                           ({"type": "json_schema", "schema": {"type": "nope"}},
                            "params.sampling.grammar.schema"),
                           ({"type": "tool_call", "tools": []}, "params.sampling.grammar")):
        with pytest.raises(BadRequest) as e:
            DistributedChatParams.from_dict({"sampling": {"grammar": grammar}}, defaults)
        assert e.value.details["param"] == param
    for request, param in (({**BASE, "tools": [{"type": "function"}]}, "request.tools[0]"),
                           ({"model": "m", "prompt": "x", "tools": [TOOL]}, "tools")):
        with pytest.raises(BadRequest) as e:
            ChatRequest.from_dict(request)
        assert e.value.details["param"] == param


def test_a_constraint_travels_over_the_bus_as_it_was_asked():
    parsed = parse_chat_request({**BASE, "response_format": _schema(CITY, strict=True),
                                 "tools": [TOOL]}, Limits())
    args = msgpack.unpackb(msgpack.packb(parsed.args))  # as the bus carries it
    params = DistributedChatParams.from_dict(args["params"], DistributedChatParams())
    want = Constraint.from_wire({"type": "json_schema", "schema": CITY})
    assert params.sampling.grammar == want and json.loads(want.schema) == CITY
    assert ChatRequest.from_dict(args["request"]).messages.tools == [TOOL]  # type: ignore
    # the host-app client's map is the same one
    built = chat_args(BASE["messages"], "smollm2", SamplingParams(grammar=want), tools=[TOOL])
    assert built["params"]["sampling"]["grammar"] == args["params"]["sampling"]["grammar"]
    assert built["request"]["tools"] == args["request"]["tools"]
    plain = parse_chat_request({**BASE, "response_format": {"type": "text"}}, Limits())
    assert "grammar" not in plain.args["params"]["sampling"]  # text asks for nothing
