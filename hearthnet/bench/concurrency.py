"""The concurrency part of `hearthnet bench pipeline` (M26 §5.3): continuous batching, measured.

At each ``--concurrency`` level C, C greedy chats start at once through the orchestrating
node (prompts cycled from `PROMPTS`; with ``--context N`` each is put after a text that
makes it about N tokens long, so every session decodes over a long cache), ``--runs``
times. Per level:

- aggregate tokens/s: all chats' completion tokens over the wall time of the round;
- per-chat decode tokens/s (median over chats, from each `done` frame);
- aggregate tokens/s once every chat decodes: the tokens that arrived after the last
  chat's first token, over the time from then to the last token (the steady state, without
  the prefills that short answers otherwise count);
- p50 / p95 inter-token latency: the gaps between a chat's token frames as the caller
  receives them (first token excluded: that is prefill), pooled over the level's chats;
  and the p95 of the gaps once every chat of the round is decoding (the others' prefills
  no longer share the rounds);
- the shard batch size histogram (rows per batched forward, from the shard nodes' own
  ``shard_batch_size`` Prometheus histogram, the difference over the level) and the
  orchestrator's head batch sizes (``head_batch_size``);
- prompt tokens, and of them those the stages copied from another chat's sessions instead
  of computing them (a shared prompt prefix: ``usage.cached_prompt_tokens`` of each `done`);
- local fallbacks: chats that ended on the orchestrator's local engine (``fallback`` in
  their `done` frame) — a busy shard must make a chat wait for a slot, not fall back to local;
  and failovers: stages the chats replaced mid-answer (``failovers`` of `done`: a step that
  failed or stalled, the history replayed — a whole prefill's gap in the chat's tokens);
- agreement: each chat's tokens against the same prompt run alone (the solo reference
  pass before the levels): identical, or the index of the first divergence. In fp32 they
  must all be identical; in bf16/int8 a batched matmul may round differently.

Goals (set for the 2-core CPU machine): aggregate tokens/s at 8 chats ≥ 4× the single
chat's, with p95 inter-token latency ≤ 2× the single chat's.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

from hearthnet.bench import PROMPTS, goals_text, median, percentile, table
from hearthnet.errors import HearthNetError

GOALS = {"aggregate_ratio_min": 4.0, "itl_p95_ratio_max": 2.0, "at_concurrency": 8}

Scrape = Callable[[], dict[str, str]]
"""() -> {node id: its /metrics text}."""

_P = "hearthnet_distributed_inference_"


async def timed_chat(uri: str, prompt: str, model: str, tokens: int,
                     **params: Any) -> dict[str, Any]:
    """One greedy chat: its token ids, the arrival time of each token, its `done` frame."""
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    args = chat_args(prompt, model, SamplingParams(max_tokens=tokens), **params)
    ids: list[int] = []
    times: list[float] = []
    last: dict[str, Any] = {}
    async for f in bus_call(uri, CHAT_CAPABILITY, args):
        if f.get("type") == "token_delta":
            ids.append(int(f["token_id"]))
            times.append(time.perf_counter())
        last = f
    if last.get("type") != "done":
        raise HearthNetError(f"the chat did not finish: {last}")
    return {"ids": ids, "times": times, "done": last}


def histogram(texts: dict[str, str], name: str) -> dict[str, dict[str, float]]:
    """{series labels: {le: cumulative count, "sum": s}} of histogram `name` over nodes."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for node, text in texts.items():
        for fam in text_string_to_metric_families(text):
            if fam.name != _P + name:
                continue
            for s in fam.samples:
                series = s.labels.get("shard_id", node)
                row = out.setdefault(series, {})
                if s.name.endswith("_bucket"):
                    row[s.labels["le"]] = s.value
                elif s.name.endswith("_sum"):
                    row["sum"] = s.value
    return out


def size_histogram(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                   ) -> dict[str, Any]:
    """Per series: batches by size (upper bucket bound → count) and mean rows per batch,
    over the interval between two scrapes."""
    out: dict[str, Any] = {}
    for series, row in after.items():
        prev = before.get(series, {})
        bounds = sorted((k for k in row if k != "sum"), key=float)
        counts: dict[str, int] = {}
        below = 0.0
        for le in bounds:
            cum = row[le] - prev.get(le, 0.0)
            if cum - below > 0:
                counts["+Inf" if le == "+Inf" else str(int(float(le)))] = int(cum - below)
            below = cum
        if below > 0:
            rows = row.get("sum", 0.0) - prev.get("sum", 0.0)
            out[series] = {"batches_by_size": counts, "batches": int(below),
                           "mean_rows": round(rows / below, 2)}
    return out


