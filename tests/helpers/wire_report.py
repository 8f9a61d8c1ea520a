"""Greedy decoding through layer ranges with each stage's stream rounded to a wire dtype.

It reproduces what the mesh does to hidden states (issue 11 §4): a stage's input and its
output travel in that stage's wire dtype; everything else is the backend in fp32.
"""

from __future__ import annotations

import torch

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.orchestrator.sanity import calibrate
from hearthnet.distributed_inference.orchestrator.wire import WirePlan
from hearthnet.dtypes import FLOAT_DTYPES
from hearthnet.models.store import ModelEntry

DTYPES = FLOAT_DTYPES
REPORT_PROMPTS = ("What is the capital of France?",
                  "Write a short poem about a lighthouse keeper.",
                  "Explain in three sentences why the sky is blue.")


def greedy_over_wire(head: LayeredHead, stacks: list[LayeredStack],
                     ranges: list[tuple[int, int]], ids: list[int], n: int,
                     wires: list[str]) -> list[int]:
    """`n` greedy tokens; stage k's input and output rounded to `wires[k]`."""
    sessions = [st.open_session(a, b, len(ids) + n + 1)
                for st, (a, b) in zip(stacks, ranges, strict=True)]

    def run(x: torch.Tensor, pos: int) -> torch.Tensor:
        for s, w in zip(sessions, wires, strict=True):
            dt = DTYPES[w]
            x = s.forward(x.to(dt).float(), pos).to(dt).float()
        return x

    toks = [int(head.logits(run(head.embed(ids), 0)).argmax())]
    for i in range(n - 1):
        toks.append(int(head.logits(run(head.embed([toks[-1]]), len(ids) + i)).argmax()))
    for s in sessions:
        s.close()
    return toks


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def wire_report(entry: ModelEntry, ranges: list[tuple[int, int]], n: int = 64
                ) -> dict[str, list[int | None]]:
    """First divergence of fp16 / bf16 / compact wire vs fp32 wire, per report prompt."""
    head = LayeredHead(entry)
    stacks = [LayeredStack(entry, a, b) for a, b in ranges]
    plan = WirePlan("compact", "bf16", calibrate(entry.path))
    compact = [plan.for_stage(a, b) for a, b in ranges]
    out: dict[str, list[int | None]] = {"fp16": [], "bf16": [], "compact": []}
    for p in REPORT_PROMPTS:
        ids = head.chat_prompt_ids([{"role": "user", "content": p}])
        runs = {w: greedy_over_wire(head, stacks, ranges, ids, n, [w] * len(ranges))
                for w in ("fp32", "fp16", "bf16")}
        uniform = len(set(compact)) == 1
        runs["compact"] = runs[compact[0]] if uniform else greedy_over_wire(
            head, stacks, ranges, ids, n, compact)
        for w in out:
            out[w].append(first_divergence(runs[w], runs["fp32"]))
    out["compact_wires"] = compact  # type: ignore[assignment]
    return out
