"""The user-space link emulator under real namespaces (`hearthnet.bench.lan` with
``shaper="userspace"``, `hearthnet.bench.linkem`): what a household bench relies on when the
kernel has no netem qdisc.

Three namespaces on one emulator: node 0 and node 1 on a 5 ms link, node 2 on a 5 ms link
limited to 20 Mbit/s. A TCP round trip 0 ↔ 1 crosses four links (≥ 20 ms); 2 MB into node
2 takes at least its serialisation at 20 Mbit/s; a multicast datagram from node 0 reaches
nodes 1 and 2. Then `Lan.down` leaves no emulator, namespace or TUN, and an emulator whose
parent is killed outright ends by itself. Skipped with the reason where namespaces or
``/dev/net/tun`` cannot be used.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hearthnet.bench.lan import Lan, Link, enter_netns, pick_shaper
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.netns

FIVE = Link("five", 5.0)
SLOW = Link("slow", 5.0, rate_mbit=20)
PORT = 9310
GROUP = "239.255.77.1"


@pytest.fixture(scope="module")
def userspace_ok() -> None:
    choice = pick_shaper("userspace")
    if choice.name is None:
        pytest.skip(choice.note)


@pytest.fixture(scope="module")
def net(userspace_ok: None) -> Iterator[Lan]:
    lan = Lan([FIVE, FIVE, SLOW], tag=f"hnh{os.getpid()}e", shaper="userspace", seed=1)
    try:
        lan.up()
        yield lan
    finally:
        lan.down()


def _in_ns(ns: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run `fn` on a thread inside namespace `ns`; the returned call joins it and gives
    its result (or raises its error)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(ns)
            box["result"] = fn()
        except BaseException as e:  # carried to the joining thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> Any:
        t.join(30)
        assert not t.is_alive(), f"the thread in {ns} did not finish"
        if "error" in box:
            raise box["error"]
        return box["result"]
    return join


def _listener(lan: Lan, i: int, port: int) -> socket.socket:
    """A TCP listener on node `i`'s address (made in its namespace)."""
    s: socket.socket = _in_ns(lan.ns[i], lambda: socket.create_server((lan.addr(i), port)))()
    return s


def test_a_tcp_round_trip_crosses_four_five_ms_links(net: Lan) -> None:
    srv = _listener(net, 1, PORT)

    def echo() -> None:
        c, _ = srv.accept()
        with c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while d := c.recv(64):
                c.sendall(d)

    def rtts() -> list[float]:
        with socket.create_connection((net.addr(1), PORT), timeout=5) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out = []
            for _ in range(8):
                t = time.perf_counter()
                c.sendall(b"x")
                assert c.recv(64) == b"x"
                out.append((time.perf_counter() - t) * 1000)
            return out

    server = _in_ns(net.ns[1], echo)
    ms = _in_ns(net.ns[0], rtts)()
    server()
    srv.close()
    # sender's uplink + receiver's downlink, each way: 4 × 5 ms; the machine's load adds
    # to single round trips, so the median holds the upper bound
    assert min(ms) >= 20.0, ms
    assert statistics.median(ms) < 30.0, ms


def test_a_rate_limited_link_carries_no_faster_than_its_rate(net: Lan) -> None:
    size = 2_000_000
    srv = _listener(net, 2, PORT + 1)

    def sink() -> int:
        c, _ = srv.accept()
        n = 0
        with c:
            while n < size and (d := c.recv(1 << 20)):
                n += len(d)
            c.sendall(b"k")  # every byte is in: the sender's clock stops
        return n

    def send() -> float:
        with socket.create_connection((net.addr(2), PORT + 1), timeout=30) as c:
            t = time.perf_counter()
            c.sendall(bytes(size))
            assert c.recv(1) == b"k"
            return time.perf_counter() - t

    receiver = _in_ns(net.ns[2], sink)
    took = _in_ns(net.ns[0], send)()
    assert receiver() == size
    srv.close()
    wire = size * 8 / (SLOW.rate_mbit * 1e6)  # 0.8 s at 20 Mbit/s, headers aside
    assert took >= wire, took
    assert took < 4 * wire, took  # and it does carry it at about that rate


def test_multicast_reaches_every_other_namespace(net: Lan) -> None:
    def member(i: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", PORT + 2))
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                     struct.pack("4s4s", socket.inet_aton(GROUP),
                                 socket.inet_aton(net.addr(i))))
        s.settimeout(5)
        return s

    members = [_in_ns(net.ns[i], functools.partial(member, i))() for i in (1, 2)]

    def announce() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
            s.sendto(b"hearth", (GROUP, PORT + 2))

    _in_ns(net.ns[0], announce)()
    for s in members:
        with s:
            data, (src, _) = s.recvfrom(64)
            assert (data, src) == (b"hearth", net.addr(0))


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          check=False).stdout


def test_down_leaves_no_emulator_namespace_or_tun(userspace_ok: None) -> None:
    lan = Lan([FIVE, FIVE], tag=f"hnh{os.getpid()}d", shaper="userspace")
    lan.up()
    assert lan.emulator is not None
    pid = lan.emulator.pid
    links = subprocess.run(["ip", "-n", lan.ns[0], "-d", "link", "show", "eth0"],
                           capture_output=True, text=True, check=True).stdout
    assert "tun" in links and "mtu 65000" in links
    lan.down()
    assert lan.emulator.returncode == 0  # ended by its lifeline, not killed
    assert not Path(f"/proc/{pid}").exists()
    assert not any(ns in _namespaces() for ns in lan.ns)
    assert {"delivered", "lost", "queue_drops", "late_ms_max"} <= set(lan.emulator_stats)
    lan.down()  # idempotent


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie whose new parent has not reaped it yet has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_emulator_ends_when_its_parent_is_killed(userspace_ok: None,
                                                     tmp_path: Path) -> None:
    tag = f"hnh{os.getpid()}k"
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from hearthnet.bench.lan import Lan, Link
        lan = Lan([Link("a", 1.0), Link("b", 1.0)], tag={tag!r}, shaper="userspace")
        lan.up()
        print(lan.emulator.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=60, check=False)
    try:
        assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
        pid = int(p.stdout.split()[0])
        wait_for(lambda: not _alive(pid), timeout=10, what="the orphaned emulator to end")
    finally:
        for ns in (f"{tag}n0", f"{tag}n1"):  # the killed parent could not remove them
            with contextlib.suppress(OSError):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
