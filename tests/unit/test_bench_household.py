"""`hearthnet bench household`'s pure parts: the links' tc arguments, the budgets, coverage
from `/status`, the not-covered failure, the figures' summary and goals (the household
itself runs in tests/integration/test_bench_household.py, `make bench`)."""

from __future__ import annotations

import argparse
import os

import pytest

from hearthnet.bench import household, lan
from hearthnet.errors import BadRequest

MIB = 2**20


def test_profiles_give_the_issues_links_as_tc_netem_arguments():
    wifi, = lan.links_for("wifi", 1)
    assert lan.netem_args(wifi) == ["delay", "2ms", "0.5ms", "loss", "0.1%", "rate", "300mbit"]
    gig, = lan.links_for("gigabit", 1)
    assert lan.netem_args(gig) == ["delay", "0.2ms", "rate", "1000mbit"]
    # mixed: the importing node by the router on a cable, the others on Wi-Fi
    assert [lk.name for lk in lan.links_for("mixed", 3)] == ["gigabit", "wifi", "wifi"]
    assert lan.links_for("loopback", 3) == []
    with pytest.raises(ValueError, match="unknown profile"):
        lan.links_for("dialup", 3)


def test_lan_names_carry_the_pid_and_fit_linux_interface_names():
    net = lan.Lan(lan.links_for("wifi", 12))
    names = [net.bridge, *net.veth, *net.ns]
    assert all(str(os.getpid()) in n for n in names)
    assert len(set(names)) == len(names)
    assert max(len(n) for n in [net.bridge, *net.veth]) <= 15  # IFNAMSIZ - 1
    assert net.addr(0) != net.addr(11) and net.exec_prefix(2)[-1] == net.ns[2]


def test_budgets_are_a_fraction_of_the_layers_as_held():
    held = 30 * 10 * MIB  # 30 layers of 10 MiB
    assert household.budgets_mb(held, 30, 3, 0.4, None) == [120, 120, 120]  # 12 layers each
    assert household.budgets_mb(held, 30, 2, 0.5, "150,200") == [150, 200]


@pytest.mark.parametrize("explicit", ["150", "150,x", "150,0", "1,2,3"])
def test_a_malformed_budget_list_is_refused_before_anything_starts(explicit):
    with pytest.raises(BadRequest, match="--budgets-mb must be 2 positive integers"):
        household.budgets_mb(300 * MIB, 30, 2, 0.4, explicit)


def test_budgets_that_cannot_hold_the_model_are_refused_with_the_count():
    # 2 × 12 layers of 30: the model could never be covered
    with pytest.raises(BadRequest, match="hold 24 of the model's 30 layers"):
        household.budgets_mb(300 * MIB, 30, 2, 0.4, None)


def _status(shards, covered=True, fetches=None):
    st = {"shards": [{"model_id": "m/id", "host": h, "layers": r, "state": state,
                      "usable": True} for h, r, state in shards],
          "models": [{"alias": "m", "fully_covered": covered}]}
    if fetches is not None:
        st["fetches"] = fetches
    return st


def test_split_counts_only_online_shards_of_the_model():
    st = _status([("node-2", [10, 19], "ok"), ("node-1", [0, 9], "ok"),
                  ("node-3", [20, 29], "offline")])
    st["shards"].append({"model_id": "other", "host": "node-3", "layers": [0, 5],
                         "state": "ok", "usable": True})
    assert household.split_of(st, "m/id") == {"node-1": [[0, 9]], "node-2": [[10, 19]]}
    assert household.covered(st, "m") and not household.covered(st, "x")
    assert household.layer_count([[0, 9], [5, 14]]) == 15


def test_fetched_bytes_sum_the_models_fetches_and_none_without_fetch_support():
    st = _status([], fetches=[{"model": "m", "bytes_done": 100},
                              {"model": "m/id", "bytes_done": 20},
                              {"model": "other", "bytes_done": 7}])
    got = household.fetched_bytes(st, ("m", "m/id"))
    assert got is not None and got[0] == 120 and len(got[1]) == 2
    assert household.fetched_bytes(_status([]), ("m",)) is None


