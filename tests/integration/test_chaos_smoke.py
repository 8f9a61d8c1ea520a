"""`hearthnet bench chaos`, the harness itself, cheaply.

The scenarios' behaviour is tested where it lives (test_failover.py, test_status_liveness.py,
test_restart_and_drain.py, test_format_pipeline.py, test_shard_fairness.py); here one
scenario — kill -9 of a shard host mid-answer — runs with one short answer, and the test
checks that the figures are there and add up, and that the fault was injected. A second,
process-free test checks the wrong-format judgement on made-up frames.
"""

from __future__ import annotations

import json

import pytest

from hearthnet.bench.chaos import Answer, judge
from hearthnet.cli import main

# real node processes; about 30 s alone on 2 cores, the limit leaves room for a busy machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_the_kill_scenario_reports_consistent_counts(smollm2, tmp_path, capsys):
    rc = main(["bench", "chaos", "--scenarios", "kill", "--chats", "1", "--tokens", "12",
               "--kill-after", "4", "--results-dir", str(tmp_path), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    f = json.loads(out.out)
    assert json.loads((tmp_path / "chaos.json").read_text())["scenarios"] == f["scenarios"]
    assert f["benchmark"] == "chaos" and (f["tokens"], f["chats"]) == (12, 1)
    assert f["goals"] == {"lost": 0, "wrong_format": 0, "recover_s_max": 10.0}
    assert list(f["scenarios"]) == ["kill"]
    s = f["scenarios"]["kill"]
    assert s["status"] == "ran", s["reason"]
    assert s["started"] == len(s["answers"]) == 1
    assert 0 <= s["completed"] <= s["started"]
    assert 0 <= s["lost"] <= s["started"] and 0 <= s["wrong_format"] <= s["started"]
    assert 0 <= s["lost_tokens"] <= s["started"] * 12
    assert s["lost"] >= s["started"] - s["completed"]  # an unfinished answer is lost
    assert s["lost_orphaned"] == 0 and s["hangs"] == 0
    assert any(e["what"].startswith("SIGKILL node-") for e in s["timeline"])  # it was faulted
    assert s["recover_from"] == "kill"
    assert s["recover_s"] is None or 0 <= s["recover_s"] <= 60
    # kill -9 without a restart: its re-cover is reported, with no goal
    assert set(s["goals"]) == {"lost", "wrong_format", "hangs"}
    for g in s["goals"].values():
        assert set(g) == {"measured", "goal", "met"} and isinstance(g["met"], bool)
    sm = f["summary"]
    assert sm["all_goals_met"] == (not sm["missed"] and not sm["not_run"])
    assert "bench chaos" in out.err and "summary:" in out.err


def test_a_format_the_policy_refuses_is_a_wrong_format_use():
    lossless = frozenset({"fp32", "bf16"})
    frames = [{"type": "shard_status", "status": "ok", "shard_id": "m:0-14@b",
               "layers": [0, 14], "weights_format": "fp32"},
              {"type": "shard_status", "status": "ok", "shard_id": "m:15-29@d",
               "layers": [15, 29], "weights_format": "int8"},
              {"type": "token_delta", "token_id": 7, "text": "x"},
              {"type": "done", "formats": {"head": "fp32", "stages": ["fp32", "int8"]}}]
    default = judge(Answer("node-a", 0, frames=frames, arrivals=[0.0] * 4), [7], lossless)
    assert default["wrong_format"] == ["int8"] and not default["lost"]
    asked = judge(Answer("node-a", 0, frames=frames, arrivals=[0.0] * 4, policy="int8"),
                  [7], lossless)
    assert asked["wrong_format"] == []
    cut = judge(Answer("node-a", 0, frames=frames[:3], arrivals=[0.0] * 3), [7, 8], lossless)
    assert cut["lost"] and not cut["completed"] and cut["lost_tokens"] == 1
