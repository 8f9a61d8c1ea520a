"""An emulated home network for benchmarks: one network namespace per node on a bridge, each
node's link shaped by `tc netem` (`hearthnet bench household`).

`Lan` makes a Linux bridge and, per node, a namespace joined to it by a veth pair
(``10.233.0.<11+i>/24`` inside, ``eth0``). A node's link is shaped in both directions by
the profile's `Link` — ``eth0``'s egress is what the node sends, the bridge-side end's
egress what it receives — so a packet between two nodes crosses two shaped links, as it
crosses two radio hops between two Wi-Fi clients of one access point. Profiles (`LINKS`,
`links_for`):

- ``gigabit``: every node on a cable, 0.2 ms each way per link, 1 Gbit/s;
- ``wifi``: every node on Wi-Fi, 2 ms ± 0.5 ms each way per link, 300 Mbit/s, 0.1 % loss;
- ``mixed``: the first node (the one that imports the model and answers the chats, by the
  router) on gigabit, the others on Wi-Fi;
- ``loopback``: no namespaces; every node on 127.0.0.1.

With a ``rate`` netem schedules each packet after the one before, so the jitter delays
packets without reordering them (TCP would read reordering as loss).

A benchmark in this process reaches a node's loopback admin listener inside its namespace
through `NsForward` (a port on this namespace's 127.0.0.1 whose connections are made from a
thread that entered the node's namespace): the client stands on the node's own machine, as
`hearthnet chat` does, and no shaped link lies between them.

Names carry this process's pid (``hnh<pid>…``), so parallel runs do not collide;
`Lan.down` removes every process in the namespaces, the namespaces, the veths and the
bridge, and never raises (it runs on failure and on Ctrl-C). Namespaces need Linux, root
and iproute2; `unavailable` says why they cannot be made, and the benchmark then runs on
the plain loopback and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass

from hearthnet.bench import netem

SUBNET = "10.233.0"  # one bridge per run: runs with the same subnet never share a segment
PROFILES = ("gigabit", "wifi", "mixed", "loopback")
_CLONE_NEWNET = 0x40000000


class LanUnavailable(RuntimeError):
    """The namespaces or the shaping could not be set up here: nothing was measured."""


@dataclass(frozen=True, slots=True)
class Link:
    """One node's link to the household's switch or access point, each direction."""

    name: str
    delay_ms: float
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: int = 0  # 0: not limited

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "delay_ms": self.delay_ms, "jitter_ms": self.jitter_ms,
                "loss_pct": self.loss_pct, "rate_mbit": self.rate_mbit}


LINKS = {"gigabit": Link("gigabit", 0.2, rate_mbit=1000),
         "wifi": Link("wifi", 2.0, 0.5, 0.1, 300)}


def links_for(profile: str, nodes: int) -> list[Link]:
    """Each node's link under `profile` (``loopback``: none)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    if profile == "loopback":
        return []
    if profile == "mixed":  # the importing node by the router, the others on Wi-Fi
        return [LINKS["gigabit"]] + [LINKS["wifi"]] * (nodes - 1)
    return [LINKS[profile]] * nodes


def _ms(x: float) -> str:
    return f"{x:g}ms"


def netem_args(link: Link) -> list[str]:
    """`tc qdisc add … netem` arguments of `link`."""
    out = ["delay", _ms(link.delay_ms)]
    if link.jitter_ms:
        out.append(_ms(link.jitter_ms))
    if link.loss_pct:
        out += ["loss", f"{link.loss_pct:g}%"]
    if link.rate_mbit:
        out += ["rate", f"{link.rate_mbit}mbit"]
    return out


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)


def unavailable() -> str | None:
    """Why shaped namespaces cannot be made here, or None (Linux, root, iproute2, and a
    kernel that makes a namespace and has the netem qdisc)."""
    why = netem.unavailable()
    if why is not None:
        return why
    probe = f"hnh{os.getpid()}probe"
    r = _run("ip", "netns", "add", probe)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    try:
        r = _run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                 "1ms")
        if r.returncode != 0:  # e.g. a kernel built without sch_netem
            return f"`tc qdisc add … netem` failed: {r.stderr.strip().rstrip('.')}"
    finally:
        _run("ip", "netns", "del", probe)
    return None