def agreement(chats: list[dict[str, Any]], prompts: list[str],
              solo: dict[str, list[int]]) -> dict[str, Any]:
    """Tokens of each chat against its prompt's solo answer."""
    firsts: list[int] = []
    same = 0
    for chat, p in zip(chats, prompts, strict=True):
        ids, ref = chat["ids"], solo[p]
        if ids == ref:
            same += 1
            continue
        firsts.append(next((i for i, (a, b) in enumerate(zip(ids, ref, strict=False))
                            if a != b), min(len(ids), len(ref))))
    return {"identical": same, "chats": len(chats), "first_divergences": sorted(firsts)}


def level_prompts(tokenizer: Any, context: int | None) -> list[str]:
    """`PROMPTS`, each after a text that brings it to about `context` tokens (if given)."""
    if not context:
        return list(PROMPTS)
    from hearthnet.bench.flow import LINE

    def length(k: int, p: str) -> int:
        return len(tokenizer(LINE * k + p)["input_ids"])

    per = max(1, len(tokenizer(LINE)["input_ids"]))
    out = []
    for p in PROMPTS:
        k = max(0, (context - length(0, p)) // per)
        while length(k + 1, p) <= context:  # repeated lines join into fewer tokens
            k += 1
        out.append(LINE * k + p)
    return out


async def solo_answers(uri: str, a: argparse.Namespace) -> dict[str, list[int]]:
    """Each prompt alone (also the warm-up of the levels)."""
    return {p: (await timed_chat(uri, p, a.model, a.tokens, wire_dtype=a.wire))["ids"]
            for p in a.level_prompts}


async def level(uri: str, a: argparse.Namespace, c: int, scrape: Scrape,
                solo: dict[str, list[int]]) -> dict[str, Any]:
    """`c` chats at once, `a.runs` times; see the module docstring."""
    aggs, per_chat, gaps, steady, steady_aggs = [], [], [], [], []
    fallbacks = failovers = prompt_tokens = cached = 0
    prompts = [a.level_prompts[i % len(a.level_prompts)] for i in range(c)]
    agree: list[dict[str, Any]] = []
    last: list[dict[str, Any]] = []
    before = scrape()
    for _ in range(a.runs):
        t0 = time.perf_counter()
        chats = await asyncio.gather(*(timed_chat(uri, p, a.model, a.tokens,
                                                  wire_dtype=a.wire) for p in prompts))
        wall = time.perf_counter() - t0
        aggs.append(sum(len(ch["ids"]) for ch in chats) / wall)
        per_chat += [ch["done"]["timings"]["tokens_per_second"] for ch in chats]
        fallbacks += sum(bool(ch["done"].get("fallback")) for ch in chats)
        failovers += sum(int(ch["done"].get("failovers", 0)) for ch in chats)
        prompt_tokens += sum(int(ch["done"]["usage"]["prompt_tokens"]) for ch in chats)
        cached += sum(int(ch["done"]["usage"].get("cached_prompt_tokens", 0)) for ch in chats)
        pairs = [(a_, b_) for ch in chats
                 for a_, b_ in zip(ch["times"], ch["times"][1:], strict=False)]
        all_decoding = max(ch["times"][0] for ch in chats if ch["times"])
        gaps += [(b_ - a_) * 1000 for a_, b_ in pairs]
        steady += [(b_ - a_) * 1000 for a_, b_ in pairs if a_ >= all_decoding]
        later = [t for ch in chats for t in ch["times"] if t > all_decoding]
        if later and max(later) > all_decoding:
            steady_aggs.append(len(later) / (max(later) - all_decoding))
        agree.append(agreement(chats, prompts, solo))
        # the last run's chats one by one: when each began answering, and its longest wait
        last = [{"first_token_s": round(ch["times"][0] - t0, 3) if ch["times"] else None,
                 "longest_gap_ms": round(max(((b_ - a_) * 1000 for a_, b_ in zip(
                     ch["times"], ch["times"][1:], strict=False)), default=0.0), 1),
                 "cached_prompt_tokens": int(ch["done"]["usage"].get(
                     "cached_prompt_tokens", 0)),
                 "failovers": int(ch["done"].get("failovers", 0))} for ch in chats]
    after = scrape()
    return {"concurrency": c, "aggregate_tokens_per_second": round(median(aggs), 2),
            "aggregate_runs": [round(x, 2) for x in aggs],
            "aggregate_tokens_per_second_all_decoding":
                round(median(steady_aggs), 2) if steady_aggs else None,
            "per_call_decode_tokens_per_second": round(median(per_chat), 2),
            "inter_token_ms_p50": round(percentile(gaps, 50), 1),
            "inter_token_ms_p95": round(percentile(gaps, 95), 1),
            "inter_token_ms_p95_all_decoding": round(percentile(steady, 95), 1),
            "local_fallbacks": fallbacks,
            # stages a call replaced mid-answer (a stalled or failed step: its history
            # replayed on another session) — a gap of a whole prefill in its tokens
            "failovers": failovers,
            # prompt positions the stages copied from another chat instead of computing
            "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
            "last_run_chats": last,
            "shard_batches": size_histogram(histogram(before, "shard_batch_size"),
                                            histogram(after, "shard_batch_size")),
            "head_batches": size_histogram(histogram(before, "head_batch_size"),
                                           histogram(after, "head_batch_size")),
            "agreement": {"identical": sum(x["identical"] for x in agree),
                          "chats": sum(x["chats"] for x in agree),
                          "first_divergences": sorted(i for x in agree
                                                      for i in x["first_divergences"])}}


async def measure(uri: str, a: argparse.Namespace, scrape: Scrape) -> dict[str, Any]:
    """Every level of ``--concurrency``, after the solo reference pass; and the goals."""
    solo = await solo_answers(uri, a)
    levels = [await level(uri, a, c, scrape, solo) for c in a.concurrency]
    return {"concurrency": levels, "concurrency_goals": goals(levels),
            "concurrency_all_decoding_ratio": steady_ratio(levels)}


def goals(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """The batching goals above, where both the single chat and 8 chats were measured."""
    by = {lv["concurrency"]: lv for lv in levels}
    one, many = by.get(1), by.get(GOALS["at_concurrency"])
    if one is None or many is None:
        return {}
    agg = many["aggregate_tokens_per_second"] / max(one["aggregate_tokens_per_second"], 1e-9)
    itl = many["inter_token_ms_p95"] / max(one["inter_token_ms_p95"], 1e-9)
    return {"aggregate_ratio_8_to_1": {"measured": round(agg, 2),
                                      "goal": GOALS["aggregate_ratio_min"],
                                      "met": agg >= GOALS["aggregate_ratio_min"]},
            "itl_p95_ratio_8_to_1": {"measured": round(itl, 2),
                                     "goal": GOALS["itl_p95_ratio_max"],
                                     "met": itl <= GOALS["itl_p95_ratio_max"]}}


def report(levels: list[dict[str, Any]], goal: dict[str, Any]) -> str:
    """The concurrency table, batch sizes and the goals."""
    def sizes(h: dict[str, Any]) -> str:
        return "; ".join(f"{' '.join(f'{k}:{v}' for k, v in s['batches_by_size'].items())} "
                         f"(mean {s['mean_rows']})" for s in h.values()) or "-"

    t = table(["chats", "aggregate tok/s", "all decoding tok/s", "per-chat tok/s",
               "ITL p50 ms", "ITL p95 ms", "p95 all decoding", "identical to solo",
               "local fallbacks", "failovers", "prompt tokens (copied)",
               "shard batches (size:count)",
               "head batches"],
              [[c["concurrency"], c["aggregate_tokens_per_second"],
                c.get("aggregate_tokens_per_second_all_decoding"),
                c["per_call_decode_tokens_per_second"], c["inter_token_ms_p50"],
                c["inter_token_ms_p95"], c["inter_token_ms_p95_all_decoding"],
                f"{c['agreement']['identical']}/{c['agreement']['chats']}",
                c["local_fallbacks"], c.get("failovers", "-"),
                f"{c.get('prompt_tokens', '-')} ({c.get('cached_prompt_tokens', 0)})",
                sizes(c["shard_batches"]), sizes(c["head_batches"])] for c in levels])
    lines = [t]
    diverged = [(c["concurrency"], c["agreement"]["first_divergences"]) for c in levels
                if c["agreement"]["first_divergences"]]
    if diverged:
        lines.append("first divergence from solo (token index): " + ", ".join(
            f"{c} chats {d}" for c, d in diverged))
    if goal:
        lines.append("concurrency goals: " + goals_text(goal))
    steady = steady_ratio(levels)
    if steady is not None:  # beside the goal, which counts the prefills: not a goal
        lines.append(f"once every chat decodes: {GOALS['at_concurrency']} chats' aggregate "
                     f"is {steady}× one chat's (the goal's aggregate counts the prefills)")
    return "\n".join(lines)


def steady_ratio(levels: list[dict[str, Any]]) -> float | None:
    """8 chats' aggregate over one chat's once every chat decodes (None: not measured)."""
    by = {lv["concurrency"]: lv.get("aggregate_tokens_per_second_all_decoding")
          for lv in levels}
    one, many = by.get(1), by.get(GOALS["at_concurrency"])
    return round(many / one, 2) if one and many else None
