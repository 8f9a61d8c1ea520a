"""`hearthnet bench quality`: what a compact weight format costs in answers, per model.

Each model (``--model``, several in one run) is scored against its *exact* format: the one
lossless against its stored weights (the stored dtype's: bf16 for a bf16 store, fp32 for
an fp32 one or one that kept a GGUF's blocks), named in the report as the reference. Every
format (``--formats``; the exact one is always scored too, as a check: it gets 100 % and
no divergence) is measured two ways, with the same layer stack and head code as shards and
orchestrators use:

* text: teacher-forced next-token prediction over a fixed English text the project ships
  (`hearthnet/bench/data/quality.txt`, a snapshot of docs/security.md), cut into windows
  of ``--window`` tokens, ``--positions`` positions in all; at every position the format's
  next-token distribution is compared with the reference's: top-1 agreement (same
  arg-max) and mean KL(reference ‖ format);
* answers: the exact format answers each of ``--prompts`` chat prompts
  (`fidelity.PROMPTS`) greedily for ``--tokens`` tokens; each format reads the prompt and
  that answer in one teacher-forced pass (`fidelity.teacher_forced`) and is scored by
  `fidelity.score`: top-1 agreement with the answer, and per prompt the first position
  where its arg-max differs — where its own greedy answer would first leave the exact
  format's.

With ``--gguf smollm2|FILE.gguf`` it measures instead what holding a GGUF's own blocks costs
against transformers running the GGUF de-quantised to fp32 (`bench/fidelity.py`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from hearthnet.argtypes import positive
from hearthnet.bench import fidelity, machine, table, write_results
from hearthnet.distributed_inference.directory.formats import (
    HEAD_FORMATS,
    HELD_FORMATS,
    head_format,
    resolve_format,
)
from hearthnet.errors import BadRequest

TEXT = Path(__file__).parent / "data" / "quality.txt"
DEFAULT_FORMATS = ("fp32", "bf16", "int8", "int4")  # besides the exact one, which leads


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench quality`."""
    p.add_argument("--model", nargs="+", default=["smollm2"], metavar="MODEL",
                   help="model aliases in the store, each scored in turn (default smollm2)")
    p.add_argument("--formats", nargs="+", default=None, choices=HELD_FORMATS,
                   help="formats compared with each model's exact format, which is always "
                        "scored too (default fp32 bf16 int8 int4; with --gguf int4 int8 "
                        "bf16 fp32)")
    p.add_argument("--positions", type=positive, default=2048,
                   help="text positions scored (default 2048)")
    p.add_argument("--window", type=positive, default=512, help="tokens per text window")
    p.add_argument("--threads", type=positive, default=2, help="torch threads")
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for quality.json (default bench-results)")
    p.add_argument("--gguf", default=None, metavar="smollm2|FILE.gguf",
                   help="fidelity of a GGUF's kept blocks against transformers' fp32 "
                        "de-quantisation of the same file (quality-gguf.json)")
    p.add_argument("--prompts", type=positive, default=5,
                   help=f"chat prompts answered greedily (≤ {len(fidelity.PROMPTS)})")
    p.add_argument("--tokens", type=positive, default=64,
                   help="answer tokens per prompt")
    p.add_argument("--head", default=None, choices=HEAD_FORMATS,
                   help="--gguf: the head's format (default: the one that goes with each "
                        "layers format)")
    p.add_argument("--store", default=None,
                   help="--gguf: store to import into (default: a scratch folder)")


def exact_format(entry: Any) -> str:
    """The format lossless against `entry`'s stored weights: the stored dtype's (a store
    that kept GGUF blocks: fp32, its other tensors' dtype, to which blocks de-quantise
    exactly); fp32 for a dtype with no format of its own."""
    try:
        return resolve_format("native", entry.dtype)
    except BadRequest:
        return "fp32"


