"""OpenAI chat and text completions ↔ `experimental.distributed_llm.chat` (DESIGN.md decision 13).

Owns the translation only — no I/O: `parse_json_body` reads a body (its nesting bounded
before it is parsed), `parse_chat_request` and `parse_completion_request` turn an OpenAI
request body into the bus arguments of a chat call (every field's exact JSON type and bound
checked before any work, a wrong one a `bad_request` naming it; a field the server does not
act on, `UNHONOURED` / `UNHONOURED_TEXT`, is accepted only with a value that asks for
nothing), `CompletionBuilder` and `TextCompletionBuilder` turn the call's frames into
OpenAI chunks or one response (with log-probabilities in each endpoint's own shape when
asked), `model_object` / `find_model` give OpenAI's model objects, and `openai_error`
gives an error in OpenAI's shape with its HTTP status.

HearthNet's own facts (pipeline, failovers, fallback, per-shard timings and the
`shard_failover` / `pipeline_aborted` frames) ride in a ``hearthnet`` extension field of the
last chunk or of the response; standard clients ignore unknown fields.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hearthnet.distributed_inference.engine.grammar import (
    TOOL_CALL_STARTS,
    Constraint,
    check_schema,
    check_tool_choice,
    check_tools,
    parse_tool_calls,
    tool_constraint,
)
from hearthnet.distributed_inference.engine.sampling import MAX_LOGPROBS
from hearthnet.distributed_inference.orchestrator.params import check_params, unknown_keys
from hearthnet.errors import BadRequest
from hearthnet.frames import Done, ErrorFrame, StreamFrame, TokenDelta, is_incident

Json = dict[str, Any]  # an OpenAI-shaped object (a chunk, a response, an error body)

# M26 §6 error codes → (HTTP status, OpenAI error type)
_STATUS: dict[str, tuple[int, str]] = {
    "bad_request": (400, "invalid_request_error"),
    "invalid_request_error": (400, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "request_timeout": (408, "invalid_request_error"),
    "auth_failed": (401, "authentication_error"),
    "forbidden": (403, "permission_error"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "rate_limit_exceeded": (429, "rate_limit_error"),
    "shard_unavailable": (503, "service_unavailable"),
    "experimental_disabled": (503, "service_unavailable"),
    "pipeline_aborted": (503, "service_unavailable"),
    "pipeline_stalled": (504, "service_unavailable"),
    "stream_stalled": (504, "service_unavailable"),
    "connection_lost": (502, "service_unavailable"),
    "model_unusable": (503, "service_unavailable"),
    "weights_mismatch": (503, "service_unavailable"),
}
# a generation's done reason (engine/generation.py) → OpenAI's ``finish_reason``: the bus
# and the CLI say ``eos`` where OpenAI's vocabulary has only ``stop``; a reason a newer node
# adds reads as ``stop`` (the answer ended and is whole) rather than breaking a client
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def status_of(code: str) -> int:
    """The HTTP status of a HearthNet / API error code (500 for anything unknown)."""
    return _STATUS.get(code, (500, "server_error"))[0]


def openai_error(code: str, message: str, *, param: str | None = None) -> tuple[int, Json]:
    """(HTTP status, body) of an error in OpenAI's shape."""
    status, kind = _STATUS.get(code, (500, "server_error"))
    return status, {"error": {"message": message, "type": kind, "param": param,
                              "code": code}}


@dataclass(frozen=True)
class Limits:
    """Bounds checked before any work (``[api]``)."""

    max_messages: int = 64
    max_tokens: int = 2048
    default_max_tokens: int = 256
    # a chat body nests 5 deep (body, messages, message, content parts, part); the bound
    # stops a deeply nested body before the parser recurses (RecursionError, a 500)
    max_json_depth: int = 32


@dataclass(frozen=True)
class ParsedChat:
    """A validated OpenAI chat or text-completion request."""

    model: str
    stream: bool
    include_usage: bool
    args: dict[str, Any]  # bus arguments of experimental.distributed_llm.chat
    logprobs: int | None = None  # the top alternatives asked per token; None: none at all
    # the functions whose calls the answer's text may hold (OpenAI ``tool_calls``); None:
    # no tools rendered (``tool_choice`` "none", or none given); `parallel`: more than one
    tools: frozenset[str] | None = None
    parallel_tools: bool = True


