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


def chat_args(prompt: str | list[dict[str, str]], model: str, sampling: SamplingParams,
              **params: Any) -> dict[str, Any]:
    """The bus arguments of a chat call: one user prompt, or a conversation's messages."""
    s = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
         "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
         "stop": list(sampling.stop)}
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {"request": {"model": model, "messages": messages},
            "params": {"sampling": s, **{k: v for k, v in params.items() if v is not None}}}