def _all_logits(head: Any, stack: Any, ids: list[int]) -> Any:
    """(T, vocab) fp32 next-token logits at every position of `ids`."""
    import torch

    s = stack.open_session(stack.lo, stack.hi, len(ids))
    with torch.inference_mode():
        h = s.forward(head.embed(ids), 0)
        out = torch.stack([head.logits(h[:, : i + 1, :]) for i in range(h.shape[1])])
    s.close()
    return out


def _windows(ids: list[int], window: int, positions: int) -> list[list[int]]:
    """The text's windows of `window` + 1 tokens, cut to hold `positions` positions in
    all (every position of a window is scored, the last one's included)."""
    out: list[list[int]] = []
    n = 0
    for i in range(0, len(ids) - 1, window):
        w = ids[i:i + window + 1][:positions - n]
        if not w:
            break
        out.append(w)
        n += len(w)
    return out


def _text_score(refs: list[Any], got: list[Any]) -> dict[str, Any]:
    """Top-1 agreement and mean KL(reference ‖ format) over every text position."""
    agree = kl = 0.0
    n = 0
    for ref, g in zip(refs, got, strict=True):
        r, q = ref.log_softmax(-1), g.log_softmax(-1)
        agree += float((r.argmax(-1) == q.argmax(-1)).sum())
        kl += float((r.exp() * (r - q)).sum())
        n += len(ref)
    return {"top1_agreement": round(agree / n, 4), "mean_kl": max(0.0, round(kl / n, 5)),
            "positions": n}  # max: not fp32's −0.0


def greedy(head: Any, stack: Any, prompt: list[int], tokens: int) -> tuple[list[int], Any]:
    """The greedy answer of `tokens` tokens (never stopping at an end token, so every prompt
    scores the same count) and its teacher-forced (tokens, vocab) logits.

    Decoded a token at a time, then settled in the one-pass numerics every format is
    scored in: a one-token bf16 step rounds differently from a whole pass, which flips a
    near-tie now and then. Where the pass's arg-max first leaves the answer, the answer
    takes the pass's token there and is decoded on from it; each round settles at least
    one more position, so the answer ends as the pass's own arg-max everywhere and the
    exact format scores 100 % against itself."""
    import torch

    s = stack.open_session(stack.lo, stack.hi, len(prompt) + tokens)
    answer: list[int] = []
    try:
        with torch.inference_mode():
            h = s.forward(head.embed(prompt), 0)
            for rounds in range(tokens + 1):
                while len(answer) < tokens:
                    answer.append(int(head.logits(h).argmax()))
                    if len(answer) < tokens:
                        h = s.forward(head.embed(answer[-1:]), len(prompt) + len(answer) - 1)
                logits = fidelity.teacher_forced(head, stack, prompt, answer)
                pred = logits.argmax(-1).tolist()
                at = next((i for i, (p, a) in enumerate(zip(pred, answer, strict=True))
                           if p != a), None)
                if at is None or rounds == tokens:
                    break
                answer = [*answer[:at], pred[at]]
                if at + 1 < tokens:  # the cache up to the prompt and answer[:at] still holds
                    h = s.forward(head.embed(answer[-1:]), len(prompt) + at)
    finally:
        s.close()
    return answer, logits


