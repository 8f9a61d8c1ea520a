"""The user-space link emulator's pure parts (`hearthnet.bench.linkem`): when each packet
arrives over the sender's uplink and the receiver's downlink, in order under jitter, how
many are lost, which node an IPv4 packet is for, and the shaper choice's refusals. The
clock is the `now` each test gives; the random source is seeded."""

from __future__ import annotations

import ipaddress
import itertools
import json
import random

import pytest

from hearthnet.bench import lan, linkem
from hearthnet.bench.lan import LINKS, Link
from hearthnet.bench.linkem import QUEUE_BYTES, Config, Router, Scheduler, loss_probability
from hearthnet.errors import BadRequest

MS = 1e-3


def _ser(size: int, mbit: int) -> float:
    return size * 8 / (mbit * 1e6)


def test_a_packet_crosses_the_senders_uplink_then_the_receivers_downlink():
    s = Scheduler([Link("a", 5.0, rate_mbit=100), Link("b", 1.0, rate_mbit=10)],
                  random.Random(1))
    [(due, dst)] = s.send(100.0, 0, [1], 1500)
    assert dst == 1
    # serialised on a's uplink, a's delay, serialised on b's downlink, b's delay
    assert due == pytest.approx(100.0 + _ser(1500, 100) + 5 * MS + _ser(1500, 10) + 1 * MS)
    [(back, _)] = s.send(200.0, 1, [0], 1500)  # the other way: b's uplink, a's downlink
    assert back == pytest.approx(200.0 + _ser(1500, 10) + 1 * MS + _ser(1500, 100) + 5 * MS)


def test_back_to_back_packets_wait_for_the_link_and_arrive_at_its_rate():
    s = Scheduler([Link("a", 2.0, rate_mbit=8), Link("b", 0.0)], random.Random(1))
    dues = [s.send(0.0, 0, [1], 10_000)[0][0] for _ in range(5)]
    gaps = [b - a for a, b in itertools.pairwise(dues)]
    assert gaps == pytest.approx([_ser(10_000, 8)] * 4)  # 10 ms each at 8 Mbit/s
    assert dues[0] == pytest.approx(_ser(10_000, 8) + 2 * MS)
    # an idle link starts a later packet at once
    assert s.send(1.0, 0, [1], 10_000)[0][0] == pytest.approx(1.0 + dues[0])


def test_an_unlimited_link_takes_only_its_delay():
    s = Scheduler([LINKS["gigabit"], Link("lan", 0.3)], random.Random(1))
    [(due, _)] = s.send(5.0, 1, [0], 60_000)
    assert due == pytest.approx(5.0 + 0.3 * MS + _ser(60_000, 1000) + 0.2 * MS)


def test_jitter_spreads_the_delay_without_reordering():
    wifi = Link("wifi", 2.0, 0.5)  # no loss, no rate: only jitter could reorder
    s = Scheduler([wifi, wifi], random.Random(7))
    sent = [i * 0.1 * MS for i in range(2000)]  # one packet every 0.1 ms, below the jitter
    dues = [s.send(t, 0, [1], 200)[0][0] for t in sent]
    assert dues == sorted(dues)
    delays = [d - t for d, t in zip(dues, sent, strict=True)]
    assert min(delays) >= 3.0 * MS - 1e-12  # two links, each at least 2 - 0.5 ms
    assert max(delays) <= 5.0 * MS + 1e-12
    # spread packets keep the jitter's own spread: ~uniform around 4 ms
    s2 = Scheduler([wifi, wifi], random.Random(8))
    apart = [s2.send(t, 0, [1], 200)[0][0] - t for t in (i * 0.1 for i in range(2000))]
    assert sum(apart) / len(apart) == pytest.approx(4.0 * MS, abs=0.05 * MS)
    assert max(apart) - min(apart) > 1.5 * MS


def test_loss_is_scaled_to_the_packets_size_and_counted():
    assert loss_probability(0.1, 1500) == pytest.approx(0.001)
    assert loss_probability(0.1, 65_000) == pytest.approx(1 - 0.999 ** (65_000 / 1500))
    assert loss_probability(0.0, 65_000) == 0.0
    lossy = Link("lossy", 1.0, loss_pct=10.0)
    for size, p in ((1500, 0.1), (15_000, 1 - 0.9**10)):
        s = Scheduler([lossy, Link("clean", 1.0)], random.Random(3))
        n = 20_000
        kept = sum(len(s.send(i * MS, 0, [1], size)) for i in range(n))
        lost = n - kept
        sigma = (n * p * (1 - p)) ** 0.5
        assert abs(lost - n * p) < 4 * sigma, (size, lost, n * p)
        assert s.counts() == {"lost": lost, "queue_drops": 0}


def test_a_full_queue_drops_the_tail():
    s = Scheduler([Link("slow", 0.0, rate_mbit=1), Link("b", 0.0)], random.Random(1))
    size = 60_000
    fits = QUEUE_BYTES // size  # bytes not yet serialised, the one on the wire included
    got = [len(s.send(0.0, 0, [1], size)) for _ in range(fits + 5)]
    assert got == [1] * fits + [0] * 5
    assert s.counts()["queue_drops"] == 5
    # once the link has drained, packets are taken again
    assert s.send(10.0, 0, [1], size)


