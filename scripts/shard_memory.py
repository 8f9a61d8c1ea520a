"""Where a shard's resident memory goes, stage by stage, in one process on the CPU.

The memory goal of `hearthnet bench pipeline --context N` (peak RSS of a shard ≤ weights +
1.2 × its caches) counts everything a shard node holds; this shows what that is beside the
weights: the interpreter and the libraries imported, the layers loaded (with the tensors
Python can see beside them), the compiled decode step and round, one session's steps.

    HEARTHNET_DATA_DIR=<store> HEARTHNET_COMPILE=1 python scripts/shard_memory.py \
        --model qwen2.5-1.5b --weights int8 --layers 0 13 [--compiled]

(`hearthnet models synth qwen2.5-1.5b` makes the model). Prints one JSON object: each
stage's RSS, peak, anonymous and file-backed resident MiB (`hearthnet.bench.proc_memory`),
and the bytes of every distinct tensor storage alive after loading against the stack's
`param_bytes`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

from hearthnet.bench import proc_memory  # no torch: the interpreter is measured first

MIB = 2**20


def tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can reach."""
    import torch

    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            st = o.untyped_storage()
            seen.setdefault(st.data_ptr(), st.nbytes())
    return sum(seen.values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--weights", default="int8")
    p.add_argument("--layers", type=int, nargs=2, default=[0, 13], metavar=("LO", "HI"))
    p.add_argument("--compiled", action="store_true",
                   help="compile (or load) the decode step and round (HEARTHNET_COMPILE=1)")
    a = p.parse_args()
    stages: list[dict[str, Any]] = [{"stage": "interpreter", **proc_memory()}]
    import torch
    stages.append({"stage": "torch imported", **proc_memory()})
    import transformers  # noqa: F401 - what a shard imports, measured on its own

    stages.append({"stage": "transformers imported", **proc_memory()})
    from hearthnet.distributed_inference.engine.compiled import compile_dir_of
    from hearthnet.distributed_inference.engine.layers import LayeredStack
    from hearthnet.distributed_inference.engine.memory import release_free_heap
    from hearthnet.models import ModelStore

    stages.append({"stage": "hearthnet engine imported", **proc_memory()})
    torch.set_num_threads(1)
    lo, hi = a.layers
    entry = ModelStore().get(a.model)
    stack = LayeredStack(entry, lo, hi, a.weights, compile_decode=a.compiled,
                         compile_dir=compile_dir_of(entry))
    release_free_heap()
    stages.append({"stage": "layers loaded", **proc_memory(),
                   "weights_mb": round(stack.param_bytes() / MIB, 1),
                   "tensors_mb": round(tensor_bytes() / MIB, 1)})
    steps: dict[str, str] = {}
    if stack.compiled is not None:
        stack.compiled.after_decode = ("round",)
        stack.compiled.start(lo, hi)
        steps = {"decode": stack.compiled.wait(lo, hi),
                 "round": stack.compiled.wait_extra("round", lo, hi)}
        release_free_heap()
        stages.append({"stage": "decode step and round compiled", **proc_memory()})
    g = torch.Generator().manual_seed(0)
    s = stack.open_session(lo, hi, 128)
    s.forward(torch.randn(1, 100, stack.hidden_size, generator=g) * 0.1, 0)
    for i in range(4):
        s.forward(torch.randn(1, 1, stack.hidden_size, generator=g) * 0.1, 100 + i)
    s.close()
    release_free_heap()
    stages.append({"stage": "a 100-position prompt and 4 steps, session closed", **proc_memory()})
    print(json.dumps({"model": a.model, "weights": a.weights, "layers": a.layers,
                      "steps": steps, "stages": stages}))


if __name__ == "__main__":
    from hearthnet.errors import HearthNetError

    try:
        main()
    except HearthNetError as e:  # an unknown model, format or layer range: one line, exit 1
        sys.exit(f"shard_memory: {e}")