def _score_model(alias: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model's block of the figures: every format against its exact format."""
    from hearthnet.distributed_inference.engine.head import LayeredHead
    from hearthnet.distributed_inference.engine.layers import LayeredStack
    from hearthnet.distributed_inference.engine.quant import kernel_of
    from hearthnet.models import ModelStore

    entry = ModelStore().get(alias)
    exact = exact_format(entry)
    blocks = bool(entry.ggml_types)
    formats = list(dict.fromkeys([exact, *(args.formats or DEFAULT_FORMATS)]))
    last = entry.num_layers - 1

    def held(fmt: str) -> tuple[Any, Any]:
        return LayeredHead(entry, head_format(fmt)), LayeredStack(entry, 0, last, fmt)

    head, stack = held(exact)
    text_ids = head.tokenizer(TEXT.read_text())["input_ids"]
    windows = _windows(text_ids, args.window, args.positions)
    prompts = [head.chat_prompt_ids([{"role": "user", "content": p}])
               for p in fidelity.PROMPTS[:args.prompts]]
    text_refs = [_all_logits(head, stack, w) for w in windows]
    answers = [greedy(head, stack, p, args.tokens) for p in prompts]
    rows: dict[str, Any] = {}
    for fmt in formats:
        if fmt != exact:
            del head, stack
            head, stack = held(fmt)
        text = [_all_logits(head, stack, w) for w in windows] if fmt != exact else text_refs
        got = [fidelity.teacher_forced(head, stack, p, a) for p, (a, _) in
               zip(prompts, answers, strict=True)] if fmt != exact else \
            [lg for _, lg in answers]
        g = fidelity.score(answers, got)
        rows[fmt] = {**_text_score(text_refs, text), "greedy_agreement": g["top1_agreement"],
                     "first_divergence": g["first_divergence"],
                     "greedy_mean_kl": g["mean_kl"], "greedy_positions": g["positions"],
                     "head_format": head.format, "kernel": kernel_of(fmt, blocks),
                     "layers_mb": round(stack.param_bytes() / 2**20, 1)}
    del head, stack
    return {"model_id": entry.model_id, "stored_as": entry.stored_as, "reference": exact,
            "reference_head": rows[exact]["head_format"], "text_tokens": len(text_ids),
            "formats": rows}


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Score every format of every model against its exact format; returns (figures,
    report)."""
    import torch

    from hearthnet.distributed_inference.engine import quant

    if quant.dense_setting() is None:
        # `auto`: a teacher-forced pass reads an answer as one prefill, decode reads it a
        # row at a time in the int4 kernel, so that is what is scored (the prefill's fp32
        # path is closer to exact: HEARTHNET_INT4_DENSE_ROWS=34 scores it instead)
        quant.INT4_DENSE_ROWS = math.inf
    if args.gguf:
        args.formats = args.formats or ["int4", "int8", "bf16", "fp32"]
        return fidelity.run(args)
    torch.set_num_threads(args.threads)
    models = {alias: _score_model(alias, args) for alias in dict.fromkeys(args.model)}
    f = {"benchmark": "quality", "mode": "exact", "text": TEXT.name, "window": args.window,
         "positions": args.positions, "prompts": min(args.prompts, len(fidelity.PROMPTS)),
         "tokens": args.tokens, "models": models, "machine": machine()}
    f["results_file"] = str(write_results("quality", f, Path(args.results_dir)))
    return f, report(f)


def report(f: dict[str, Any]) -> str:
    """The human-readable tables of a `run` result, one block per model."""
    blocks = []
    for alias, m in f["models"].items():
        t = table(["format (layers/head)", "kernel", "text top-1", "mean KL (nats)",
                   "answer top-1", "first divergence", "answer KL", "layers MB"],
                  [[f"{k}/{v['head_format']}" + (" (reference)" if k == m["reference"]
                                                  else ""),
                    v["kernel"] or "-", f"{100 * v['top1_agreement']:.2f} %",
                    f"{v['mean_kl']:.2e}", f"{100 * v['greedy_agreement']:.2f} %",
                    ",".join("-" if d is None else str(d) for d in v["first_divergence"]),
                    f"{v['greedy_mean_kl']:.2e}", v["layers_mb"]]
                   for k, v in m["formats"].items()])
        blocks.append(f"{alias} ({m['model_id']}, stored {m['stored_as']}): reference "
                      f"{m['reference']}/{m['reference_head']}, the exact format; text: "
                      f"{next(iter(m['formats'].values()))['positions']} positions of "
                      f"{m['text_tokens']} tokens\n{t}")
    return (f"bench quality: each format against its model's exact format — next-token "
            f"prediction over {f['text']} (windows of {f['window']} tokens), and "
            f"teacher-forced along the exact format's greedy answers to {f['prompts']} "
            f"prompts × {f['tokens']} tokens (first divergence per prompt, - = none)\n\n"
            + "\n\n".join(blocks) + f"\n\nwritten to {f['results_file']}")
