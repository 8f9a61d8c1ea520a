"""`hearthnet bench pipeline --flow`: a long prompt flowing through the stages (M26 §5.3)
against the same prompt sent whole.

One mesh of node processes on 127.0.0.1 (with ``--netem``, each in its own namespace a
household link apart, `hearthnet.bench.netem`) with two orchestrators over the same shards:
node A sends a long prompt in chunks of `prefill_chunk_tokens` that flow (stage 0 takes chunk i+1
while stage 1 computes chunk i), node U (``prefill_chunk_tokens`` larger than the prompt)
sends it as one step through each stage in turn. Calls alternate between them, ``--runs``
times; the figure is each one's median time to the first token and the ratio flow /
whole, with the first token of both compared (the answers must be the same).

Goal: a 2,000-token prompt through two shards ≤ 0.65 × the whole prompt's time.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from hearthnet.bench import median, table

GOAL = 0.65
UNCHUNKED = "node-u"
LINE = ("The keeper climbed the stairs at dusk, trimmed the wick and wrote the weather in "
        "the log, as every keeper had for a hundred years. ")


def long_prompt(tokenizer: Any, tokens: int) -> str:
    """A prompt of about `tokens` tokens (one sentence repeated) ending in a question."""
    per = max(1, len(tokenizer(LINE)["input_ids"]))
    return LINE * max(1, tokens // per) + "What happened next?"


async def measure(uris: dict[str, str], prompt: str, a: argparse.Namespace) -> dict[str, Any]:
    """First-token time through the flowing orchestrator (``flow``) and the whole-prompt
    one (``whole``), alternating, `a.runs` times each (after one warm-up each)."""
    from hearthnet.bench.chats import chat_frames, token_ids

    for uri in uris.values():
        await chat_frames(uri, prompt, a.model, 2, speculate="off", wire_dtype=a.wire)
    runs: dict[str, list[float]] = {k: [] for k in uris}
    firsts: dict[str, list[int]] = {}
    for _ in range(a.runs):
        for k, uri in uris.items():
            frames, _ = await chat_frames(uri, prompt, a.model, 2, speculate="off",
                                          wire_dtype=a.wire)
            runs[k].append(frames[-1]["timings"]["first_token_ms"])
            firsts[k] = token_ids(frames)
    out: dict[str, Any] = {k: {"first_token_ms": round(median(v), 1),
                               "first_token_ms_runs": [round(x, 1) for x in v]}
                           for k, v in runs.items()}
    ratio = out["flow"]["first_token_ms"] / out["whole"]["first_token_ms"]
    out["ratio_flow_to_whole"] = round(ratio, 3)
    out["same_tokens"] = firsts["flow"] == firsts["whole"]
    out["goal"] = {"measured": round(ratio, 3), "goal": GOAL, "met": ratio <= GOAL}
    return out


def report(f: dict[str, Any]) -> str:
    rows = [[k, f[k]["first_token_ms"], ", ".join(map(str, f[k]["first_token_ms_runs"]))]
            for k in ("flow", "whole")]
    g = f["goal"]
    return (table(["prompt sent", "first token ms (median)", "runs"], rows) +
            f"\nflow / whole: {f['ratio_flow_to_whole']} (goal ≤ {g['goal']}: "
            f"{'met' if g['met'] else 'MISSED'}); same tokens: {f['same_tokens']}")


def run_in(uris: dict[str, str], prompt: str, a: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(measure(uris, prompt, a))
