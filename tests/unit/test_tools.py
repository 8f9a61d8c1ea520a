"""OpenAI tools (M26 §5.4): templates that render tools, forced calls, parsing, the API's
``tool_calls``.

A tiny random-weight Qwen2 model with a Qwen2.5-style chat template (tools in a system
block, calls as ``<tool_call>{json}</tool_call>``, results as ``<tool_response>``): random
weights produce a valid call only when the grammar forces one — which is what is tested.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hearthnet.api.openai_compat import CompletionBuilder, Limits, parse_chat_request
from hearthnet.distributed_inference.engine.generation import Generation
from hearthnet.distributed_inference.engine.grammar import (
    HERMES,
    LLAMA_JSON,
    MISTRAL,
    Constraint,
    _compiled,
    parse_tool_calls,
    template_has_tools,
    tool_format,
)
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.local import LocalEngine
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.engine.speculation import LookupProposer, Speculator
from hearthnet.distributed_inference.orchestrator.request import (
    ChatRequest,
    DistributedChatParams,
)
from hearthnet.errors import BadRequest
from hearthnet.frames import from_wire

# Qwen2.5-Instruct's template, its tool parts as they are (SmolLM2's <|im_start|> tokens)
QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": \
<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) \
or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}\
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}\
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}\
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
TOOLS_ALIAS = "qwen-tools"
WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city", "parameters": WEATHER_ARGS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def tools_model(store: Any, root: Path, tokenizer_from: Path) -> Any:
    """The tiny Qwen2 with `QWEN_TOOLS_TEMPLATE`, in `store` (imported once per store)."""
    from hearthnet.models.importer import import_folder
    from tests.helpers.tiny_models import make_tiny_model

    found = store.find(TOOLS_ALIAS)
    if found is not None:
        return found
    src = make_tiny_model("qwen2", root / TOOLS_ALIAS, tokenizer_from, layers=2, seed=7)
    (src / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    return import_folder(store, src, alias=TOOLS_ALIAS)


def check_weather_args(args: dict[str, Any]) -> None:
    """`WEATHER`'s parameter schema, checked by hand (jsonschema is no dependency)."""
    assert set(args) == {"city", "days"}
    assert args["city"] in ("Paris", "Rome", "Oslo")
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7


@pytest.fixture(scope="module")
def tools_engine(tmp_path_factory, smollm2):
    """The tiny model in a store of its own: the suite's shared store (and every mesh
    that reads it) keeps only the models its tests expect."""
    from hearthnet.models import ModelStore

    root = tmp_path_factory.mktemp("tools")
    return LocalEngine(tools_model(ModelStore(root / "models"), root, smollm2.path))


def _bus(body: dict[str, Any]) -> tuple[ChatRequest, DistributedChatParams]:
    """An OpenAI body through the API's door and the node's (the bus arguments)."""
    args = parse_chat_request({"model": TOOLS_ALIAS, "messages": MSGS, **body},
                              Limits()).args
    return (ChatRequest.from_dict(args["request"]),
            DistributedChatParams.from_dict(args["params"], DistributedChatParams()))


def test_tool_support_is_read_from_the_template_s_variables(smollm2):
    smol = (smollm2.path / "chat_template.jinja").read_text()
    assert not template_has_tools(smol) and not template_has_tools(None)
    assert template_has_tools(QWEN_TOOLS_TEMPLATE)
    # "tools" only in the text, never read as a variable, is no tools support
    assert not template_has_tools("{{ messages[0].content }} tools here")
    assert tool_format(QWEN_TOOLS_TEMPLATE) == HERMES
    assert tool_format("{{ '[TOOL_CALLS]' }}{{ tools }}") == MISTRAL
    assert tool_format("{{ tools | tojson }}") == LLAMA_JSON


def test_tool_calls_parse_in_each_family_s_format():
    names = {"get_weather", "get_time"}
    hermes = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", ' \
             '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": ' \
             '{"zone": "UTC"}}\n</tool_call>'
    assert parse_tool_calls(hermes, names) == ("Sure.", [
        ("get_weather", '{"city": "Rome", "days": 2}'), ("get_time", '{"zone": "UTC"}')])
    llama = '{"name": "get_time", "parameters": {"zone": "CET"}}'
    assert parse_tool_calls(llama, names) == ("", [("get_time", '{"zone": "CET"}')])
    mistral = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    assert parse_tool_calls(mistral, names) == ("", [("get_time", '{"zone": "UTC"}')])
    for text in ("Paris is sunny.", '{"name": "rm_rf", "arguments": {}}',  # not a tool's
                 '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',
                 '<tool_call>\n{"name": "get_time"', '{"city": "Paris"}'):
        assert parse_tool_calls(text, names) is None, text


def test_a_template_without_tools_refuses_them_naming_tools(smollm2):
    head = LayeredHead(smollm2, lm_head=False)  # SmolLM2's template renders no tools
    req, _ = _bus({"tools": [WEATHER]})
    with pytest.raises(BadRequest) as e:
        head.chat_prompt_ids(req.messages)
    assert e.value.details["param"] == "tools"
    assert "chat template does not support tools" in e.value.message
    # tool_choice "none": no tools rendered, so the same prompt as without them
    req, _ = _bus({"tools": [WEATHER], "tool_choice": "none"})
    assert head.chat_prompt_ids(req.messages) == head.chat_prompt_ids(MSGS)


