"""Request parsing for `experimental.distributed_llm.chat` (M26 §4.3).

`ChatRequest` (model and messages) and `DistributedChatParams` (the spec's parameters plus
sampling) are built from the caller's maps; anything malformed is a `BadRequest` before any
work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hearthnet.constants import DEFAULT_TIMEOUT_S
from hearthnet.distributed_inference.directory.formats import DEFAULT_POLICY, check_policy
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.wire import check_wire_names
from hearthnet.errors import BadRequest


@dataclass(frozen=True)
class ChatRequest:
    """An `experimental.distributed_llm.chat` request."""

    model: str
    messages: list[dict[str, str]]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatRequest:
        if not isinstance(d, dict) or not isinstance(d.get("model", "smollm2"), str):
            raise BadRequest("request must be a map with a model name")
        msgs = d.get("messages")
        if not isinstance(msgs, list) or not msgs or len(msgs) > 256:
            raise BadRequest("messages must be a non-empty list of {role, content}")
        return cls(model=d.get("model", "smollm2"), messages=msgs)


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

    @classmethod
    def from_dict(cls, d: dict[str, Any], defaults: DistributedChatParams) -> DistributedChatParams:
        """Build from a request map; unknown keys or wrong types are `bad_request`."""
        if not isinstance(d, dict):
            raise BadRequest("params must be a map")
        s = d.get("sampling", {})
        if not isinstance(s, dict):
            raise BadRequest("params.sampling must be a map")
        known = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop"}
        if set(s) - known:
            raise BadRequest(f"unknown sampling keys {sorted(set(s) - known)}")
        if not isinstance(s.get("stop", []), list):
            raise BadRequest("params.sampling.stop must be a list of strings")
        try:
            sampling = SamplingParams(**{**s, "stop": tuple(s.get("stop", ()))})
            out = cls(sampling=sampling,
                      fallback_to_local=bool(d.get("fallback_to_local",
                                                   defaults.fallback_to_local)),
                      wire_dtype=str(d.get("wire_dtype", defaults.wire_dtype)),
                      wire_wide_dtype=str(d.get("wire_wide_dtype", defaults.wire_wide_dtype)),
                      max_shards=int(d.get("max_shards", defaults.max_shards)),
                      timeout_s=float(d.get("timeout_s", defaults.timeout_s)),
                      fallback_after_failures=int(d.get("fallback_after_failures",
                                                        defaults.fallback_after_failures)),
                      weights=check_policy(d.get("weights", defaults.weights)))
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad params: {e}") from e
        check_wire_names(out.wire_dtype, out.wire_wide_dtype)
        if not 0.1 <= out.timeout_s <= 600:
            raise BadRequest("timeout_s must be in 0.1..600")
        return out
