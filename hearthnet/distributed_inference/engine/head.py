"""The orchestrator's head (M26 §5.3): tokenizer and chat template, the embedding, the
final norm and the lm_head, read from the store and nothing else.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError, TemplateSyntaxError
from torch import nn

from hearthnet.distributed_inference.directory.formats import (
    HEAD_FORMATS,
    resolve_format,
)
from hearthnet.distributed_inference.engine import tracegate
from hearthnet.distributed_inference.engine.blocks import GgmlBlocks
from hearthnet.distributed_inference.engine.compiled_head import CompiledHead
from hearthnet.distributed_inference.engine.device import (
    resolve_device,
)
from hearthnet.distributed_inference.engine.families import (
    check_device_format,
    load_config,
    meta_base_model,
)
from hearthnet.distributed_inference.engine.grammar import template_has_tools
from hearthnet.distributed_inference.engine.quant import (
    Int8Linear,
    Q8Linear,
    compute_dtype_of,
    format_name,
    held_bytes,
)
from hearthnet.distributed_inference.engine.weights import (
    WeightsReader,
    fill_module,
    materialise_buffers,
)
from hearthnet.errors import BadRequest
from hearthnet.models.store import ModelEntry


class LayeredHead:
    """The orchestrator's part of a model: tokenizer, embeddings, final norm, lm_head."""

    def __init__(self, entry: ModelEntry, weights: str | torch.dtype = "fp32",
                 device: str | torch.device = "cpu", *, lm_head: bool = True,
                 compile_dir: Path | None = None) -> None:
        """`lm_head=False`: tokenizer, embeddings and norm only (calibration embeds prompts
        and never needs logits; an untied 7B lm_head is 2.2 GB in fp32). `compile_dir`:
        on the CPU, the embedding and the norm + lm_head run compiled once built or loaded
        from there (in the background, `compiled_head.CompiledHead`); None: eagerly."""
        from transformers import AutoTokenizer

        self.format = resolve_format(format_name(weights), entry.dtype)
        if self.format not in HEAD_FORMATS:
            raise BadRequest(f"a head holds its weights as {', '.join(HEAD_FORMATS)} (or "
                             f"native); not {self.format}")
        self.device = resolve_device(device)
        check_device_format(self.format, self.device)
        entry.check_files()
        self.entry = entry
        self.dtype = compute_dtype_of(self.format)
        self.config = load_config(entry)
        self.hidden_size = int(self.config.hidden_size)
        self.num_layers = int(self.config.num_hidden_layers)
        self.tokenizer = AutoTokenizer.from_pretrained(str(entry.path))
        reader = WeightsReader(entry.path)
        base = meta_base_model(self.config)
        p = reader.layer_prefix
        self.embed_tokens: nn.Module = base.embed_tokens
        self.norm: nn.Module = base.norm
        self._load_embeddings(reader, p + "embed_tokens.", base)
        norm_keys = [k for k in reader.index if k.startswith(p + "norm.")]
        fill_module(self.norm, reader, norm_keys, p + "norm.", self.format,
                    f"{entry.path} norm", base, self.device)
        self.embed_tokens.eval()
        self.norm.eval()
        # Gemma-2's final-logit soft-capping, applied as its CausalLM head does
        cap = getattr(self.config, "final_logit_softcapping", None)
        self.final_logit_softcapping: float | None = float(cap) if cap else None
        self.lm_head_q: Int8Linear | Q8Linear | None = None
        self.lm_head_weight: torch.Tensor = torch.empty(0)
        if lm_head:
            self._load_lm_head(reader)
        # fp32 logits as the weights times the rows' transpose where this CPU's BLAS runs
        # that faster than the rows times the weights' transpose (`weights_left_faster`)
        self.weights_left = bool(lm_head) and self.format == "fp32" \
            and self.device.type == "cpu" and self.lm_head_weight.numel() > 0 \
            and weights_left_faster()
        self.eos_token_ids = self._eos_ids()
        del base
        self.compiled: CompiledHead | None = None
        if compile_dir is not None and lm_head:
            self.compiled = CompiledHead(self, compile_dir)
            self.compiled.start()

    def _load_embeddings(self, reader: WeightsReader, prefix: str, base: Any) -> None:
        """Embeddings as held: a float matrix, or (int8) an `Int8Linear` whose rows are
        looked up — the family's embedding module keeps its scale buffers (Gemma)."""
        where = f"{self.entry.path} embeddings"
        self.embed_q: Int8Linear | Q8Linear | None = None
        if self.format != "int8":
            fill_module(self.embed_tokens, reader, [prefix + "weight"], prefix, self.format,
                        where, base, self.device)
            return
        self.embed_q = self._int8(reader, prefix + "weight", keep_rows=True)
        self.embed_tokens.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        materialise_buffers(self.embed_tokens, base, where, self.device)

    def _load_lm_head(self, reader: WeightsReader) -> None:
        tied = "lm_head.weight" not in reader.index or bool(
            getattr(self.config, "tie_word_embeddings", False))  # M26: lm_head tied or not
        if self.format == "int8":
            if tied and self.embed_q is not None:
                self.embed_q.pack()  # rows for embeddings, packed for the product
            self.lm_head_q = self.embed_q if tied else self._int8(reader, "lm_head.weight")
        elif tied:
            self.lm_head_weight = self.embed_tokens.weight  # type: ignore[assignment]
        else:
            self.lm_head_weight = reader.read(["lm_head.weight"], self.device)[
                "lm_head.weight"].to(self.dtype)

    def _int8(self, reader: WeightsReader, key: str, keep_rows: bool = False
              ) -> Int8Linear | Q8Linear:
        """An int8 head matrix: a GGUF's Q8_0 blocks as they are where this process holds
        them so (`Q8Linear.takes`; on the CPU), else int8 per output channel (other blocks
        de-quantised exactly first)."""
        ((_, value),) = reader.tensors([key], "", blocks=True)
        if torch.device(self.device).type == "cpu" and Q8Linear.takes(value):
            return Q8Linear(value)
        weight = value.dequantise() if isinstance(value, GgmlBlocks) else value
        return Int8Linear(weight, None, keep_rows=keep_rows)

    def param_bytes(self) -> int:
        """Bytes of the head's weights in their held format (a tied matrix counted once)."""
        mods = [self.embed_tokens, self.norm, *(m for m in (self.embed_q, self.lm_head_q) if m)]
        total = held_bytes(nn.ModuleList(mods))
        emb: torch.Tensor = self.embed_tokens.weight  # type: ignore[assignment]
        if self.lm_head_weight.numel() and self.lm_head_weight.data_ptr() != emb.data_ptr():
            total += self.lm_head_weight.numel() * self.lm_head_weight.element_size()
        return total

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = self.entry.path / "generation_config.json"
        if gen.is_file():
            e: Any = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def chat_prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` with the model's chat template and a generation prompt;
        with the tools of a `Conversation` rendered by the template (OpenAI ``tools``).

        Raises:
            BadRequest: a malformed message, or tools for a template that renders none
                (naming ``tools``).
        """
        for m in messages:
            _check_message(m)
        tools = getattr(messages, "tools", None)
        if tools is not None and not template_has_tools(self.tokenizer.chat_template):
            raise BadRequest(f"tools are not supported by {self.entry.alias}: the model's chat "
                             "template does not support tools (it renders no tools "
                             "variable); leave tools out or use a model whose template "
                             "has them", param="tools", model=self.entry.alias)
        if not self.tokenizer.chat_template:
            text = "".join(m["content"] + "\n" for m in messages)
            return list(self.tokenizer(text)["input_ids"])
        try:
            out: Any = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, add_generation_prompt=True, tokenize=True)
        except TemplateSyntaxError:
            raise  # the model's template is broken: not the caller's doing (internal)
        except (TemplateError, ValueError) as e:
            # the template refused these messages (`raise_exception`: Llama-2's, Mistral's
            # and Gemma's roles must alternate), or transformers refused them before
            # rendering (ValueError): the caller's to change, so a typed bad_request that
            # names the rule on every path — mesh, local, fallback, bus and HTTP (400)
            rule = (e.message if isinstance(e, TemplateError) else str(e)) \
                or type(e).__name__
            raise BadRequest(f"the chat template of {self.entry.alias} refused the messages: "
                             f"{rule}; send messages it accepts (some models take no system "
                             "message: put it in the first user message; some need user and "
                             "assistant turns to alternate, starting with user)",
                             model=self.entry.alias) from e
        ids: Any = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def text_prompt_ids(self, text: str) -> list[int]:
        """Token ids of a raw prompt (``/v1/completions``): no chat template, the tokenizer
        as it is (its own BOS kept, as the model was trained to continue text)."""
        if not isinstance(text, str):
            raise BadRequest("prompt must be a string", param="prompt")
        ids = [int(i) for i in self.tokenizer(text)["input_ids"]]
        if not ids:  # a tokenizer without a BOS gives nothing for "": nothing to continue
            raise BadRequest(f"the prompt is empty: {self.entry.alias}'s tokenizer adds no "
                             "start token, so there is nothing to continue", param="prompt")
        return ids

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """(1, T, H) input hidden state for `token_ids`, on the head's device."""
        ids = torch.tensor([token_ids], dtype=torch.long).to(self.device, non_blocking=True)
        fn = self.compiled.fn("embed") if self.compiled is not None else None
        return fn(self, ids) if fn is not None else self.embed_of(ids)

    def embed_of(self, ids: torch.Tensor) -> torch.Tensor:
        """(1, T, H) input hidden states of token ids (1, T): the eager embedding, and what
        `compiled_head` compiles."""
        if self.embed_q is None:
            with tracegate.eager():  # not while a tracer has patched nn.Module
                out: torch.Tensor = self.embed_tokens(ids)
            return out
        rows = self.embed_q.rows(ids)
        scale = getattr(self.embed_tokens, "embed_scale", None)  # Gemma's scaled embedding
        return rows * scale.float() if scale is not None else rows

    def embed_host(self, token_ids: list[int]) -> torch.Tensor:
        """`embed` as a host tensor the caller owns (sent to a shard, kept for replay)."""
        return self.embed(token_ids).cpu()

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """(vocab,) fp32 host logits of the last position of a (1, T, H) final hidden state
        (from any device): the sampler and its seeded generator stay on the host."""
        return self.logits_batch([hidden_last])[0]

    def logits_batch(self, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`logits` of several chats' final hidden states as one norm + lm_head product
        (DESIGN.md decision 12): the lm_head's weights are read once for all rows."""
        return [r[-1] for r in self.logits_rows([x[:, -1:, :] for x in hidden])]

    @torch.inference_mode()
    def logits_rows(self, hidden: Sequence[torch.Tensor],
                    picks: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """(T_i, vocab) fp32 host logits of every position of each (1, T_i, H) hidden state,
        as one norm + lm_head product: a speculative step's rows (DESIGN.md decision 16)
        beside other chats' last positions.

        `picks[i]`: entry i needs only each row's argmax (`Generation.argmax_only`: greedy,
        no grammar, no log-probabilities), so its (T_i,) int64 token ids come back instead,
        picked on the head's device: on a GPU one integer per row crosses to the host, not
        a vocabulary of floats (M26 §5.4)."""
        sizes = [int(x.shape[1]) for x in hidden]
        h = torch.cat([x[0].to(self.device, self.dtype) for x in hidden])  # (sum T_i, H)
        n = int(h.shape[0])
        if self.device.type == "cuda" and n % HEAD_ROWS_CUDA:
            # a GPU rounds a product of 1 row and one of 3 differently (bf16): padded to
            # one row count, a row's logits do not depend on the rows beside it (other
            # chats', a speculative pass's), and a greedy answer stays the solo one
            # (M26 §5.4); the lm_head is read once either way
            h = torch.cat([h, h.new_zeros(HEAD_ROWS_CUDA - n % HEAD_ROWS_CUDA, h.shape[1])])
        fn = self.compiled.fn("logits") if self.compiled is not None else None
        logits = (fn(self, h) if fn is not None else self.logits_of(h))[:n]
        if picks is None or not any(picks):
            return list(torch.split(logits.cpu(), sizes))
        ids = torch.split(logits.argmax(dim=-1).cpu(), sizes)  # the first largest, as Sampler
        return [i if p else r.cpu() for i, r, p in
                zip(ids, torch.split(logits, sizes), picks, strict=True)]

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """(T, vocab) fp32 logits of final hidden rows h (T, H) in the head's dtype: the
        eager norm + lm_head (+ soft-cap), and what `compiled_head` compiles."""
        with tracegate.eager():  # not while a tracer has patched nn.Module (tracegate.py)
            x = self.norm(h.unsqueeze(0))
            if self.lm_head_q is not None:
                logits = self.lm_head_q(x)[0]
            elif self.weights_left:
                logits = _weights_left(self.lm_head_weight, x[0])
            else:
                logits = torch.nn.functional.linear(x, self.lm_head_weight)[0]
        assert isinstance(logits, torch.Tensor)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


HEAD_ROWS_CUDA = 16
"""On a CUDA device the head's rows are padded to a multiple of this (`logits_rows`)."""

WEIGHTS_LEFT_GAIN = 0.8
"""Compute fp32 logits as ``(W @ rows.T).T`` where that measured at most this share of
``rows @ W.T``'s time (`weights_left_faster`)."""


def _weights_left(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows @ w.T`` (T, vocab) as ``(w @ rows.T).T``, one row more than given (a copy of
    the first): the BLAS's product of one row is its slow matrix-vector path."""
    padded = torch.cat([rows, rows[:1]])
    return (w @ padded.t()).t()[: rows.shape[0]]


@functools.cache
def weights_left_faster() -> bool:
    """Whether this CPU's BLAS multiplies an fp32 matrix out of cache by 1 and by 3 rows
    (a decode step; a round of a household's few chats) faster as ``(W @ rows.T).T`` than
    as ``rows @ W.T`` (`F.linear`): measured once per process on a 16,384 × 1,024 matrix
    (64 MB, as an lm_head is). MKL on an AMD Zen 4 reads the matrix once per row in
    `F.linear` for 2-3 rows: SmolLM2's lm_head (49,152 × 576, 2 threads) took 12.2 /
    28.9 / 41.8 / 20.9 / 20.2 ms for 1 / 2 / 3 / 4 / 8 rows, the weights on the left
    6.0 / 7.0 / 6.2 / 10.9 / 16.2 (one row padded to two, each row one more)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16384, 1024, generator=g)
    ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "linear": lambda x: torch.nn.functional.linear(x, w),
        "left": lambda x: _weights_left(w, x)}
    best = dict.fromkeys(ways, 0.0)
    for rows in (1, 3):
        x = torch.randn(rows, 1024, generator=g)
        for name, way in ways.items():
            way(x)  # warm
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                way(x)
                times.append(time.perf_counter() - t0)
            best[name] += min(times)
    return best["left"] < WEIGHTS_LEFT_GAIN * best["linear"]


def _check_message(m: Any) -> None:
    """A message the templates take: a role (system, user, assistant, tool) and string
    content; an assistant's earlier ``tool_calls`` (each ``{"function": {"name", "arguments":
    a map}}``) and a tool result's ``tool_call_id`` as transformers' templates read them."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
            or m.get("role") not in ("system", "user", "assistant", "tool"):
        raise BadRequest("each message needs a role (system|user|assistant|tool) and "
                         "string content")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if m["role"] != "assistant" or not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), dict) for c in calls):
        raise BadRequest("tool_calls belong to an assistant message, each with a function "
                         "name and its arguments as a map", param="messages")