def test_tools_and_the_call_history_render_through_the_template(tools_engine):
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    req, _ = _bus({"tools": [WEATHER, TIME], "messages": history})
    ids = tools_engine.head.chat_prompt_ids(req.messages)
    text = tools_engine.head.tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' \
        in text  # the earlier call, its arguments a map again
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_required_tool_call_is_a_valid_call_and_speculation_stays_exact(tools_engine):
    """``tool_choice: "required"`` on random weights: one whole call of one of the tools,
    arguments matching its schema; a prompt-lookup speculator's proposals are verified
    against the same mask, so the answer is the same token for token. (A named function,
    streaming and not, through a node: tests/integration/test_tools_api.py.)"""
    req, params = _bus({"tools": [WEATHER, TIME], "tool_choice": "required",
                        "max_tokens": 64, "temperature": 0})
    gen = tools_engine.new_generation(req.messages, params.sampling)
    text = "".join(ev.text for ev in tools_engine.run(gen))
    assert gen.finish_reason == "stop", text  # the grammar completed the call
    content, calls = parse_tool_calls(text, {"get_weather", "get_time"}) or ("", [])
    assert content == "" and len(calls) == 1
    name, args = calls[0]
    if name == "get_weather":
        check_weather_args(json.loads(args))
    else:
        assert name == "get_time" and json.loads(args)["zone"] in ("UTC", "CET")
    spec = tools_engine.new_generation(req.messages, params.sampling)
    speculator = Speculator("lookup", LookupProposer())
    assert [e.token_id for e in tools_engine.run(spec, speculator=speculator)] == gen.tokens
    assert speculator.stats.passes > 0


def test_the_mask_only_removes_and_keeps_the_answer_in_the_grammar(tools_engine):
    """Random logits through a json_schema grammar: every pick is allowed, and where the
    unconstrained pick was allowed the constrained one is the same."""
    tok = tools_engine.head.tokenizer  # SmolLM2's
    c = Constraint.from_wire({"type": "json_schema", "schema": WEATHER_ARGS})
    gen = Generation(tok, [1], SamplingParams(max_tokens=30, grammar=c), {2})
    g = torch.Generator().manual_seed(0)
    same = 0
    while not gen.done:
        row = torch.randn(49152, generator=g)
        row[list(tok(' "Rome', add_special_tokens=False)["input_ids"])] += 6.0  # likelier
        masked = gen.sampler.masked(row)
        free = int(torch.argmax(row))
        ev = gen.step(row)
        assert torch.isfinite(masked[ev.token_id])  # the pick is allowed
        if torch.isfinite(masked[free]):
            assert ev.token_id == free
            same += 1
    assert same > 0 and gen.text.lstrip().startswith('{')
    # a repeated schema is not compiled again: the next answer starts from the cached one
    before = _compiled.cache_info()
    again = Generation(tok, [1], SamplingParams(max_tokens=30, grammar=Constraint.from_wire(
        {"type": "json_schema", "schema": json.loads(json.dumps(WEATHER_ARGS))})), {2})
    after = _compiled.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    assert again.sampler.grammar is not gen.sampler.grammar  # each answer its own state


def _frames(text: str, reason: str = "stop") -> list[Any]:
    toks = [from_wire({"type": "token_delta", "text": t, "token_id": i, "index": i})
            for i, t in enumerate([text[:5], text[5:11], text[11:]])]
    return [*toks, from_wire({"type": "done", "finish_reason": reason, "timings": {},
                              "pipeline": [],
                              "usage": {"prompt_tokens": 3, "completion_tokens": 3}})]


def test_the_api_answers_tool_calls_streaming_and_not():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    names = frozenset({"get_time"})
    out = CompletionBuilder("m", tools=names)
    for f in _frames(call):
        out.feed(f)
    msg = out.response()["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
    assert msg["message"]["tool_calls"][0]["function"] == {"name": "get_time",
                                                           "arguments": '{"zone": "UTC"}'}
    stream = CompletionBuilder("m", tools=names)
    chunks = [c for f in _frames(call) if (c := stream.feed(f)) is not None]
    assert chunks == []  # held: it is a call, not content
    deltas = [c["choices"][0]["delta"] for c in stream.pending_chunks()]
    assert len(deltas) == 1 and len(deltas[0]["tool_calls"]) == 1
    streamed = deltas[0]["tool_calls"][0]
    assert streamed["id"].startswith("call_") and streamed["index"] == 0
    assert {k: streamed[k] for k in ("type", "function")} == \
        {k: msg["message"]["tool_calls"][0][k] for k in ("type", "function")}
    assert stream.last_chunk()["choices"][0]["finish_reason"] == "tool_calls"
    # plain text with tools: streamed as content as it comes, finish_reason as it was
    plain = CompletionBuilder("m", tools=names)
    chunks = [c for f in _frames("Paris is sunny today.") if (c := plain.feed(f)) is not None]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == \
        "Paris is sunny today."
    assert plain.pending_chunks() == [] and plain.finish_reason == "stop"
    # a call cut by max_tokens is no call: its text, finish_reason "length"
    cut = CompletionBuilder("m", tools=names)
    for f in _frames(call[:30], "length"):
        cut.feed(f)
    assert cut.response()["choices"][0]["message"]["content"] == call[:30]
    assert cut.finish_reason == "length"


def test_a_constrained_answer_cut_by_max_tokens_ends_with_length(tools_engine):
    grammar = Constraint.from_wire({"type": "json_schema",
                                    "schema": TIME["function"]["parameters"]})
    cut = tools_engine.new_generation(MSGS, SamplingParams(max_tokens=3, grammar=grammar))
    list(tools_engine.run(cut))
    assert cut.finish_reason == "length" and cut.text.lstrip().startswith("{")
    assert len(cut.tokens) == 3
