"""`hearthnet bench pipeline --netem DELAY` (`hearthnet.bench.netem`): what a hop costs, how
it is split over the two node links a packet crosses, and bad values refused before any
work. The shaped namespaces themselves are measured in tests/netns/test_netem_pipeline.py.
"""

from __future__ import annotations

import argparse
import math

import pytest

from hearthnet.bench import lan, netem, pipeline
from hearthnet.bench.lan import ShaperChoice
from hearthnet.errors import BadRequest


@pytest.mark.parametrize("text, delay, jitter, loss", [
    ("2ms 0.5ms", 2.0, 0.5, 0.0),
    ("delay 2ms 0.5ms", 2.0, 0.5, 0.0),
    ("1s", 1000.0, 0.0, 0.0),
    ("500us 100usec", 0.5, 0.1, 0.0),
    ("2msec 0.5ms loss 0.1%", 2.0, 0.5, 0.1),
])
def test_netem_delay_arguments_are_read_with_their_units(text, delay, jitter, loss):
    hop = netem.parse(text)
    assert (hop.delay_ms, hop.jitter_ms, hop.loss_pct) == pytest.approx((delay, jitter, loss))


def test_each_node_link_carries_half_the_hop_so_a_packet_pays_it_once():
    hop = netem.parse("2ms 0.5ms loss 1%")
    link = hop.per_link()
    # a packet crosses the sender's uplink and the receiver's downlink
    assert 2 * link.delay_ms == hop.delay_ms and 2 * link.jitter_ms == hop.jitter_ms
    kept_on_two = (1 - link.loss_pct / 100) ** 2
    assert 1 - kept_on_two == pytest.approx(hop.loss_pct / 100)
    assert lan.netem_args(link) == ["delay", "1ms", "0.25ms", "loss",
                                    f"{link.loss_pct:g}%"]
    assert netem.parse("3ms").per_link().loss_pct == 0.0
    assert math.isclose(netem.parse("3ms").per_link().delay_ms, 1.5)


@pytest.mark.parametrize("text, says", [
    ("", "TIME [JITTER]"),
    ("2", "'2' is not a time with a unit"),  # tc would read microseconds
    ("fast", "'fast' is not a time"),
    ("2ms 0.5ms rate 10mbit", "TIME [JITTER]"),
    ("2ms 0.5ms 25%", "TIME [JITTER]"),
    ("2ms 0.5ms loss lots", "'lots' is not a percentage"),
    ("2ms 3ms", "the jitter is above the delay"),
    ("2ms loss 120%", "a loss above 100 %"),
    ("-1ms", "'-1ms' is not a time"),
])
def test_a_bad_delay_is_a_typed_error_that_says_what_is_wrong(text, says):
    with pytest.raises(BadRequest) as e:
        netem.parse(text)
    assert says in e.value.message


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    pipeline.add_args(p)
    return p.parse_args([a for k, v in kw.items() for a in (f"--{k}", v)])


def test_bench_pipeline_refuses_a_bad_delay_before_opening_any_store(monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("work began before --netem was checked")

    monkeypatch.setattr(pipeline, "_run", no_work)
    monkeypatch.setattr(lan, "pick_shaper", no_work)
    with pytest.raises(BadRequest, match="TIME"):
        pipeline.run(_args(netem="2 ms"))


def test_the_shaper_is_asked_for_by_name(monkeypatch):
    monkeypatch.setattr(lan, "unavailable", lambda: None)
    monkeypatch.setattr(lan, "netem_missing", lambda: "no netem qdisc")
    monkeypatch.setattr(lan, "tun_missing", lambda: None)
    c = netem.choose("2ms 0.5ms", "auto")
    assert (c.shaper, c.why_not) == ("userspace", None)
    s = c.settings()
    assert s["applied"] and s["shaper"] == "userspace" and s["delay"] == "2ms 0.5ms"
    assert s["per_link"]["delay_ms"] == 1.0 and s["per_link"]["jitter_ms"] == 0.25
    assert "half the delay" in s["semantics"]
    text = netem.describe(s)
    assert "each hop delayed 2ms 0.5ms" in text and "1 ms ± 0.25 ms" in text
    assert "no netem qdisc" in text  # the report says which shaper
    lan_ = c.lan(3)
    assert lan_ is not None and lan_.requested == "auto"
    assert lan_.links == [c.hop.per_link()] * 3
    assert netem.choose("2ms", "netem").why_not == "no netem qdisc"
    with pytest.raises(BadRequest, match="unknown shaper"):
        netem.choose("2ms", "kernel")


def test_without_namespaces_the_figures_say_the_loopback_and_why(monkeypatch):
    monkeypatch.setattr(lan, "pick_shaper",
                        lambda requested="auto": ShaperChoice(None, "network namespaces "
                                                                    "need root"))
    c = netem.choose("2ms 0.5ms")
    assert c.lan(3) is None
    s = c.settings()
    assert not s["applied"] and s["shaper"] is None
    assert s["why_not"] == "network namespaces need root"
    assert netem.describe(s) == ("loopback (--netem 2ms 0.5ms not applied: network "
                                 "namespaces need root)")
    assert netem.describe(netem.NOT_ASKED) == "loopback"
