"""`hearthnet bench quality`: what a compact weight format costs in answers against fp32.

Teacher-forced next-token prediction over a fixed English text the project ships
(`hearthnet/bench/data/quality.txt`, a snapshot of docs/security.md): the text is cut into
windows of ``--window`` tokens; each window runs through a local engine of every format
and through the fp32 reference; at every position the formats' next-token distributions
are compared with the reference's: top-1 agreement (same arg-max) and mean KL(fp32 ‖
format). Both use the same layer stack and head code as shards and orchestrators do.

With ``--gguf smollm2|FILE.gguf`` it measures instead what holding a GGUF's own blocks costs
against transformers running the GGUF de-quantised to fp32 (`bench/fidelity.py`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hearthnet.argtypes import positive
from hearthnet.bench import machine, table, write_results
from hearthnet.distributed_inference.directory.formats import (
    HEAD_FORMATS,
    HELD_FORMATS,
    head_format,
)

TEXT = Path(__file__).parent / "data" / "quality.txt"


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench quality`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store")
    p.add_argument("--formats", nargs="+", default=None, choices=HELD_FORMATS,
                   help="formats compared with fp32 (default bf16 int8 int4; with --gguf "
                        "int4 int8 bf16 fp32)")
    p.add_argument("--positions", type=int, default=2048, help="positions scored (≥ 2000)")
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--threads", type=positive, default=2, help="torch threads")
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for quality.json (default bench-results)")
    p.add_argument("--gguf", default=None, metavar="smollm2|FILE.gguf",
                   help="fidelity of a GGUF's kept blocks against transformers' fp32 "
                        "de-quantisation of the same file (quality-gguf.json)")
    p.add_argument("--prompts", type=positive, default=5, help="--gguf: prompts (≤ 5)")
    p.add_argument("--tokens", type=positive, default=64,
                   help="--gguf: answer tokens per prompt")
    p.add_argument("--head", default=None, choices=HEAD_FORMATS,
                   help="--gguf: the head's format (default: the one that goes with each "
                        "layers format)")
    p.add_argument("--store", default=None,
                   help="--gguf: store to import into (default: a scratch folder)")


def _all_logits(head: Any, stack: Any, ids: list[int]) -> Any:
    """(T, vocab) fp32 next-token logits at every position of `ids`."""
    import torch

    s = stack.open_session(stack.lo, stack.hi, len(ids))
    with torch.inference_mode():
        h = s.forward(head.embed(ids), 0)
        out = torch.stack([head.logits(h[:, : i + 1, :]) for i in range(h.shape[1])])
    s.close()
    return out


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Score every format against fp32; returns (figures, report)."""
    import torch

    if args.gguf:
        from hearthnet.bench import fidelity

        args.formats = args.formats or ["int4", "int8", "bf16", "fp32"]
        return fidelity.run(args)
    args.formats = args.formats or ["bf16", "int8", "int4"]
    from hearthnet.distributed_inference.engine.head import LayeredHead
    from hearthnet.distributed_inference.engine.layers import LayeredStack
    from hearthnet.models import ModelStore

    torch.set_num_threads(args.threads)
    entry = ModelStore().get(args.model)
    ref_head = LayeredHead(entry, "fp32")
    ids = ref_head.tokenizer(TEXT.read_text())["input_ids"]
    windows = [ids[i:i + args.window + 1] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]
    n_pos = min(args.positions, sum(len(w) for w in windows))
    ref_stack = LayeredStack(entry, 0, entry.num_layers - 1, "fp32")
    refs = [_all_logits(ref_head, ref_stack, w) for w in windows]
    del ref_stack
    rows: dict[str, Any] = {}
    for fmt in args.formats:
        head = LayeredHead(entry, head_format(fmt))
        stack = LayeredStack(entry, 0, entry.num_layers - 1, fmt)
        agree = kl = 0.0
        n = 0
        for w, ref in zip(windows, refs, strict=True):
            got = _all_logits(head, stack, w)
            take = min(len(w), n_pos - n)
            r, g = ref[:take].log_softmax(-1), got[:take].log_softmax(-1)
            agree += float((r.argmax(-1) == g.argmax(-1)).sum())
            kl += float((r.exp() * (r - g)).sum())
            n += take
            if n >= n_pos:
                break
        rows[fmt] = {"top1_agreement": round(agree / n, 4), "mean_kl": round(kl / n, 5),
                     "positions": n, "layers_mb": round(stack.param_bytes() / 2**20, 1),
                     "head_format": head.format}
        del stack, head
    f = {"benchmark": "quality", "model": args.model, "model_id": entry.model_id,
         "reference": "fp32", "text": TEXT.name, "text_tokens": len(ids),
         "window": args.window, "formats": rows, "machine": machine()}
    f["results_file"] = str(write_results("quality", f, Path(args.results_dir)))
    return f, report(f)


def report(f: dict[str, Any]) -> str:
    """The human-readable table of a `run` result."""
    t = table(["format (layers/head)", "top-1 agreement", "mean KL (nats)", "positions",
               "layers MB"],
              [[f"{k}/{v['head_format']}", f"{100 * v['top1_agreement']:.2f} %", v["mean_kl"],
                v["positions"], v["layers_mb"]] for k, v in f["formats"].items()])
    return (f"bench quality: {f['model_id']} vs fp32, next-token prediction over "
            f"{f['text']} (windows of {f['window']} tokens)\n{t}\nwritten to "
            f"{f['results_file']}")
