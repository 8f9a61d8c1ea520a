"""What a compute backend provides (M26 §5.7).

A backend turns a model in the store into two kinds of objects:

- a `LayerStack`: decoder layers `[lo, hi]` (inclusive) of one model, loaded alone, from
  which any number of `LayerSession`s are opened. A session owns its KV cache and runs any
  sub-range `[start, end]` inside `[lo, hi]`.
- a `ClientHead`: what the orchestrator needs to turn text into the first hidden state
  and the last hidden state into logits — tokenizer, chat template, embeddings, final
  norm, lm_head.

Shapes: hidden states are `(batch, tokens, hidden)`; `batch` is 1 in this release.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LayerSession(Protocol):
    """One sequence's pass through a sub-range of layers, with its own KV cache."""

    start: int
    end: int
    max_length: int

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

    def close(self) -> None:
        """Free the KV cache."""
        ...


class LayerStack(Protocol):
    lo: int
    hi: int
    hidden_size: int
    dtype: torch.dtype

    def open_session(self, start: int, end: int, max_length: int) -> LayerSession: ...

    def param_bytes(self) -> int: ...

    def layer_indices(self) -> list[int]: ...


class ClientHead(Protocol):
    tokenizer: Any
    hidden_size: int
    num_layers: int
    eos_token_ids: set[int]

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def embed(self, token_ids: list[int]) -> torch.Tensor: ...

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor: ...
