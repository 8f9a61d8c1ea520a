"""`hearthnet bench quality` on the bundled SmolLM2, run in-process with tiny settings:
the figures' structure, the exact format scoring 100 % and no divergence against itself,
and a compact format's figures in range."""

from __future__ import annotations

import json
import re

import torch

from hearthnet.cli import main


def test_bench_quality_scores_formats_against_the_exact_one(smollm2, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:  # one thread: fast enough, and steady beside pytest's other worker
        rc = main(["bench", "quality", "--model", "smollm2", "--formats", "int8",
                   "--positions", "64", "--prompts", "2", "--tokens", "8", "--threads", "1",
                   "--results-dir", str(tmp_path), "--json"])
    finally:
        torch.set_num_threads(threads)  # the command sets it for this whole process
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    f = json.loads(out.out)
    assert json.loads((tmp_path / "quality.json").read_text())["models"] == f["models"]
    assert (f["prompts"], f["tokens"], f["positions"]) == (2, 8, 64)
    m = f["models"]["smollm2"]
    assert m["stored_as"] == "bfloat16" and m["reference"] == "bf16"
    assert set(m["formats"]) == {"bf16", "int8"}  # the exact format is always scored
    ref, q = m["formats"]["bf16"], m["formats"]["int8"]
    assert ref["top1_agreement"] == ref["greedy_agreement"] == 1.0
    assert ref["mean_kl"] == ref["greedy_mean_kl"] == 0.0
    assert ref["first_divergence"] == [None, None] and ref["kernel"] == ""
    for row in (ref, q):
        assert row["positions"] == 64 and row["greedy_positions"] == 16
    assert 0.0 <= q["top1_agreement"] <= 1.0 and 0.0 <= q["greedy_agreement"] <= 1.0
    assert q["mean_kl"] >= 0.0 and q["greedy_mean_kl"] >= 0.0
    assert len(q["first_divergence"]) == 2
    assert all(d is None or 0 <= d < 8 for d in q["first_divergence"])
    assert q["kernel"] and q["head_format"] == "int8"
    assert q["layers_mb"] < ref["layers_mb"]
    # the report: one block per model naming its reference, one row per format
    assert "smollm2 (" in out.err and "reference bf16/bf16" in out.err
    assert "bf16/bf16 (reference)" in out.err
    assert re.search(rf"^int8/int8 +{q['kernel']} ", out.err, re.M)
