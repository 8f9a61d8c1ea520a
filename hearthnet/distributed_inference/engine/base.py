"""What a compute backend provides (M26 §5.7).

A backend turns a model in the store into two kinds of objects:

- a `LayerStack`: decoder layers `[lo, hi]` (inclusive) of one model, loaded alone, from
  which any number of `LayerSession`s are opened. A session owns its KV cache and runs any
  sub-range `[start, end]` inside `[lo, hi]`.
- a `ClientHead`: what the orchestrator needs to turn text into the first hidden state
  and the last hidden state into logits — tokenizer, chat template, embeddings, final
  norm, lm_head.

Shapes: hidden states are `(batch, tokens, hidden)`; `batch` is 1 per session. Concurrent
sessions' decode steps are batched by the stack (`LayeredStack.decode_batch`, B rows of one
position each) and their heads by `ClientHead.logits_batch` (DESIGN.md decision 12).

These Protocols are the interface the rest of the package holds backends by: the shard
server (`shard/server.py`) holds a `LayerStack` and its `LayerSession`s, the orchestrator
(`orchestrator/pipeline.py`, `orchestrator/decode.py`, `engine/local.py`) a `ClientHead`.
`layers.py` (`LayeredStack`, `LayeredSession`) and `head.py` (`LayeredHead`) implement
them structurally; `mypy --strict` checks that they conform where their objects are built and
handed to those holders (`ShardServer._load`, `PipelineOrchestrator._head`, `LocalEngine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class LayerSession(Protocol):
    """One sequence's pass through a sub-range of layers, with its own KV cache."""

    start: int
    end: int
    max_length: int

    @property
    def stack(self) -> LayerStack:
        """The stack this session runs on (its device and compute dtype)."""
        ...

    @property
    def length(self) -> int:
        """Positions held in the KV cache."""
        ...

    def forward(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run `hidden` (1, T, H) at positions `start_pos .. start_pos+T-1`.

        `start_pos` may be below `length` (a step redone after a failover elsewhere): the
        cache is cut back to `start_pos` first. Above `length` is a gap: `BadRequest`.
        """
        ...

    def copy_prefix(self, source: LayerSession, positions: int) -> int:
        """Take up to `positions` cached positions of `source` (same stack and sub-range,
        equal inputs there) instead of computing them; how many were taken (0: none)."""
        ...

    def close(self) -> None:
        """Free the KV cache."""
        ...


class LayerStack(Protocol):
    """Decoder layers `[lo, hi]` of one model on one device, in one compute dtype."""

    lo: int
    hi: int
    hidden_size: int
    format: str  # the weights' held format (`directory/formats.py`)
    dtype: torch.dtype
    device: torch.device

    def open_session(self, start: int, end: int, max_length: int) -> LayerSession:
        """A session over `[start, end]` ⊆ `[lo, hi]` holding up to `max_length`
        positions (`ShardUnavailable` when its KV cache does not fit the budget)."""
        ...

    def param_bytes(self) -> int:
        """Bytes of the hosted layers' weights in their held format."""
        ...

    def layer_indices(self) -> list[int]:
        """The hosted layer indices, `lo..hi`."""
        ...


class ClientHead(Protocol):
    """Tokenizer, embeddings, final norm and lm_head: the orchestrator's part."""

    tokenizer: Any
    hidden_size: int
    num_layers: int
    eos_token_ids: set[int]
    format: str
    device: torch.device

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` with the chat template and a generation prompt.

        Raises:
            BadRequest: the template refused the messages (roles that do not alternate, a
                system message it does not take), with the template's own message: the
                one place every chat path applies the template.
        """
        ...

    def text_prompt_ids(self, text: str) -> list[int]:
        """Token ids of a raw prompt, without the chat template (a text completion): the
        tokenizer as it is, its own start token kept.

        Raises:
            BadRequest: the prompt tokenises to nothing.
        """
        ...

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """Hidden states `(1, T, H)` of `token_ids` on the head's device."""
        ...

    def embed_host(self, token_ids: list[int]) -> torch.Tensor:
        """`embed`, brought to the host (what is sent to the first shard)."""
        ...

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """Logits of the last position of `hidden_last` (final norm, then lm_head)."""
        ...

    def param_bytes(self) -> int:
        """Bytes of the head's weights in their held format."""
        ...

    def logits_batch(self, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`logits` of several chats' final hidden states as one norm + lm_head product
        (DESIGN.md decision 12), one (vocab,) tensor per chat."""
        ...

    def logits_rows(self, hidden: Sequence[torch.Tensor],
                    picks: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """The logits of every position of each `(1, T_i, H)` hidden state, as one
        product: one `(T_i, vocab)` tensor each (a speculative step's rows, DESIGN.md
        decision 16); for an entry whose `picks` is true, each row's argmax instead, a
        `(T_i,)` int64 tensor picked where the logits are."""
        ...
