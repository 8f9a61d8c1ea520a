"""`hearthnet bench quality --gguf`: HearthNet on a GGUF's own blocks against transformers
running the same GGUF de-quantised to fp32 (DESIGN.md decisions 10 and 15).

The GGUF is imported with its blocks kept (`--dtype gguf`, into a scratch store unless
`--store` names one). For each of `PROMPTS` (chat-templated), transformers' fp32 model
(`from_pretrained(…, gguf_file=…)`: gguf-py's de-quantisation, transformers' own layout)
answers greedily for ``--tokens`` tokens — never stopping at an end token, so every prompt
scores the same count. HearthNet's head and layer stack in each format then read the
prompt and that answer in one teacher-forced pass; at every answer position its arg-max
is compared with the reference's token: top-1 agreement, the first position where they
differ (where HearthNet's own greedy answer would first leave the reference's) and mean
KL(fp32 ‖ format).
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
from pathlib import Path
from typing import Any

from hearthnet.bench import machine, table, write_results
from hearthnet.distributed_inference.directory.formats import head_format

PROMPTS = (
    "What is the capital of France, and why is it famous?",
    "Write a short poem about a cat sleeping in the sun.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "Give me three tips for learning to play the guitar.",
    "What is the difference between weather and climate?",
)
GOAL = 0.99  # top-1 agreement the int4 format must reach (M26 §5.7 fidelity)


def gguf_path(name: str) -> Path:
    """`smollm2` (the bundled GGUF) or a .gguf file's path."""
    from hearthnet.models.importer import SMOLLM2_ALIAS, smollm2_gguf_path

    return smollm2_gguf_path() if name == SMOLLM2_ALIAS else Path(name).expanduser()


