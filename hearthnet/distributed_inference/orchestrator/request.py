"""Request parsing for `experimental.distributed_llm.chat` (M26 §4.3).

`ChatRequest` (model and messages, or model and a raw prompt) and `DistributedChatParams`
(the spec's parameters plus sampling) are built from the caller's maps; anything malformed
is a `BadRequest` before any work starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hearthnet.constants import DEFAULT_TIMEOUT_S
from hearthnet.distributed_inference.directory.formats import DEFAULT_POLICY, check_policy
from hearthnet.distributed_inference.engine.grammar import Constraint, Conversation, check_tools
from hearthnet.distributed_inference.engine.sampling import SamplingParams, check_speculate
from hearthnet.distributed_inference.orchestrator.params import (
    CALL_PARAMS,
    check_params,
    unknown_keys,
)
from hearthnet.distributed_inference.orchestrator.wire import check_wire_names
from hearthnet.errors import BadRequest


@dataclass(frozen=True)
class ChatRequest:
    """An `experimental.distributed_llm.chat` request: `messages` through the model's chat
    template, or a raw `prompt` continued as it is (a text completion; `messages` empty).

    A chat's ``tools`` (OpenAI function tools, rendered by the template) ride with its
    messages (`Conversation.tools`), so that every path that renders them renders both."""

    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatRequest:
        """Exactly one of ``messages`` and ``prompt``; the prompt's size is the node's limit
        (`PromptLimits.check_request`, checked with the messages' before any work)."""
        if not isinstance(d, dict) or not isinstance(d.get("model", "smollm2"), str):
            raise BadRequest("request must be a map with a model name")
        model = d.get("model", "smollm2")
        msgs, prompt, tools = d.get("messages"), d.get("prompt"), d.get("tools")
        if (msgs is None) == (prompt is None):
            raise BadRequest("request needs exactly one of messages (a chat) and prompt "
                             "(raw text to continue)", param="request")
        if prompt is not None:
            if tools is not None:
                raise BadRequest("tools need messages (a chat): a raw prompt is continued "
                                 "without the chat template", param="tools")
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string", param="prompt")
            return cls(model=model, prompt=prompt)
        if not isinstance(msgs, list) or not msgs or len(msgs) > 256:
            raise BadRequest("messages must be a non-empty list of {role, content}")
        if tools is not None:
            return cls(model=model, messages=Conversation.of(msgs, check_tools(
                tools, "request.tools")))
        return cls(model=model, messages=msgs)


@dataclass(frozen=True)
class DistributedChatParams:
    """The spec's parameters (M26 §4.3) plus sampling."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    fallback_to_local: bool = True
    wire_dtype: str = "auto"  # auto (fp32: lossless) | compact | fp16 | bf16 | fp32 (M26 §5.3)
    wire_wide_dtype: str = "bf16"  # what compact uses where fp16 does not fit: bf16 | fp32
    max_shards: int = 16
    timeout_s: float = DEFAULT_TIMEOUT_S
    fallback_after_failures: int = 2
    # the shards' weight formats the call accepts (DESIGN.md decision 10): "lossless" (only
    # formats that keep the stored weights), a minimum format, or "exact" (only the
    # orchestrator's own); see formats.check_policy
    weights: str = DEFAULT_POLICY
    # how the orchestrator proposes tokens for each pass to verify (DESIGN.md decision 16):
    # lookup (prompt lookup, no model), draft (the model's configured draft model) or off
    speculate: str = "lookup"

    @classmethod
    def from_dict(cls, d: dict[str, Any], defaults: DistributedChatParams) -> DistributedChatParams:
        """Build from a request map over `defaults` (the node's); a parameter that is
        unknown, of the wrong JSON type or out of range is a `bad_request` naming it (M26 §6).
        """
        if not isinstance(d, dict):
            raise BadRequest("params must be a map", param="params")
        unknown = unknown_keys(d, CALL_PARAMS.keys() | {"sampling"})
        if unknown:
            raise BadRequest(f"unknown params {unknown[:8]}; known: sampling, "
                             f"{', '.join(CALL_PARAMS)}", param="params")
        given = check_params({k: v for k, v in d.items() if k != "sampling"},
                             prefix="params.")
        out = dataclasses.replace(defaults, sampling=_sampling(d.get("sampling")), **given)
        check_wire_names(out.wire_dtype, out.wire_wide_dtype)
        check_policy(out.weights)
        check_speculate(out.speculate)
        return out


def _sampling(s: Any) -> SamplingParams:
    """``params.sampling``; `SamplingParams` checks each value's type and range."""
    if s is None:
        return SamplingParams()
    if not isinstance(s, dict):
        raise BadRequest("params.sampling must be a map", param="params.sampling")
    known = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logprobs",
             "grammar"}
    unknown = unknown_keys(s, known)
    if unknown:
        raise BadRequest(f"unknown sampling keys {unknown[:8]}", param="params.sampling")
    if not isinstance(s.get("stop", []), list):
        raise BadRequest("params.sampling.stop must be a list of strings",
                         param="params.sampling.stop")
    grammar = s.get("grammar")
    if grammar is not None:  # compiled at the door: a bad schema is refused before any work
        grammar = Constraint.from_wire(grammar)
    try:
        return SamplingParams(**{**s, "stop": tuple(s.get("stop", ())), "grammar": grammar})
    except TypeError as e:
        raise BadRequest(f"bad params.sampling: {e}", param="params.sampling") from e
