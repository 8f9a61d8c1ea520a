"""`LocalEngine`: every layer in this process, through the same backend as the shards.

It is the spec's local fallback (M26 §5.4) and the baseline of every speed ratio. It can
also *continue* a `Generation` that began elsewhere: it rebuilds the KV cache from the
prompt and the tokens already streamed, then goes on sampling with the same sampler.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hearthnet.distributed_inference.engine.base import ClientHead, LayerStack
from hearthnet.distributed_inference.engine.compiled import compile_dir_of
from hearthnet.distributed_inference.engine.device import sync
from hearthnet.distributed_inference.engine.generation import (
    Generation,
    PromptLimits,
    TokenEvent,
)
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.engine.speculation import Speculator
from hearthnet.errors import BadRequest
from hearthnet.models.store import ModelEntry


@dataclass
class LocalTimings:
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0
    decode_ms: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        total = sum(self.decode_ms)
        return 1000.0 * len(self.decode_ms) / total if total > 0 else 0.0


class LocalEngine:
    """All layers of one model in one process.

    `weights`: the layers' held format (`engine.quant`); the head is held the same way
    unless `head_weights` (or a ready `head`) says otherwise.
    """

    def __init__(self, entry: ModelEntry, weights: str = "fp32",
                 head: ClientHead | None = None, head_weights: str | None = None, *,
                 limits: PromptLimits | None = None, prefill_chunk_tokens: int = 256,
                 device: str | torch.device | None = None, cuda_graphs: bool = True,
                 compile_decode: bool = True, compile_dir: Path | None = None) -> None:
        """`device`: where the layers run (default: the head's device, else the CPU).
        `compile_decode`: on the CPU, decode steps run compiled once the compiled step is
        built or loaded (in the background; `compile_dir`, default `compiled.compile_dir_of`)."""
        self.entry = entry
        self.limits = limits or PromptLimits()
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)
        where = device if device is not None else head.device if head is not None else "cpu"
        self.head = head or LayeredHead(
            entry, head_weights or weights, where,
            compile_dir=(compile_dir or compile_dir_of(entry)) if compile_decode else None)
        stack = LayeredStack(entry, 0, entry.num_layers - 1, weights, device=where,
                             cuda_graphs=cuda_graphs, compile_decode=compile_decode,
                             compile_dir=compile_dir or compile_dir_of(entry))
        if stack.compiled is not None:
            stack.compiled.start(0, entry.num_layers - 1)
        self.stack: LayerStack = stack

    def wait_compiled(self, timeout: float | None = None) -> str:
        """Wait for the compiled decode step and the head's (benchmarks measure what a warm
        node runs); what the decode steps run as."""
        compiled_head = getattr(self.head, "compiled", None)  # a LayeredHead's
        if compiled_head is not None:
            compiled_head.wait(timeout)
        stack = self.stack
        if not isinstance(stack, LayeredStack) or stack.compiled is None:
            return "eager"
        n = self.entry.num_layers - 1
        stack.compiled.wait(0, n, timeout)
        return stack.compile_state().get(f"0-{n}", "eager")

    def new_generation(self, messages: list[dict[str, str]],
                       params: SamplingParams) -> Generation:
        self.limits.check_request(messages, params)  # before tokenising: no work
        ids = self.head.chat_prompt_ids(messages)
        self.limits.check_prompt_ids(ids)
        return Generation(self.head.tokenizer, ids, params, self.head.eos_token_ids)

    def generate(self, messages: list[dict[str, str]], params: SamplingParams,
                 timings: LocalTimings | None = None) -> Iterator[TokenEvent]:
        """Stream the answer to a chat; fills `timings` when given."""
        yield from self.run(self.new_generation(messages, params), timings)

    def run(self, gen: Generation, timings: LocalTimings | None = None,
            speculator: Speculator | None = None) -> Generator[TokenEvent, None, None]:
        """Drive `gen` to its end; continues from its tokens if it has some already.

        `timings` is the caller's own (per call: the engine is shared by concurrent
        fallbacks); it is filled as the generation runs. `speculator`: verify its proposals
        in each pass (DESIGN.md decision 16).
        """
        for ev in self.steps(gen, timings, speculator):
            if ev is not None:
                yield ev

    def steps(self, gen: Generation, timings: LocalTimings | None = None,
              speculator: Speculator | None = None
              ) -> Generator[TokenEvent | None, None, None]:
        """As `run`, but the prefill runs in chunks of `prefill_chunk_tokens` positions and
        yields None after each chunk but the last, so a caller driving this from a shared
        executor lets other calls' work run between chunks."""
        t = timings if timings is not None else LocalTimings()
        ids = gen.all_ids
        max_len = len(gen.prompt_ids) + gen.params.max_tokens + 1
        if len(ids) >= max_len or len(ids) == 0:
            raise BadRequest("nothing to generate: empty prompt or no tokens left")
        session = self.stack.open_session(0, self.entry.num_layers - 1, max_len)
        try:
            sync(self.stack.device)
            t0 = time.perf_counter()
            n = self.prefill_chunk_tokens
            for at in range(0, len(ids) - n, n):  # every chunk but the last
                session.forward(self.head.embed(ids[at:at + n]), at)
                yield None
            last = ((len(ids) - 1) // n) * n
            h = session.forward(self.head.embed(ids[last:]), last)  # (1, T, H)
            # the token picked where the logits are when its argmax is all it needs
            picks = [gen.argmax_only]
            ev = gen.step(self.head.logits_rows([h[:, -1:]], picks)[0][-1])
            t.prefill_ms = t.first_token_ms = \
                (time.perf_counter() - t0) * 1000
            yield ev
            while not gen.done:
                t1 = time.perf_counter()
                pos = len(gen.all_ids) - 1  # a step below the cache's length cuts it back
                proposed = speculator.propose(gen) if speculator is not None else []
                h = session.forward(self.head.embed([gen.tokens[-1], *proposed]), pos)
                if speculator is None:
                    events = [gen.step(self.head.logits_rows([h[:, -1:]], picks)[0][-1])]
                else:
                    events = speculator.accept(gen, self.head.logits_rows([h], picks)[0],
                                               proposed)
                ms = (time.perf_counter() - t1) * 1000 / len(events)
                for ev in events:
                    t.decode_ms.append(ms)
                    yield ev
        finally:
            session.close()

    @torch.inference_mode()
    def complete_text(self, messages: list[dict[str, str]], params: SamplingParams) -> str:
        return "".join(ev.text for ev in self.generate(messages, params))