def reference(path: Path, prompts: list[list[int]], tokens: int
              ) -> list[tuple[list[int], Any]]:
    """For each prompt: transformers' fp32 greedy answer of `tokens` tokens and its (tokens,
    vocab) logits, the GGUF de-quantised by transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM

    load: Any = AutoModelForCausalLM.from_pretrained  # untyped in transformers
    model = load(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # the cache's name in the installed transformers (`cache` from 5.2x, deprecating
    # `past_key_values`): no warning, and no break when the old name goes
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters \
        else "past_key_values"
    out = []
    with torch.inference_mode():
        for ids in prompts:
            step = model(torch.tensor([ids]), use_cache=True)
            answer: list[int] = []
            logits = []
            for _ in range(tokens):
                lg = step.logits[0, -1].float()
                logits.append(lg)
                answer.append(int(lg.argmax()))
                step = model(torch.tensor([answer[-1:]]), use_cache=True,
                             **{name: getattr(step, name)})
            out.append((answer, torch.stack(logits)))
    del model
    return out


def teacher_forced(head: Any, stack: Any, prompt: list[int], answer: list[int]) -> Any:
    """(len(answer), vocab) fp32 logits HearthNet gives at every answer position, reading
    the prompt and the answer in one pass."""
    import torch

    ids = prompt + answer[:-1]
    s = stack.open_session(stack.lo, stack.hi, len(ids))
    with torch.inference_mode():
        h = s.forward(head.embed(ids), 0)
        out = torch.stack([head.logits(h[:, : len(prompt) + i, :])
                           for i in range(len(answer))])
    s.close()
    return out


def score(refs: list[tuple[list[int], Any]], got: list[Any]) -> dict[str, Any]:
    """Top-1 agreement, first divergence per prompt (None: none) and mean KL."""
    agree = kl = 0.0
    n = 0
    first: list[int | None] = []
    for (answer, ref), g in zip(refs, got, strict=True):
        pred = g.argmax(-1).tolist()
        same = [p == a for p, a in zip(pred, answer, strict=True)]
        agree += sum(same)
        n += len(same)
        first.append(next((i for i, ok in enumerate(same) if not ok), None))
        r, q = ref.log_softmax(-1), g.log_softmax(-1)
        kl += float((r.exp() * (r - q)).sum())
    return {"top1_agreement": round(agree / n, 4), "first_divergence": first,
            "mean_kl": max(0.0, round(kl / n, 6)), "positions": n}  # not fp32's −0.0


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Import the GGUF with kept blocks, score every format; returns (figures, report)."""
    import torch

    from hearthnet.distributed_inference.engine.head import LayeredHead
    from hearthnet.distributed_inference.engine.layers import LayeredStack
    from hearthnet.distributed_inference.engine.quant import kernel_of
    from hearthnet.models import ModelStore
    from hearthnet.models.importer import SMOLLM2_ALIAS, SMOLLM2_MODEL_ID, import_gguf

    torch.set_num_threads(args.threads)
    path = gguf_path(args.gguf)
    with tempfile.TemporaryDirectory(prefix="hearthnet-fidelity-") as scratch:
        store = ModelStore(args.store or scratch)
        alias = path.stem.lower()
        entry = store.find(alias) or import_gguf(
            store, path, alias=alias, dtype="gguf",
            model_id=SMOLLM2_MODEL_ID if args.gguf == SMOLLM2_ALIAS else None)
        ref_head = LayeredHead(entry, "fp32", lm_head=False)
        prompts = [ref_head.chat_prompt_ids([{"role": "user", "content": p}])
                   for p in PROMPTS[:args.prompts]]
        refs = reference(path, prompts, args.tokens)
        rows: dict[str, Any] = {}
        for fmt in args.formats:
            hfmt = args.head or head_format(fmt)
            head = LayeredHead(entry, hfmt)
            stack = LayeredStack(entry, 0, entry.num_layers - 1, fmt)
            got = [teacher_forced(head, stack, p, a) for p, (a, _) in
                   zip(prompts, refs, strict=True)]
            rows[fmt] = {**score(refs, got), "head_format": head.format,
                         "kernel": kernel_of(fmt, blocks=True),
                         "layers_mb": round(stack.param_bytes() / 2**20, 1)}
            del stack, head
        store_mb = sum(f.stat().st_size for f in entry.path.glob("*.safetensors")) / 2**20
        f = {"benchmark": "quality", "mode": "gguf", "gguf": str(path),
             "gguf_mb": round(path.stat().st_size / 2**20, 1), "store_mb": round(store_mb, 1),
             "ggml_types": entry.ggml_types, "model_id": entry.model_id,
             "reference": "transformers fp32 (GGUF de-quantised)", "prompts": len(prompts),
             "tokens": args.tokens, "goal_top1": GOAL, "formats": rows,
             "machine": machine()}
    f["results_file"] = str(write_results("quality-gguf", f, Path(args.results_dir)))
    return f, report(f)


def report(f: dict[str, Any]) -> str:
    """The human-readable table of a `run` result."""
    t = table(["format (layers/head)", "top-1 agreement", "first divergence", "mean KL",
               "layers MB"],
              [[f"{k}/{v['head_format']}" + (f" ({v['kernel']})" if v.get("kernel") else ""),
                f"{100 * v['top1_agreement']:.2f} %",
                ",".join("-" if d is None else str(d) for d in v["first_divergence"]),
                f"{v['mean_kl']:.2e}", v["layers_mb"]] for k, v in f["formats"].items()])
    return (f"bench quality --gguf: {f['model_id']} ({Path(f['gguf']).name}, blocks "
            f"{f['ggml_types']}, store {f['store_mb']} MB of a {f['gguf_mb']} MB GGUF) vs "
            f"{f['reference']}, teacher-forced over {f['prompts']} prompts × {f['tokens']} "
            f"tokens (goal ≥ {100 * f['goal_top1']:.0f} %; first divergence per prompt, "
            f"- = none)\n{t}\nwritten to {f['results_file']}")
