"""The kernel's products with its AMX path off and on, alternated in one process.

On a CPU with AMX-INT8, `q4vnni` runs products of several rows in AMX tiles (same
results bit for bit). The VMs these figures come from drift by 20-30 % between runs, so
this compares the two paths inside one process, alternating them for every row count and
keeping the best of ``--runs`` rounds: ``hot`` (one matrix again and again: compute) and
``cold`` (one pass over ``--matrices`` matrices, more than the caches hold: a model's
layers), on one thread, for 8-bit values (int8 per output channel, the 1.5B shape's MLP
matrix) and 4-bit ones (Q4_1 blocks).

    python scripts/amx_rows.py [--rows 1 2 4 8 16 128] [--runs 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hearthnet.distributed_inference.engine import q4vnni
from hearthnet.distributed_inference.engine.quant import best_ms


def _packed(bits: int, n: int, k: int, g: torch.Generator) -> tuple[Any, ...]:
    if bits == 8:
        return q4vnni.pack8_rows(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                                 torch.rand(n, generator=g) * 1e-2 + 1e-3)
    return q4vnni.pack(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g),
                       (torch.rand(n, k // 32, generator=g) * 1e-2).half(),
                       (torch.randn(n, k // 32, generator=g) * 1e-2).half())


def _pass(product: Callable[..., torch.Tensor], x: torch.Tensor, mats: list[Any]) -> None:
    for w in mats:
        product(x, *w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=int, default=8960)
    ap.add_argument("--in", dest="inp", type=int, default=1536)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 128])
    ap.add_argument("--matrices", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not q4vnni.available():
        sys.exit(f"amx_rows: {q4vnni.unavailable_reason()}")
    if not torch.ops.hearthnet.use_amx(True):
        sys.exit("amx_rows: no AMX-INT8 here (CPU, Linux or compiler)")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out: list[dict[str, Any]] = []
    for bits, product in ((8, q4vnni.mm8), (4, q4vnni.mm)):
        mats = [_packed(bits, a.out, a.inp, g) for _ in range(a.matrices)]
        best: dict[tuple[int, bool], list[float]] = {}
        for _ in range(a.runs):
            for m in a.rows:
                x = torch.randn(m, a.inp, generator=g)
                for on in (False, True):
                    torch.ops.hearthnet.use_amx(on)
                    hot = best_ms(partial(product, x, *mats[0]), 10)
                    c = best_ms(partial(_pass, product, x, mats), 1) / len(mats)
                    b = best.setdefault((m, on), [float("inf")] * 2)
                    b[0], b[1] = min(b[0], hot), min(b[1], c)
        print(f"{bits}-bit values, {a.out} × {a.inp}, one thread, best of {a.runs} "
              "alternated rounds: ms (AMX / VNNI)")
        print(f"{'rows':>5} {'hot VNNI':>9} {'hot AMX':>8} {'×':>5} {'cold VNNI':>10} "
              f"{'cold AMX':>9} {'×':>5}")
        for m in a.rows:
            (hv, cv), (ha, ca) = best[(m, False)], best[(m, True)]
            print(f"{m:>5} {hv:>9.3f} {ha:>8.3f} {ha / hv:>5.2f} {cv:>10.3f} {ca:>9.3f} "
                  f"{ca / cv:>5.2f}")
            out.append({"bits": bits, "rows": m, "hot_vnni_ms": round(hv, 3),
                        "hot_amx_ms": round(ha, 3), "cold_vnni_ms": round(cv, 3),
                        "cold_amx_ms": round(ca, 3)})
    torch.ops.hearthnet.use_amx(q4vnni.amx_state().startswith("on"))
    if a.json:
        a.json.write_text(json.dumps({"out": a.out, "in": a.inp, "runs": a.runs,
                                      "figures": out}, indent=1))


if __name__ == "__main__":
    main()
