"""OpenAI chat-completions shapes ↔ `experimental.distributed_llm.chat` (DESIGN.md decision 13).

Owns the translation only — no I/O: `parse_json_body` reads a body (its nesting bounded
before it is parsed), `parse_chat_request` turns an OpenAI request body into the bus
arguments of a chat call (every field's exact JSON type and bound checked before any work,
a wrong one a `bad_request` naming it), `CompletionBuilder` turns the call's frames into
OpenAI chunks or one response, and `openai_error` gives an error in OpenAI's shape with its
HTTP status.

HearthNet's own facts (pipeline, failovers, fallback, per-shard timings and the
`shard_failover` / `pipeline_aborted` frames) ride in a ``hearthnet`` extension field of the
last chunk or of the response; standard clients ignore unknown fields.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

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
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
_ROLES = {"system", "developer", "user", "assistant"}


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
    """A validated OpenAI chat request."""

    model: str
    stream: bool
    include_usage: bool
    args: dict[str, Any]  # bus arguments of experimental.distributed_llm.chat


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


def _messages(raw: Any, limits: Limits) -> list[dict[str, str]]:
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
        role = "system" if m["role"] == "developer" else str(m["role"])
        out.append({"role": role, "content": _text(m.get("content"), i)})
    return out


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"{key} must be a number in {lo}..{hi}", param=key)
    return float(v)


def _max_tokens(body: dict[str, Any], limits: Limits) -> int:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    v = body.get(key)
    if v is None:
        return min(limits.default_max_tokens, limits.max_tokens)
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


def parse_chat_request(body: Any, limits: Limits) -> ParsedChat:
    """Validate an OpenAI chat-completions body; raises `BadRequest` (with ``param``)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise BadRequest("model must be a model name (see GET /v1/models)", param="model")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise BadRequest("only n = 1 (an integer) is supported", param="n")
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    sampling = {"max_tokens": _max_tokens(body, limits),
                "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
                "top_p": _number(body, "top_p", 1.0, 1e-9, 1.0),
                "seed": _seed(body.get("seed")), "stop": _stop(body.get("stop"))}
    args = {"request": {"model": model, "messages": _messages(body.get("messages"), limits)},
            "params": {"sampling": sampling, **_extension(body.get("hearthnet"))}}
    return ParsedChat(model, stream,
                      _flag(opts, "include_usage", "stream_options.include_usage"), args)


@dataclass
class CompletionBuilder:
    """Collects one call's frames; gives OpenAI chunks while streaming, or one response."""

    model: str
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    events: list[Json] = field(default_factory=list)  # the incidents, as their wire maps
    done: Done | None = None

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> Json:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}]}

    def first_chunk(self) -> Json:
        return self._chunk({"role": "assistant", "content": ""})

    def feed(self, frame: StreamFrame) -> Json | None:
        """Take one frame; returns the chunk to stream for it, if any.

        Raises:
            HearthNetError: the frame is an ``error`` frame (its code's class).
        """
        if isinstance(frame, TokenDelta):
            self.text.append(frame.text)
            return self._chunk({"content": frame.text})
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
        return _FINISH.get(str(reason), "stop")

    def usage(self) -> dict[str, int]:
        u = self.done.usage if self.done is not None else {}
        p, c = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

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

    def last_chunk(self) -> Json:
        chunk = self._chunk({}, self.finish_reason)
        chunk["hearthnet"] = self.extension()
        return chunk

    def usage_chunk(self) -> Json:
        """The ``stream_options.include_usage`` chunk: no choices, the usage."""
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": [],
                "usage": self.usage()}

    def response(self) -> Json:
        """The non-streaming ``chat.completion`` object."""
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "logprobs": None, "finish_reason": self.finish_reason,
                             "message": {"role": "assistant", "content": "".join(self.text),
                                         "refusal": None}}],
                "usage": self.usage(), "hearthnet": self.extension()}
