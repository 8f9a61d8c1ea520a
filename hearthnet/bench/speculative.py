"""`hearthnet bench pipeline --speculate MODE…`: speculative passes against plain ones.

Through one mesh of node processes on 127.0.0.1 (the same as `bench pipeline`; with
``--netem``, each in its own namespace a household link apart, `hearthnet.bench.netem`), each
prompt is answered with every mode asked for (``off``, ``lookup``, ``draft``) in turn,
``--runs`` times, interleaved so a change in the machine's load hits all modes alike. Two
prompts by default: an *edit* prompt (repeat a given paragraph with one change: the answer
copies the prompt, where prompt lookup shines) and a *plain* one (a story: little repeats).
Per prompt and mode it prints the decode tokens/s (median), the tokens per pipeline pass
(`done.speculative.tokens_per_pass`; 1.0 without speculation), the ratio to ``off`` in the
same run, and whether the greedy tokens are identical to ``off``'s (DESIGN.md decision 16).
Where a pass's time goes: its wall time (tokens per pass / tok/s), of which the stages'
round trips (the `done` frame's per-stage p50, summed) and, of those, the hops' overhead
(round trip less the shard's compute: the link, framing and hand-offs); the rest is the
orchestrator's (embed, head, proposals, acceptance).

Goals (SmolLM2, on loopback): the edit prompt ≥ 2.5 tokens per pass and ≥ 2× off's tok/s;
the plain prompt never below 0.95× off's.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

from hearthnet.bench import PROMPTS, median, table

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling "
             "after many winters of wind and salt. Every evening the keeper climbed the "
             "narrow stairs, lit the great lamp and watched the ships pass safely through "
             "the dark water below. In the morning he wrote the weather in his logbook, "
             "fed the gulls that waited on the railing and walked down to the village for "
             "bread and news.")
EDIT_PROMPT = ("Rewrite the following paragraph exactly as it is, but change the word "
               f"'keeper' to 'captain' everywhere:\n\n{PARAGRAPH}")
SPEC_PROMPTS = {"edit": EDIT_PROMPT, "plain": PROMPTS[0]}
GOALS = {"edit": {"tokens_per_pass_min": 2.5, "ratio_to_off_min": 2.0},
         "plain": {"ratio_to_off_min": 0.95}}


async def measure(uri: str, a: argparse.Namespace,
                  settle: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """Every prompt × mode, `a.runs` times: figures per prompt and mode, and the goals.
    `settle()` runs after the warm-ups (waits for the shards' compiled steps of passes,
    which the first pass starts)."""
    from hearthnet.bench.chats import chat_frames, token_ids

    modes = ["off", *[m for m in a.speculate if m != "off"]]
    out: dict[str, Any] = {"modes": modes, "prompts": {}}
    for name, prompt in SPEC_PROMPTS.items():
        for m in modes:  # warm-up: compiled steps, the draft model loaded
            await chat_frames(uri, prompt, a.model, 8, speculate=m, wire_dtype=a.wire)
        await asyncio.get_running_loop().run_in_executor(None, settle)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for _ in range(a.runs):
            for m in modes:
                frames, wall = await chat_frames(uri, prompt, a.model, a.tokens, speculate=m,
                                                 wire_dtype=a.wire)
                done = frames[-1]
                spec = done.get("speculative") or {}
                stages = done["timings"].get("per_shard", {}).values()
                runs[m].append({"tokens_per_second": done["timings"]["tokens_per_second"],
                                "tokens_per_pass": spec.get("tokens_per_pass") or 1.0,
                                "accepted": spec.get("accepted", 0),
                                "proposed": spec.get("proposed", 0),
                                "ids": token_ids(frames), "wall_ms": wall * 1000,
                                "stages_rtt_ms": sum(st["p50_ms"] for st in stages),
                                "hops_ms": sum(st["overhead_p50_ms"] for st in stages)})
        out["prompts"][name] = _summarise(runs)
    out["goals"] = _goals(out["prompts"])
    return out


def _summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = median([r["tokens_per_second"] for r in runs["off"]])
    off_ids = runs["off"][0]["ids"]
    res: dict[str, Any] = {}
    for m, rs in runs.items():
        tps = median([r["tokens_per_second"] for r in rs])
        per_pass = median([r["tokens_per_pass"] for r in rs])
        res[m] = {"tokens_per_second": round(tps, 2),
                  "tokens_per_second_runs": [round(r["tokens_per_second"], 2) for r in rs],
                  "tokens_per_pass": round(per_pass, 3),
                  "pass_ms": round(1000 * per_pass / tps, 2) if tps else None,
                  "stages_rtt_p50_ms": round(median([r["stages_rtt_ms"] for r in rs]), 2),
                  "hops_overhead_p50_ms": round(median([r["hops_ms"] for r in rs]), 2),
                  "proposed": sum(r["proposed"] for r in rs),
                  "accepted": sum(r["accepted"] for r in rs),
                  "ratio_to_off": round(tps / base, 3) if base else None,
                  "completion_tokens": len(rs[0]["ids"]),
                  "identical_to_off": all(r["ids"] == off_ids for r in rs)}
    return res


def _goals(prompts: dict[str, Any]) -> dict[str, Any]:
    """The goals of the ``lookup`` mode (the default proposer), per prompt."""
    out: dict[str, Any] = {}
    for name, goals in GOALS.items():
        f = prompts.get(name, {}).get("lookup")
        if f is None:
            continue
        for key, goal in goals.items():
            field = key.removesuffix("_min")
            value = f[field] or 0.0
            out[f"{name}.lookup.{field}"] = {"measured": value, "goal": goal,
                                             "met": value >= goal}
    return out


def report(f: dict[str, Any]) -> str:
    rows = []
    for name, per in f["prompts"].items():
        for m, d in per.items():
            rows.append([name, m, d["tokens_per_second"], d["tokens_per_pass"],
                         d["ratio_to_off"], f"{d['accepted']}/{d['proposed']}",
                         d["completion_tokens"], "yes" if d["identical_to_off"] else "NO",
                         d.get("pass_ms"), d.get("stages_rtt_p50_ms"),
                         d.get("hops_overhead_p50_ms")])
    t = table(["prompt", "speculate", "decode tok/s", "tokens/pass", "ratio to off",
               "accepted/proposed", "tokens", "identical to off", "pass ms",
               "stages rtt ms", "of it hops ms"], rows)
    goals = "; ".join(f"{k} {v['measured']} (goal ≥ {v['goal']}: "
                      f"{'met' if v['met'] else 'MISSED'})" for k, v in f["goals"].items())
    return f"{t}\ngoals: {goals or 'none (lookup not measured)'}"


def run_in(uri: str, a: argparse.Namespace,
           settle: Callable[[], Any] = lambda: None) -> dict[str, Any]:
    """`measure` on a running mesh (blocking)."""
    return asyncio.run(measure(uri, a, settle))
