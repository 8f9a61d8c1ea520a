"""What a product of int8 weights costs per activation row, in the kernel this CPU runs.

A decode step of one chat reads every weight once and is bound by memory; a round of B
chats' rows (or a prefill piece of B positions) reads them once too, and once the rows'
integer dot products take longer than the read, it is bound by the CPU's dot-product
throughput. This prints both for one (out × in) matrix, on one thread:

- ``hot``: the same matrix again and again (it stays in the caches): the product's compute;
- ``cold``: one pass over ``--matrices`` different matrices (more than the caches hold),
  as a model's layers are read: memory and compute together.

    python scripts/kernel_rows.py [--out 8960 --in 1536] [--rows 1 2 4 8 16 32]

Prints a table and writes JSON (``--json FILE``). The kernel is the one int8 layers run in
here (`quant.int8_kernel_name()`: ``int8-vnni`` where AVX-512 VNNI builds, else torch's),
and whether its AMX path is on (``HEARTHNET_AMX=off`` runs the same rows without it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hearthnet.distributed_inference.engine import q4vnni, quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=int, default=8960, help="output features (default: the "
                    "1.5B shape's MLP)")
    ap.add_argument("--in", dest="inp", type=int, default=1536, help="input features")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--matrices", type=int, default=40,
                    help="distinct matrices of the cold pass (default 40: ~550 MB)")
    ap.add_argument("--runs", type=int, default=5, help="best of this many")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kernel = quant.int8_kernel_name()
    mats = []
    for _ in range(a.matrices):
        w = torch.randn(a.out, a.inp) * 0.02
        mats.append(quant.Int8Linear(w, None, kernel=kernel))
    mb = a.out * a.inp / 1e6
    rows: list[dict[str, float]] = []
    for m in a.rows:
        x = torch.randn(1, m, a.inp)
        hot = quant.best_ms(lambda x=x: mats[0](x), 4 * a.runs)
        cold = quant.best_ms(lambda x=x: [lin(x) for lin in mats], a.runs) / len(mats)
        rows.append({"rows": m, "hot_ms": round(hot, 3), "cold_ms": round(cold, 3),
                     "cold_gb_s": round(mb / cold, 2)})
    one = rows[0]
    amx = q4vnni.amx_state() if kernel == q4vnni.INT8_KERNEL else ""
    print(f"int8 ({kernel}) product of a {a.out} × {a.inp} matrix, one thread, best of "
          f"{a.runs}; ratios to {one['rows']} row(s)" + (f"\nAMX tiles: {amx}" if amx else ""))
    print(f"{'rows':>5} {'hot ms':>8} {'×':>6} {'cold ms':>8} {'×':>6} {'GB/s':>6}")
    for r in rows:
        print(f"{r['rows']:>5} {r['hot_ms']:>8.3f} {r['hot_ms'] / one['hot_ms']:>6.2f} "
              f"{r['cold_ms']:>8.3f} {r['cold_ms'] / one['cold_ms']:>6.2f} "
              f"{r['cold_gb_s']:>6.1f}")
    if a.json:
        a.json.write_text(json.dumps({"kernel": kernel, "amx": amx, "out": a.out, "in": a.inp,
                                      "matrices": a.matrices, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
