"""A/B of LocalEngine decode speed on the CPU (SmolLM2, fp32, greedy), one run per process.

Run from two checkouts in turn (before/after a change), interleaved, on one machine:
    PYTHONPATH=<checkout> OMP_NUM_THREADS=1 python scripts/ab_local_decode.py 1
Prints the decode tok/s of 3 runs of 32 tokens after a warm-up, and the first token ids.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from hearthnet.distributed_inference.engine.local import LocalEngine, LocalTimings
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.models import ModelStore

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _run(eng: LocalEngine, n: int) -> tuple[list[int], Any]:
    msgs = [{"role": "user", "content": PROMPT}]
    t = LocalTimings()
    try:
        evs = list(eng.generate(msgs, SamplingParams(max_tokens=n), t))
    except TypeError:  # an older engine keeps its timings itself
        evs = list(eng.generate(msgs, SamplingParams(max_tokens=n)))  # type: ignore[call-arg]
        t = eng.timings  # type: ignore[attr-defined]
    return [ev.token_id for ev in evs if ev is not None], t


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    eng = LocalEngine(ModelStore().get("smollm2"))
    _run(eng, 4)  # warm-up
    tps = []
    for _ in range(3):
        ids, t = _run(eng, 32)
        tps.append(round(t.decode_tokens_per_s, 2))
    print(json.dumps({"tok_s": tps, "first_ms": round(t.first_token_ms, 1), "ids": ids[:8]}))


if __name__ == "__main__":
    main()