def test_multicast_crosses_the_uplink_once_and_each_downlink():
    s = Scheduler([Link("a", 1.0, rate_mbit=10), Link("b", 2.0), Link("c", 3.0)],
                  random.Random(1))
    out = dict((dst, due) for due, dst in s.send(0.0, 0, [1, 2], 1000))
    up = _ser(1000, 10) + 1 * MS
    assert out == pytest.approx({1: up + 2 * MS, 2: up + 3 * MS})
    assert s.send(0.0, 0, [], 1000) == []


def _ipv4(dst: str, src: str = "10.233.0.11") -> bytes:
    header = bytearray(20)
    header[0] = 0x45
    header[12:16] = ipaddress.IPv4Address(src).packed
    header[16:20] = ipaddress.IPv4Address(dst).packed
    return bytes(header) + b"payload"


def test_the_router_finds_the_receiver_by_the_destination_address():
    r = Router(["10.233.0.11", "10.233.0.12", "10.233.0.13"], 24)
    assert r.destinations(0, _ipv4("10.233.0.13")) == [2]
    assert r.destinations(0, _ipv4("10.233.0.11")) == []  # itself: never on the wire
    assert r.destinations(1, _ipv4("224.0.0.251")) == [0, 2]  # mDNS: every other node
    assert r.destinations(2, _ipv4("10.233.0.255")) == [0, 1]
    assert r.destinations(2, _ipv4("255.255.255.255")) == [0, 1]
    assert r.destinations(0, _ipv4("10.233.0.99")) == []  # nobody there
    assert r.destinations(0, _ipv4("8.8.8.8")) == []
    assert r.destinations(0, b"\x60" + bytes(39)) == []  # IPv6
    assert r.destinations(0, b"\x45" + bytes(10)) == []  # truncated
    with pytest.raises(BadRequest, match="repeat"):
        Router(["10.233.0.11", "10.233.0.11"], 24)


@pytest.mark.parametrize("link, why", [
    (Link("x", -1.0), "≥ 0"), (Link("x", 1.0, rate_mbit=-5), "≥ 0"),
    (Link("x", 1.0, 2.0), "jitter"), (Link("x", 1.0, loss_pct=101.0), "loss"),
])
def test_links_the_emulator_cannot_stand_for_are_refused(link, why):
    with pytest.raises(BadRequest, match=why):
        Scheduler([link], random.Random(1))


def test_the_config_travels_as_json_and_bad_configs_are_refused():
    cfg = Config(["n0", "n1"], ["10.233.0.11", "10.233.0.12"], [LINKS["wifi"]] * 2, seed=4)
    assert Config.from_json(cfg.to_json()) == cfg
    for bad in ("{", "[]", json.dumps({"namespaces": ["a"]}),
                json.dumps({**json.loads(cfg.to_json()), "addrs": ["10.233.0.11"]}),
                json.dumps({**json.loads(cfg.to_json()), "namespaces": []})):
        with pytest.raises(BadRequest, match="config"):
            Config.from_json(bad)


def test_the_emulator_process_refuses_a_bad_config_in_one_line(capsys):
    assert linkem.main(["{not json"]) == 1
    assert linkem.main([]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith("link emulator: ") for e in err)
    assert "Traceback" not in "".join(err)


def test_an_unknown_shaper_is_refused_before_any_work():
    with pytest.raises(ValueError, match="unknown shaper 'tc'"):
        lan.pick_shaper("tc")
    with pytest.raises(ValueError, match="unknown shaper"):
        lan.Lan([LINKS["wifi"]], shaper="kernel")


def test_the_timer_learns_how_late_it_wakes_and_a_stall_does_not_teach_it_much(request):
    sw = linkem.Switch([], Router(["10.233.0.11"], 24), Scheduler([LINKS["wifi"]],
                                                                   random.Random(1)))
    sw.timer.armed_ns = 10**12
    request.addfinalizer(sw.close)
    for _ in range(300):
        sw._woke(10**12 + 100_000)  # 0.1 ms after its time, every time
    assert sw.wake_s == pytest.approx(0.1 * MS, rel=0.01)
    sw._woke(10**12 + 50_000_000)  # one 50 ms scheduling stall
    assert sw.wake_s < 0.1 * MS + 0.05 * linkem.WAKE_CAP_S + 1e-12
    sw._woke(10**12 - 5_000)  # an early wake-up counts as on time
    assert sw.wake_s >= 0


@pytest.mark.parametrize("ns, netem, tun, requested, expect", [
    (None, None, None, "auto", ("netem", "links shaped by tc netem")),
    (None, "no netem", None, "auto",
     ("userspace", "links emulated in user space: this kernel has no netem qdisc")),
    (None, None, None, "userspace", ("userspace", "links emulated in user space "
                                                  "(--shaper userspace)")),
    (None, "no netem", None, "netem", (None, "no netem")),
    (None, "no netem", "no tun", "auto", (None, "no netem; and no tun")),
    (None, None, "no tun", "userspace", (None, "no tun")),
    ("not root", None, None, "auto", (None, "not root")),
])
def test_the_shaper_is_netem_where_the_kernel_has_it_else_the_emulator(
        monkeypatch, ns, netem, tun, requested, expect):
    monkeypatch.setattr(lan, "unavailable", lambda: ns)
    monkeypatch.setattr(lan, "netem_missing", lambda: netem)
    monkeypatch.setattr(lan, "tun_missing", lambda: tun)
    choice = lan.pick_shaper(requested)
    assert (choice.name, choice.note) == expect