class Lan:
    """A bridge and one shaped namespace per node; see the module docstring."""

    def __init__(self, links: list[Link], tag: str | None = None) -> None:
        self.tag = tag or f"hnh{os.getpid()}"  # ≤ 15 characters with the suffixes below
        self.links = links
        self.bridge = f"{self.tag}br"
        self.ns = [f"{self.tag}n{i}" for i in range(len(links))]
        self.veth = [f"{self.tag}v{i}" for i in range(len(links))]

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on node `i`'s network."""
        return ["ip", "netns", "exec", self.ns[i]]

    def up(self) -> None:
        """Make the bridge, the namespaces and the shaped links.

        Raises:
            LanUnavailable: a step failed (no netem qdisc in the kernel, …); what was made
                is removed again.
        """
        try:
            self._step("ip", "link", "add", self.bridge, "type", "bridge")
            self._step("ip", "link", "set", self.bridge, "up")
            for i, link in enumerate(self.links):
                ns, veth = self.ns[i], self.veth[i]
                self._step("ip", "netns", "add", ns)
                self._step("ip", "-n", ns, "link", "set", "lo", "up")
                self._step("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                           "netns", ns)
                self._step("ip", "link", "set", veth, "master", self.bridge, "up")
                self._step("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                self._step("ip", "-n", ns, "link", "set", "eth0", "up")
                # multicast (mDNS discovery) leaves by the bridge, as on a real LAN
                self._step("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
                self._step("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "netem",
                           *netem_args(link))  # what the node sends
                self._step("tc", "qdisc", "add", "dev", veth, "root", "netem",
                           *netem_args(link))  # what it receives
        except BaseException:
            self.down()
            raise

    @staticmethod
    def _step(*cmd: str) -> None:
        r = _run(*cmd)
        if r.returncode != 0:
            raise LanUnavailable(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")

    def kill_host(self, i: int) -> None:
        """SIGKILL every process in node `i`'s namespace (the machine dies)."""
        r = _run("ip", "netns", "pids", self.ns[i])
        for pid in r.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def down(self) -> None:
        """Kill every process in the namespaces, delete them, the veths and the bridge
        (idempotent; never raises)."""
        for i in range(len(self.ns)):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.kill_host(i)
                _run("ip", "netns", "del", self.ns[i])  # takes the veth pair with it
                _run("ip", "link", "del", self.veth[i])
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _run("ip", "link", "del", self.bridge)


def _enter_netns(ns: str) -> None:
    """Move the calling thread into namespace `ns` (sockets it makes from now on are there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy `src` to `dst` until `src` ends; then end `dst`'s sending side."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class NsForward:
    """``127.0.0.1:<port>`` in this namespace → ``127.0.0.1:<target>`` in namespace `ns`."""

    def __init__(self, ns: str, target: int) -> None:
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listen.getsockname()[1])
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._error = ""
        threading.Thread(target=self._serve, args=(ns, target), daemon=True,
                         name=f"forward-{ns}").start()
        self._ready.wait(10)
        if self._error or not self._ready.is_set():
            self.close()
            raise LanUnavailable(self._error or f"the forward into {ns} did not start")

    def _serve(self, ns: str, target: int) -> None:
        try:
            _enter_netns(ns)  # this thread only: accepted sockets stay where they were made
        except OSError as e:
            self._error = str(e)
            self._ready.set()
            return
        self._ready.set()
        while True:
            try:
                down, _ = self._listen.accept()
            except OSError:  # closed
                return
            try:
                up = socket.create_connection(("127.0.0.1", target), timeout=10)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            for s in (down, up):  # token frames are small: no Nagle delay on the hop
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        """Stop accepting and end every forwarded connection (idempotent)."""
        with contextlib.suppress(OSError):
            self._listen.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self._listen.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