# a JSON string, or an unterminated one to the end (so that no quote is scanned twice)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN_CLOSE = bytes.maketrans(b"[]{}", b"()()")


def json_depth_within(raw: bytes, limit: int) -> bool:
    """Whether `raw`'s arrays and objects nest at most `limit` deep (and balance).

    Without a Python loop over the body: strings are cut out, every other byte but the
    brackets dropped, and each pass of ``replace(b"()", b"")`` removes exactly the
    innermost level (the leaves of the nesting tree), so a balanced body is empty after
    as many passes as it is deep. A run of ``limit + 1`` openers, or a pass that removes
    nothing (unbalanced), ends it early.
    """
    brackets = _JSON_STRING.sub(b"", raw).translate(_OPEN_CLOSE, _NOT_BRACKET)
    too_deep = b"(" * (limit + 1)
    for _ in range(limit):
        if not brackets:
            return True
        if too_deep in brackets:
            return False
        inner = brackets.replace(b"()", b"")
        if len(inner) == len(brackets):
            return False
        brackets = inner
    return not brackets


def parse_json_body(raw: bytes, limits: Limits) -> Any:
    """A request body as JSON; raises `BadRequest` for one that is not JSON or that nests
    deeper than ``limits.max_json_depth``, before the parser recurses into it."""
    if not json_depth_within(raw, limits.max_json_depth):
        raise BadRequest(f"the body is not JSON nested at most {limits.max_json_depth} deep")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from e


def _no_constant(name: str) -> Any:
    """Python's parser takes NaN and Infinity; JSON has no such numbers (RFC 8259 §6)."""
    raise ValueError(f"{name} is not a JSON number")


def _text(content: Any, i: int) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                 param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                     param=f"messages[{i}].content")


# what an OpenAI message may carry besides role and content: a client echoes an earlier
# answer back with these set to null (the `openai` package's model_dump); `tool_calls` (an
# assistant's) and `tool_call_id` (a tool result's) are rendered by the chat template, any
# other set one is refused, since the template is given nothing else
_MESSAGE_EXTRAS = frozenset({"name", "refusal", "annotations", "audio", "function_call",
                             "tool_calls", "tool_call_id"})


def _message_extras(m: dict[Any, Any], i: int) -> None:
    for k, v in m.items():
        if k in ("role", "content") or (k == "tool_calls" and m["role"] == "assistant") \
                or (k == "tool_call_id" and m["role"] == "tool"):
            continue
        name = f"messages[{i}].{str(k)[:64]}"
        if k not in _MESSAGE_EXTRAS:
            raise BadRequest(f"{name} is not a field of an OpenAI message; it is refused "
                             "rather than ignored", param=name)
        if v not in (None, "", []):
            raise BadRequest(f"{name} is not supported: the model's chat template is given "
                             "each message's role, content, an assistant's tool_calls and "
                             "a tool result's tool_call_id only; leave it out", param=name)


