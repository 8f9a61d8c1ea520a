"""What constrained decoding costs on this CPU: llguidance against xgrammar (M26 §5.4).

For each library, with a model's tokenizer (SmolLM2's 49,152 tokens by default): the
grammar compile time of a json_object grammar and of a small json_schema, and the
per-token cost of masking (fill the allowed-token bitmask, apply it to a logits row,
advance the matcher by the token) over the tokens of a valid answer. Prints one JSON line
per library and grammar.

    .venv/bin/python scripts/grammar_cost.py --model /tmp/hnd/models/smollm2
    # xgrammar is not a dependency: measure it from a side folder, e.g.
    # pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xgr .venv/bin/python scripts/grammar_cost.py --model ... --xgrammar
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["maths", "engines", "poetry"],
                     "address": {"city": "London", "zip": "W1"}})


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(vocab,) bool of a (words,) int32 bitmask (bit i of word w: token 32w+i)."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).flatten()[:vocab].bool()


def llguidance_cost(tok: Any, ids: list[int], vocab: int, rounds: int) -> list[dict[str, Any]]:
    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    out = [{"lib": "llguidance", "what": "tokenizer", "ms": round(_ms(t0), 1)}]
    for name, schema in (("json_object", {"type": "object"}), ("json_schema", SCHEMA)):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        compile_ms = _ms(t0)
        per: list[float] = []
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        for _ in range(rounds):
            m.reset()
            for t in ids:
                row = torch.randn(vocab)
                t1 = time.perf_counter()
                m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
                row.masked_fill_(~_unpack(mask, vocab), float("-inf"))
                ok = m.consume_token(t)
                per.append(_ms(t1))
                assert ok, m.get_error()
        out.append({"lib": "llguidance", "what": name, "compile_ms": round(compile_ms, 2),
                    "mask_ms_median": round(statistics.median(per), 3),
                    "mask_ms_p90": round(sorted(per)[int(len(per) * 0.9)], 3),
                    "tokens": len(per)})
    return out


def xgrammar_cost(tok: Any, ids: list[int], vocab: int, rounds: int) -> list[dict[str, Any]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = [{"lib": "xgrammar", "what": "tokenizer", "ms": round(_ms(t0), 1)}]
    for name in ("json_object", "json_schema"):
        t0 = time.perf_counter()
        cg = compiler.compile_builtin_json_grammar() if name == "json_object" \
            else compiler.compile_json_schema(json.dumps(SCHEMA))
        compile_ms = _ms(t0)
        m = xgr.GrammarMatcher(cg)
        bm = xgr.allocate_token_bitmask(1, vocab)
        per: list[float] = []
        for _ in range(rounds):
            m.reset()
            for t in ids:
                row = torch.randn(1, vocab)
                t1 = time.perf_counter()
                m.fill_next_token_bitmask(bm)
                xgr.apply_token_bitmask_inplace(row, bm)
                ok = m.accept_token(t)
                per.append(_ms(t1))
                assert ok
        out.append({"lib": "xgrammar", "what": name, "compile_ms": round(compile_ms, 2),
                    "mask_ms_median": round(statistics.median(per), 3),
                    "mask_ms_p90": round(sorted(per)[int(len(per) * 0.9)], 3),
                    "tokens": len(per)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model folder with its tokenizer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--xgrammar", action="store_true", help="also measure xgrammar")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import llguidance  # noqa: F401

    print(json.dumps({"lib": "llguidance", "what": "import", "ms": round(_ms(t0), 1)}))
    if args.xgrammar:
        t0 = time.perf_counter()
        import xgrammar  # noqa: F401

        print(json.dumps({"lib": "xgrammar", "what": "import", "ms": round(_ms(t0), 1)}))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = list(tok(ANSWER, add_special_tokens=False)["input_ids"])
    vocab = len(tok)
    torch.set_num_threads(1)
    rows = llguidance_cost(tok, ids, vocab, args.rounds)
    if args.xgrammar:
        rows += xgrammar_cost(tok, ids, vocab, args.rounds)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
