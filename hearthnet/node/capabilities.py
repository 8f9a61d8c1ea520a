"""The node's capability names and a chat call's bus arguments.

No torch here: `HearthNetClient`, `hearthnet chat --config` and the benches build calls
without loading the model runtime. `Node` (daemon.py) serves these capabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hearthnet.distributed_inference.engine.sampling import SamplingParams

CHAT_CAPABILITY = "experimental.distributed_llm.chat"
SERVED_MODELS_CAPABILITY = "hearthnet.admin.models_served"  # admin listener only: local steward


def chat_args(prompt: str | list[dict[str, Any]], model: str, sampling: SamplingParams,
              *, tools: list[dict[str, Any]] | None = None, **params: Any) -> dict[str, Any]:
    """The bus arguments of a chat call: one user prompt, or a conversation's messages;
    `tools` (OpenAI function tools) for the chat template to render; the sampling's
    ``grammar`` (a `Constraint`, M26 §5.4) as its wire map."""
    s: dict[str, Any] = {"max_tokens": sampling.max_tokens,
                         "temperature": sampling.temperature, "top_k": sampling.top_k,
                         "top_p": sampling.top_p, "seed": sampling.seed,
                         "stop": list(sampling.stop)}
    if sampling.grammar is not None:
        s["grammar"] = sampling.grammar.to_wire()
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    request: dict[str, Any] = {"model": model, "messages": messages}
    if tools is not None:
        request["tools"] = tools
    return {"request": request,
            "params": {"sampling": s, **{k: v for k, v in params.items() if v is not None}}}