def _tool_calls(raw: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as the templates read them: each
    call's ``arguments`` (a JSON string) as a map."""
    name = f"messages[{i}].tool_calls"
    if not isinstance(raw, list) or len(raw) > 128:
        raise BadRequest(f"{name} must be an array of calls", param=name)
    out = []
    for j, c in enumerate(raw):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and c.get("type", "function") == "function"
                and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise BadRequest(f"{name}[{j}] must be {{\"type\": \"function\", \"function\": "
                             "{\"name\", \"arguments\": a JSON string}}", param=name)
        try:
            args = json.loads(f["arguments"], parse_constant=_no_constant)
        except ValueError as e:
            raise BadRequest(f"{name}[{j}].function.arguments is not JSON: {e}",
                             param=name) from e
        if not isinstance(args, dict):
            raise BadRequest(f"{name}[{j}].function.arguments must be a JSON object",
                             param=name)
        call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _messages(raw: Any, limits: Limits) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty array", param="messages")
    if len(raw) > limits.max_messages:
        raise BadRequest(f"{len(raw)} messages; this server takes at most "
                         f"{limits.max_messages}", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or m["role"] not in _ROLES:
            raise BadRequest(f"messages[{i}] needs a role in {sorted(_ROLES)}",
                             param=f"messages[{i}].role")
        _message_extras(m, i)
        role = "system" if m["role"] == "developer" else str(m["role"])
        calls = m.get("tool_calls") if role == "assistant" else None
        # an assistant's turn that only called tools has null content (OpenAI's shape)
        content = "" if calls and m.get("content") is None else _text(m.get("content"), i)
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = _tool_calls(calls, i)
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"][:256]
        out.append(msg)
    return out


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be a number in {lo}..{hi}", param=key)
    return float(v)


def _max_tokens(body: dict[str, Any], limits: Limits, default: int | None = None) -> int:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    v = body.get(key)
    if v is None:
        return min(default or limits.default_max_tokens, limits.max_tokens)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limits.max_tokens:
        raise BadRequest(f"{key} must be an integer in 1..{limits.max_tokens}", param=key)
    return v


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > 4 or \
            not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a string or up to 4 non-empty strings", param="stop")
    return list(stops)


def _seed(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
        raise BadRequest("seed must be an integer in 0..2**63-1", param="seed")
    return v


def _flag(body: dict[str, Any], key: str, name: str | None = None) -> bool:
    """A ``true``/``false`` field (``null`` or absent: false); never a truthy string."""
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{name or key} must be true or false", param=name or key)
    return v


def _extension(v: Any) -> dict[str, Any]:
    """The request's own ``hearthnet`` field: wire_dtype, fallback_to_local, timeout_s,
    max_shards, weights (the shard formats the call accepts, DESIGN.md decision 10),
    speculate (lookup | draft | off, DESIGN.md decision 16), each of the spec's JSON type and
    range (`params.CALL_PARAMS`)."""
    if v is None:
        return {}
    allowed = {"wire_dtype", "fallback_to_local", "timeout_s", "max_shards", "weights",
               "speculate"}
    if not isinstance(v, dict) or unknown_keys(v, allowed):
        raise BadRequest(f"hearthnet must be an object with keys from {sorted(allowed)}",
                         param="hearthnet")
    return check_params(v, prefix="hearthnet.")


def _zero(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == 0


def _never(v: Any) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Unhonoured:
    """An OpenAI field this server does not act on: only the values in `off` (and null)
    ask for nothing, so only they are accepted; any other is refused before any work."""

    off: Callable[[Any], bool]
    accepted: str  # the values `off` takes, for the message
    why: str  # what the server does not do


_NO_PENALTY = "the sampler applies no frequency or presence penalty"
_LEGACY = "the deprecated functions / function_call are not supported: send tools and " \
          "tool_choice"

# Nothing accepted and ignored: each OpenAI chat-completions field the server does not
# honour, with the values that leave the answer as it is without the field
UNHONOURED: dict[str, Unhonoured] = {
    "n": Unhonoured(lambda v: v == 1 and isinstance(v, int) and not isinstance(v, bool),
                    "1", "a call samples one choice"),
    "frequency_penalty": Unhonoured(_zero, "0", _NO_PENALTY),
    "presence_penalty": Unhonoured(_zero, "0", _NO_PENALTY),
    "logit_bias": Unhonoured(lambda v: v == {}, "{}", "the sampler applies no logit bias"),
    # checked after `functions`: with none, "auto" and "none" both call none
    "functions": Unhonoured(lambda v: v == [], "[]", _LEGACY),
    "function_call": Unhonoured(lambda v: v in ("none", "auto"), '"none" or "auto"', _LEGACY),
    "modalities": Unhonoured(lambda v: v == ["text"], '["text"]', "only text is produced"),
    "audio": Unhonoured(_never, "null", "only text is produced"),
    "prediction": Unhonoured(_never, "null", "predicted outputs are not used"),
    "reasoning_effort": Unhonoured(_never, "null", "the models have no reasoning-effort control"),
    "verbosity": Unhonoured(_never, "null", "the models have no verbosity control"),
    "web_search_options": Unhonoured(_never, "null", "there is no web search"),
    "store": Unhonoured(lambda v: v is False, "false", "answers are not stored"),
    "metadata": Unhonoured(lambda v: v == {}, "{}",
                           "metadata labels a stored answer, and none is stored"),
    "service_tier": Unhonoured(lambda v: v in ("auto", "default"), '"auto" or "default"',
                               "there is one processing tier"),
}
# fields acted on (the answer follows them), and fields that only name the caller or a
# cache to OpenAI (abuse monitoring, prompt caching) and change nothing in an answer
HONOURED = frozenset({"model", "messages", "stream", "stream_options", "max_tokens",
                      "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                      "logprobs", "top_logprobs", "hearthnet", "response_format", "tools",
                      "tool_choice", "parallel_tool_calls"})
IDENTIFIERS = frozenset({"user", "safety_identifier", "prompt_cache_key"})

# the same for the legacy text completions (``POST /v1/completions``)
UNHONOURED_TEXT: dict[str, Unhonoured] = {
    "n": UNHONOURED["n"],
    "best_of": Unhonoured(lambda v: v == 1 and isinstance(v, int) and not isinstance(v, bool),
                          "1", "a call samples one completion"),
    "echo": Unhonoured(lambda v: v is False, "false",
                       "the prompt is not echoed (nor its tokens' log-probabilities)"),
    "suffix": Unhonoured(lambda v: v == "", '""', "there is no fill-in-the-middle: the "
                         "prompt is continued as it is"),
    "frequency_penalty": UNHONOURED["frequency_penalty"],
    "presence_penalty": UNHONOURED["presence_penalty"],
    "logit_bias": UNHONOURED["logit_bias"],
}
HONOURED_TEXT = frozenset({"model", "prompt", "stream", "stream_options", "max_tokens",
                           "temperature", "top_p", "seed", "stop", "logprobs", "hearthnet"})
IDENTIFIERS_TEXT = frozenset({"user"})
MAX_TEXT_LOGPROBS = 5  # OpenAI's bound on a text completion's ``logprobs``
TEXT_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for a text completion


def _refuse_unhonoured(body: dict[str, Any], endpoint: str = "chat-completions",
                       honoured: frozenset[str] = HONOURED,
                       unhonoured: dict[str, Unhonoured] | None = None,
                       identifiers: frozenset[str] = IDENTIFIERS) -> None:
    """A `BadRequest` naming the first field of `body` that asks for something this server
    does not do (DESIGN.md decision 13: an OpenAI client must not get a plain answer to a
    request for JSON or tools and take it for what it asked)."""
    unhonoured = UNHONOURED if unhonoured is None else unhonoured
    for key in body:
        if key not in honoured and key not in identifiers and key not in unhonoured:
            name = str(key)[:64]
            raise BadRequest(f"{name} is not a {endpoint} parameter this server "
                             "knows; it is refused rather than ignored (see docs/api.md)",
                             param=name)
    for key, rule in unhonoured.items():
        v = body.get(key)
        if v is not None and not rule.off(v):
            shown = json.dumps(v)[:80]
            raise BadRequest(f"{key} = {shown} is not supported: {rule.why}; leave it out "
                             f"or send {rule.accepted}", param=key)
    for key in identifiers:
        v = body.get(key)
        if v is not None and not (isinstance(v, str) and len(v) <= 512):
            raise BadRequest(f"{key} must be a string of at most 512 characters", param=key)


def _stream_options(v: Any) -> bool:
    """``stream_options``: ``include_usage`` honoured; ``include_obfuscation`` (random
    padding against length side channels) only off."""
    if v is None:
        return False
    if not isinstance(v, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    extra = unknown_keys(v, {"include_usage", "include_obfuscation"})
    if extra:
        raise BadRequest(f"stream_options.{extra[0]} is not supported; known: include_usage",
                         param=f"stream_options.{extra[0]}")
    if _flag(v, "include_obfuscation", "stream_options.include_obfuscation"):
        raise BadRequest("stream_options.include_obfuscation = true is not supported: "
                         "chunks carry no padding; leave it out or send false",
                         param="stream_options.include_obfuscation")
    return _flag(v, "include_usage", "stream_options.include_usage")


def _int_in(body: dict[str, Any], key: str, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise BadRequest(f"{key} must be an integer in 0..{hi}", param=key)
    return v


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs: true`` with ``top_logprobs`` alternatives (0..20) per token; None when
    off. A non-zero ``top_logprobs`` without ``logprobs: true`` is refused, as OpenAI does."""
    top = _int_in(body, "top_logprobs", MAX_LOGPROBS)
    if _flag(body, "logprobs"):
        return top or 0
    if top:
        raise BadRequest("top_logprobs must be 0 or null unless logprobs is true",
                         param="top_logprobs")
    return None


def _model(body: Any) -> str:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise BadRequest("model must be a model name (see GET /v1/models)", param="model")
    return model


def _sampling(body: dict[str, Any], limits: Limits, logprobs: int | None,
              default_max_tokens: int | None = None) -> dict[str, Any]:
    """The call's ``params.sampling`` (``logprobs`` only when asked: the plain call's map
    is the one without it)."""
    sampling = {"max_tokens": _max_tokens(body, limits, default_max_tokens),
                "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
                "top_p": _number(body, "top_p", 1.0, 1e-9, 1.0),
                "seed": _seed(body.get("seed")), "stop": _stop(body.get("stop"))}
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    return sampling


def _response_format(v: Any) -> Constraint | None:
    """OpenAI ``response_format``: ``text`` (None), ``json_object`` or ``json_schema``
    (``{"name", "schema", "strict"?, "description"?}``), the schema compiled here to refuse a
    bad one before any work (M26 §5.4)."""
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest('response_format must be {"type": "text" | "json_object" | '
                         '"json_schema", ...}', param="response_format")
    extra = sorted(str(k)[:64] for k in v if k not in ("type", "json_schema"))
    if extra or (v["type"] != "json_schema" and "json_schema" in v):
        raise BadRequest(f"response_format: unexpected {(extra or ['json_schema'])[0]}",
                         param="response_format")
    if v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return Constraint.from_wire({"type": "json_object"}, "response_format")
    js = v.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or \
            set(js) - {"name", "schema", "strict", "description"}:
        raise BadRequest(f'{where} must be {{"name", "schema", "strict"?, "description"?}}',
                         param=where)
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise BadRequest(f"{where}.strict must be true or false", param=f"{where}.strict")
    # strict or not, the schema is enforced: a grammar matches it or it is refused
    schema = check_schema(js.get("schema", {"type": "object"}), f"{where}.schema")
    return Constraint.from_wire({"type": "json_schema", "schema": schema}, where)


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(the tools the template renders, None for none; the forced function's name,
    ``"required"``, or None when the model may answer in text)."""
    # no tools (null or [], as a client that has none sends) render nothing
    tools = check_tools(body["tools"]) if body.get("tools") not in (None, []) else None
    choice = check_tool_choice(body.get("tool_choice"), tools)
    if not tools or choice == "none":
        return None, None
    return tools, None if choice in (None, "auto") else choice


def parse_chat_request(body: Any, limits: Limits) -> ParsedChat:
    """Validate an OpenAI chat-completions body; raises `BadRequest` (with ``param``)."""
    model = _model(body)
    _refuse_unhonoured(body)
    stream = _flag(body, "stream")
    include_usage = _stream_options(body.get("stream_options"))
    logprobs = _chat_logprobs(body)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be true or false",
                         param="parallel_tool_calls")
    grammar = _response_format(body.get("response_format"))
    tools, forced = _tools(body)
    if forced is not None and tools is not None:
        if grammar is not None:
            raise BadRequest("response_format and a forced tool_choice both constrain the "
                             "answer; send one of them", param="response_format")
        grammar = tool_constraint(tools, forced)
    request: dict[str, Any] = {"model": model,
                               "messages": _messages(body.get("messages"), limits)}
    if tools is not None:
        request["tools"] = tools
    sampling = _sampling(body, limits, logprobs)
    if grammar is not None:
        sampling["grammar"] = grammar.to_wire()
    args = {"request": request,
            "params": {"sampling": sampling, **_extension(body.get("hearthnet"))}}
    names = None if tools is None else frozenset(t["function"]["name"] for t in tools)
    return ParsedChat(model, stream, include_usage, args, logprobs, names,
                      parallel is not False)


def _prompt(v: Any) -> str:
    """A text completion's one prompt: a string, or a list of one string."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        return v[0]
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        raise BadRequest(f"prompt holds {len(v)} prompts; this server completes one prompt "
                         "per call: send one string", param="prompt")
    if isinstance(v, list) and v and not isinstance(v[0], str):
        raise BadRequest("prompt as token ids is not supported: send the text (the node "
                         "tokenises it with the model's own tokenizer)", param="prompt")
    raise BadRequest("prompt must be a string (or a list of one string)", param="prompt")


def parse_completion_request(body: Any, limits: Limits) -> ParsedChat:
    """Validate an OpenAI text-completions body (``POST /v1/completions``): the raw prompt
    is continued as it is, without the chat template; raises `BadRequest` (with
    ``param``)."""
    model = _model(body)
    _refuse_unhonoured(body, "completions", HONOURED_TEXT, UNHONOURED_TEXT, IDENTIFIERS_TEXT)
    stream = _flag(body, "stream")
    include_usage = _stream_options(body.get("stream_options"))
    logprobs = _int_in(body, "logprobs", MAX_TEXT_LOGPROBS)
    args = {"request": {"model": model, "prompt": _prompt(body.get("prompt"))},
            "params": {"sampling": _sampling(body, limits, logprobs, TEXT_DEFAULT_MAX_TOKENS),
                       **_extension(body.get("hearthnet"))}}
    return ParsedChat(model, stream, include_usage, args, logprobs)


def model_object(m: dict[str, Any]) -> Json:
    """OpenAI's model object of one entry of the node's status ``models`` (its alias is
    the id a call names), with the layer coverage in the ``hearthnet`` field."""
    return {"id": m["alias"], "object": "model", "created": 0, "owned_by": "hearthnet",
            "hearthnet": {k: m[k] for k in ("model_id", "num_layers", "fully_covered",
                                            "uncovered", "coverage") if k in m}}


def find_model(models: list[dict[str, Any]], name: str) -> Json | None:
    """The model object of `name` among the status ``models``, by alias, model id or
    weights hash (the names a chat call takes, `ModelStore.get`); None for an unknown one."""
    for m in models:
        if name in (m.get("alias"), m.get("model_id"), m.get("weights_sha256")):
            return model_object(m)
    return None


def token_text(b: bytes) -> str:
    """A token's text as OpenAI shows it: its bytes as UTF-8, a byte that is part of a
    character as ``\\xNN`` (the exact bytes are in ``bytes``)."""
    return b.decode("utf-8", "backslashreplace")


@dataclass
class _Builder:
    """What both endpoints collect of one call's frames: text, log-probabilities,
    incidents, the ending."""

    model: str
    logprobs: int | None = None  # as asked (`ParsedChat.logprobs`)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    tokens: list[TokenDelta] = field(default_factory=list)  # kept when logprobs are asked
    events: list[Json] = field(default_factory=list)  # the incidents, as their wire maps
    done: Done | None = None

    def first_chunk(self) -> Json | None:
        return None

    def _token_chunk(self, frame: TokenDelta) -> Json | None:
        raise NotImplementedError

    def feed(self, frame: StreamFrame) -> Json | None:
        """Take one frame; returns the chunk to stream for it, if any.

        Raises:
            HearthNetError: the frame is an ``error`` frame (its code's class).
        """
        if isinstance(frame, TokenDelta):
            self.text.append(frame.text)
            if self.logprobs is not None:
                self.tokens.append(frame)
            return self._token_chunk(frame)
        if is_incident(frame):
            self.events.append(frame.to_wire())
        elif isinstance(frame, Done):
            self.done = frame
        elif isinstance(frame, ErrorFrame):
            raise frame.exception()
        return None

    @property
    def finish_reason(self) -> str:
        reason = self.done.finish_reason if self.done is not None else None
        return FINISH_REASONS.get(str(reason), "stop")

    def usage(self) -> dict[str, Any]:
        u = self.done.usage if self.done is not None else {}
        p, c = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
        out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c,
                               "total_tokens": p + c}
        if u.get("cached_prompt_tokens"):  # OpenAI's name for prompt tokens not computed again
            out["prompt_tokens_details"] = {"cached_tokens": int(u["cached_prompt_tokens"])}
        return out

    def extension(self) -> dict[str, Any]:
        """HearthNet's facts of the call (the ``hearthnet`` field)."""
        d = self.done
        if d is None:
            return {"pipeline": [], "failovers": 0, "fallback": False, "timings": {},
                    "formats": {}, "speculative": None, "events": self.events}
        # the formats that served the call, and whether all were lossless: a compact
        # format's answer must never read as an exact one (DESIGN.md decision 10)
        return {"pipeline": list(d.pipeline), "failovers": d.failovers or 0,
                "fallback": d.fallback, "timings": d.timings, "formats": d.formats or {},
                "speculative": d.speculative, "events": self.events}

    def pending_chunks(self) -> list[Json]:
        """Chunks held back while streaming, sent before `last_chunk`."""
        return []

    def usage_chunk(self) -> Json:
        """The ``stream_options.include_usage`` chunk: no choices, the usage."""
        raise NotImplementedError

    def last_chunk(self) -> Json:
        raise NotImplementedError

    def response(self) -> Json:
        raise NotImplementedError


def _chat_logprob(b: bytes, logprob: float) -> Json:
    return {"token": token_text(b), "logprob": logprob, "bytes": list(b)}


def chat_logprobs(frames: list[TokenDelta]) -> Json:
    """OpenAI chat's ``choices[].logprobs`` of these tokens: one ``content`` entry each, its
    ``top_logprobs`` likeliest first."""
    content = []
    for f in frames:
        if f.logprob is None or f.token_bytes is None:
            continue  # a frame without them (none is sent so by this version's nodes)
        content.append({**_chat_logprob(f.token_bytes, f.logprob),
                        "top_logprobs": [_chat_logprob(b, lp)
                                         for _, lp, b in f.top_logprobs or ()]})
    return {"content": content, "refusal": None}


@dataclass
class CompletionBuilder(_Builder):
    """One chat call: OpenAI ``chat.completion.chunk``s while streaming, or one
    ``chat.completion``.

    With tools (`tools`, the functions' names) the model's text may hold tool calls, in its
    template's format (`grammar.parse_tool_calls`): text that may be the start of one is held
    back from the stream until it is whole, then sent as ``tool_calls`` deltas (or, when it
    is not a call after all, as content); ``finish_reason`` is ``tool_calls`` then.
    """

    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    tools: frozenset[str] | None = None
    parallel_tools: bool = True  # False: only the first call is returned
    _held: str = ""  # text not streamed yet: it may be (the start of) a tool call
    _held_frames: list[TokenDelta] = field(default_factory=list)
    _streamed: bool = False  # some content went out: only a <tool_call> tag opens a call
    _calls: tuple[str, list[tuple[str, str]]] | None = None

    def _chunk(self, delta: dict[str, Any], finish: str | None = None,
               logprobs: Json | None = None) -> Json:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish}]}

    def first_chunk(self) -> Json:
        return self._chunk({"role": "assistant", "content": ""})

    def _token_chunk(self, frame: TokenDelta) -> Json | None:
        if self.tools is None:
            lp = chat_logprobs([frame]) if self.logprobs is not None else None
            return self._chunk({"content": frame.text}, logprobs=lp)
        self._held += frame.text
        self._held_frames.append(frame)
        cut = self._releasable()
        if cut == 0:
            return None
        text, self._held = self._held[:cut], self._held[cut:]
        frames, self._held_frames = self._held_frames, []
        self._streamed = True
        lp = chat_logprobs(frames) if self.logprobs is not None else None
        return self._chunk({"content": text}, logprobs=lp)

    def _releasable(self) -> int:
        """How much of the held text is surely content (not a tool call's)."""
        held = self._held
        lead = held.lstrip()
        if not self._streamed and (not lead or any(
                st.startswith(lead) or lead.startswith(st) for st in TOOL_CALL_STARTS)):
            return 0  # a bare-JSON or [TOOL_CALLS] call is the whole answer
        at = held.find("<tool_call>")
        if at >= 0:
            return at
        tag = "<tool_call>"
        part = max((k for k in range(1, len(tag)) if held.endswith(tag[:k])), default=0)
        return len(held) - part

    def calls(self) -> tuple[str, list[tuple[str, str]]] | None:
        """(content besides the calls, [(name, arguments JSON)]) of the answer's held
        text, or None when it holds no tool call."""
        if self.tools is None or self.done is None:
            return None
        if self._calls is None:
            self._calls = parse_tool_calls(self._held, self.tools)
            if self._calls is not None and not self.parallel_tools:
                self._calls = (self._calls[0], self._calls[1][:1])
        return self._calls

    @property
    def finish_reason(self) -> str:
        reason = super().finish_reason
        return "tool_calls" if reason == "stop" and self.calls() is not None else reason

    def _openai_calls(self, calls: list[tuple[str, str]]) -> list[Json]:
        return [{"id": f"call_{self.id[-12:]}_{i}", "type": "function",
                 "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(calls)]

    def pending_chunks(self) -> list[Json]:
        """At the end of a stream, the held text: ``tool_calls`` deltas, or content."""
        if self.tools is None or not self._held:
            return []
        lp = chat_logprobs(self._held_frames) if self.logprobs is not None else None
        found = self.calls()
        if found is None:
            return [self._chunk({"content": self._held}, logprobs=lp)]
        content, calls = found
        out = [self._chunk({"content": content})] if content else []
        for i, call in enumerate(self._openai_calls(calls)):
            out.append(self._chunk({"tool_calls": [{"index": i, **call}]},
                                   logprobs=lp if i == 0 else None))
        return out

    def last_chunk(self) -> Json:
        chunk = self._chunk({}, self.finish_reason)
        chunk["hearthnet"] = self.extension()
        return chunk

    def usage_chunk(self) -> Json:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": [],
                "usage": self.usage()}

    def response(self) -> Json:
        """The non-streaming ``chat.completion`` object."""
        lp = chat_logprobs(self.tokens) if self.logprobs is not None else None
        message: Json = {"role": "assistant", "content": "".join(self.text), "refusal": None}
        if self.tools is not None:
            self._held, self._calls = message["content"], None
            found = self.calls()
            if found is not None:
                message["content"] = found[0] or None
                message["tool_calls"] = self._openai_calls(found[1])
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "logprobs": lp, "finish_reason": self.finish_reason,
                             "message": message}],
                "usage": self.usage(), "hearthnet": self.extension()}