def test_not_covered_names_the_nodes_holding_nothing():
    msg = household.not_covered_message(600, ["node-1", "node-2", "node-3"],
                                        {"node-1": [[0, 11]]}, fetch_reported=False)
    assert msg.startswith("the model was not covered within 600 s: nodes node-2, node-3 "
                          "hold nothing")
    assert "cannot fetch" in msg
    msg = household.not_covered_message(60, ["node-1"], {"node-1": [[0, 29]]}, True)
    assert msg == "the model was not covered within 60 s"


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_wait_covered_times_the_first_cover_and_waits_for_a_still_split():
    clock = FakeClock()
    split = [("node-1", [0, 14], "ok"), ("node-2", [15, 29], "ok")]

    def status():  # covered from t = 2 s; node-3 joins at 3 s, then nothing moves
        if clock.t < 2:
            return _status(split[:1], covered=False)
        return _status(split + ([("node-3", [0, 5], "ok")] if clock.t >= 3 else []))

    first, got = household.wait_covered(status, "m", "m/id", 60, clock, clock.sleep,
                                        settle=3.0)
    assert first == 2.0
    assert set(got) == {"node-1", "node-2", "node-3"} and 6.0 <= clock.t <= 7.0


def test_wait_covered_gives_up_after_the_timeout():
    clock = FakeClock()
    first, got = household.wait_covered(
        lambda: _status([("node-1", [0, 9], "ok")], covered=False), "m", "m/id", 30,
        clock, clock.sleep)
    assert first is None and got == {"node-1": [[0, 9]]} and clock.t == pytest.approx(30.0)


def test_summary_takes_medians_over_runs():
    runs = [{"tokens_per_second": tps, "first_token_ms": ft, "client_first_token_ms": ft + 5,
             "completion_tokens": 48} for tps, ft in ((10.0, 300.0), (12.0, 200.0),
                                                       (11.0, 250.0))]
    s = household.summary(runs)
    assert s["tokens_per_second"] == 11.0 and s["first_token_ms"] == 250.0
    assert s["client_first_token_ms"] == 255.0 and s["completion_tokens"] == 48


def _figures(profile="wifi", applied=True, import_on="one", ratio=0.9, fetch=1.05):
    return {"budget_fraction_of_layers": 0.4, "import_on": import_on,
            "link": {"profile": profile, "applied": applied, "why_not": None, "links": []},
            "coverage": {"covered": True, "nodes": {
                "node-1": {"fetch_ratio": 0.0, "imported": True},
                "node-2": {"fetch_ratio": fetch, "imported": False}}},
            "single": {"completion_tokens": 48}, "ratio_to_loopback": ratio}


def test_goals_check_budgets_fetches_and_the_wifi_ratio():
    g = household.goals(_figures())
    assert {k: v["met"] for k, v in g.items()} == {
        "budget_fraction": True, "covered": True, "fetch_ratio": True,
        "chat_answered": True, "wifi_ratio_to_loopback": True}
    g = household.goals(_figures(ratio=0.8, fetch=1.3))
    assert not g["wifi_ratio_to_loopback"]["met"] and not g["fetch_ratio"]["met"]
    # no Wi-Fi shaped (netem missing) or every store imported: those goals are not claimed
    g = household.goals(_figures(applied=False, import_on="all"))
    assert "wifi_ratio_to_loopback" not in g and "fetch_ratio" not in g


def test_the_plans_prediction_is_a_goal_only_when_it_was_made():
    f = _figures()
    assert "plan_ratio" not in household.goals(f)  # no prediction (the split left a gap)
    for ratio, met in ((0.99, True), (1.3, False)):
        f["prediction"] = {"engine_vs_measured": {"ratio_single": ratio,
                                                  "within_25_percent": abs(ratio - 1) <= .25}}
        assert household.goals(f)["plan_ratio"] == {"measured": ratio, "goal": "0.75..1.25",
                                                    "met": met}


def test_household_options_refuse_a_one_node_household_and_bad_fractions():
    p = argparse.ArgumentParser(exit_on_error=False)
    household.add_args(p)
    a = p.parse_args([])
    assert (a.nodes, a.profile, a.import_on, a.budget_fraction, a.concurrency) == (
        3, "wifi", "all", 0.4, [1, 8])
    for bad in (["--nodes", "1"], ["--budget-fraction", "0"], ["--budget-fraction", "1.5"],
                ["--profile", "dialup"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            p.parse_args(bad)


def test_layers_fetched_for_a_shard_still_loading_are_waited_for() -> None:
    rows = [{"state": "done", "layers": [18, 27]}, {"state": "done", "layers": [11, 11]},
            {"state": "running", "layers": [5, 5]}, {"state": "done", "layers": None}]
    # covered with 18-27 served; the second range is fetched but not hosted yet
    assert household.unhosted_fetches(rows, [[18, 27]]) == [[11, 11]]
    assert household.unhosted_fetches(rows, [[11, 11], [18, 27]]) == []