def text_logprobs(frames: list[TokenDelta], offset: int = 0) -> Json:
    """A text completion's legacy ``choices[].logprobs`` of these tokens: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (a map of token text to log-probability: the
    alternatives and the sampled token, so up to ``logprobs`` + 1 entries, as OpenAI) and
    ``text_offset`` (each token's character offset in the completion, from `offset`)."""
    out: Json = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for f in frames:
        if f.logprob is None or f.token_bytes is None:
            continue
        tok = token_text(f.token_bytes)
        top = {token_text(b): lp for _, lp, b in f.top_logprobs or ()}
        top.setdefault(tok, f.logprob)
        out["tokens"].append(tok)
        out["token_logprobs"].append(f.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


@dataclass
class TextCompletionBuilder(_Builder):
    """One text completion: OpenAI ``text_completion`` chunks while streaming, or one
    ``text_completion`` object."""

    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))
    _offset: int = 0  # the streamed tokens' text so far (``text_offset``)

    def _chunk(self, text: str, finish: str | None = None,
               logprobs: Json | None = None) -> Json:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"text": text, "index": 0, "logprobs": logprobs,
                             "finish_reason": finish}]}

    def _token_chunk(self, frame: TokenDelta) -> Json:
        if self.logprobs is None:
            return self._chunk(frame.text)
        lp = text_logprobs([frame], self._offset)
        self._offset += sum(len(t) for t in lp["tokens"])
        return self._chunk(frame.text, logprobs=lp)

    def last_chunk(self) -> Json:
        chunk = self._chunk("", self.finish_reason)
        chunk["hearthnet"] = self.extension()
        return chunk

    def usage_chunk(self) -> Json:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": [],
                "usage": self.usage()}

    def response(self) -> Json:
        """The non-streaming ``text_completion`` object."""
        lp = text_logprobs(self.tokens) if self.logprobs is not None else None
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"text": "".join(self.text), "index": 0, "logprobs": lp,
                             "finish_reason": self.finish_reason}],
                "usage": self.usage(), "hearthnet": self.extension()}
