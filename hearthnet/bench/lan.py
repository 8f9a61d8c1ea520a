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

`LanMesh` starts a `LocalMesh`'s node processes each in its namespace, listening on its LAN
address (`bench household`, and `bench pipeline --netem` through `hearthnet.bench.netem`);
`terminate_as_interrupt` makes a SIGTERM a Ctrl-C while they stand, so that every
`finally` removes what was made.

A benchmark in this process reaches a node's loopback admin listener inside its namespace
through `NsForward` (a port on this namespace's 127.0.0.1 whose connections are made from a
thread that entered the node's namespace): the client stands on the node's own machine, as
`hearthnet chat` does, and no shaped link lies between them.

Two shapers give the same links (`pick_shaper`, ``--shaper``):

- ``netem``: the veth pairs on a bridge above, shaped by ``tc netem`` in the kernel;
- ``userspace``: for kernels built without the netem qdisc (some VMs and CI runners): each
  namespace's ``eth0`` is a TUN device of one emulator process (`hearthnet.bench.linkem`)
  that switches the packets between the nodes and applies both links' delay, jitter, loss
  and rate itself; ``eth0`` gets an MTU of `MTU` so the kernel's TCP sends few, big
  segments (Python cannot switch 1500-byte packets at 300 Mbit/s);
- ``auto`` (the default): ``netem`` where the kernel has it, else ``userspace``.

Names carry this process's pid (``hnh<pid>…``), so parallel runs do not collide;
`Lan.down` removes every process in the namespaces, the emulator, the namespaces, the
veths and the bridge, and never raises (it runs on failure and on Ctrl-C). Namespaces need
Linux, root and iproute2 (and ``/dev/net/tun`` for ``userspace``); `pick_shaper` says why
they cannot be made, and the benchmark then runs on the plain loopback and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hearthnet.bench.linkem import MTU, Config
from hearthnet.bench.linkem import Link as Link  # the emulator's link model, a profile's
from hearthnet.bench.linkem import enter_netns as enter_netns
from hearthnet.errors import HearthNetError
from hearthnet.mesh.launcher import LocalMesh, NodeProc, NodeSpec, node_toml
from hearthnet.security.provision import provision

SUBNET = "10.233.0"  # one bridge per run: runs with the same subnet never share a segment
PROFILES = ("gigabit", "wifi", "mixed", "loopback")
SHAPERS = ("auto", "netem", "userspace")


class LanUnavailable(RuntimeError):
    """The namespaces or the shaping could not be set up here: nothing was measured."""


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
    """Why network namespaces cannot be made here, or None (Linux, root, iproute2, and a
    kernel that makes a namespace)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not installed"
    probe = f"hnh{os.getpid()}probe"
    r = _run("ip", "netns", "add", probe)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe)
    return None


@functools.cache
def netem_missing() -> str | None:
    """Why the kernel cannot shape with ``tc netem``, or None (asked once per process: a
    namespace is made to try it)."""
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


def tun_missing() -> str | None:
    """Why the user-space shaper cannot make TUN devices here, or None."""
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun does not exist"
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "/dev/net/tun is not readable and writable"
    return None


def add_shaper_arg(p: argparse.ArgumentParser, when: str = "") -> None:
    """The ``--shaper`` option of the benchmarks that shape links (`when`: its
    condition, e.g. "with --netem, ")."""
    p.add_argument("--shaper", choices=SHAPERS, default="auto",
                   help=f"{when}how the links are shaped: netem (the kernel's qdisc), "
                        "userspace (an emulator process, for kernels without netem) or auto: "
                        "netem where the kernel has it (default auto)")


@dataclass(frozen=True, slots=True)
class ShaperChoice:
    """The shaper a `Lan` uses, and what the report says about it."""

    name: str | None  # "netem", "userspace", or None: no shaped namespaces here
    note: str  # how the links are shaped, or why they cannot be


def pick_shaper(requested: str = "auto") -> ShaperChoice:
    """The shaper for `requested` (one of `SHAPERS`): ``auto`` takes netem where the
    kernel has it, else the user-space emulator.

    Raises:
        ValueError: `requested` is not one of `SHAPERS`.
    """
    if requested not in SHAPERS:
        raise ValueError(f"unknown shaper {requested!r}; known: {', '.join(SHAPERS)}")
    why = unavailable()
    if why is not None:
        return ShaperChoice(None, why)
    no_netem = netem_missing() if requested != "userspace" else None
    if requested == "netem" or (requested == "auto" and no_netem is None):
        if no_netem is not None:
            return ShaperChoice(None, no_netem)
        return ShaperChoice("netem", "links shaped by tc netem")
    no_tun = tun_missing()
    if no_tun is not None:
        return ShaperChoice(None, no_tun if requested == "userspace"
                            else f"{no_netem}; and {no_tun}")
    return ShaperChoice("userspace", "links emulated in user space" + (
        ": this kernel has no netem qdisc" if requested == "auto" else " (--shaper userspace)"))


class Lan:
    """One shaped namespace per node; see the module docstring."""

    def __init__(self, links: list[Link], tag: str | None = None, shaper: str = "auto",
                 seed: int | None = None) -> None:
        """`shaper`: one of `SHAPERS`, chosen at `up`; `seed`: the user-space emulator's
        random jitter and loss (None: a fresh one each run)."""
        if shaper not in SHAPERS:
            raise ValueError(f"unknown shaper {shaper!r}; known: {', '.join(SHAPERS)}")
        self.tag = tag or f"hnh{os.getpid()}"  # ≤ 15 characters with the suffixes below
        self.links = links
        self.requested = shaper
        self.shaper: str | None = None  # the one `up` used
        self.seed = seed
        self.bridge = f"{self.tag}br"
        self.ns = [f"{self.tag}n{i}" for i in range(len(links))]
        self.veth = [f"{self.tag}v{i}" for i in range(len(links))]
        self.emulator: subprocess.Popen[bytes] | None = None
        self.emulator_stats: dict[str, float] = {}  # what it switched (`linkem.Switch.stats`)

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on node `i`'s network."""
        return ["ip", "netns", "exec", self.ns[i]]

    def up(self) -> None:
        """Make the namespaces and the shaped links with the shaper `pick_shaper` gives.

        Raises:
            LanUnavailable: no shaper can be used here, or a step failed; what was made
                is removed again.
        """
        choice = pick_shaper(self.requested)
        if choice.name is None:
            raise LanUnavailable(choice.note)
        self.shaper = choice.name
        try:
            if choice.name == "netem":
                self._up_netem()
            else:
                self._up_userspace()
        except BaseException:
            self.down()
            raise

    def _up_netem(self) -> None:
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

    def _up_userspace(self, ready_timeout: float = 30.0) -> None:
        for ns in self.ns:
            self._step("ip", "netns", "add", ns)
            self._step("ip", "-n", ns, "link", "set", "lo", "up")
        cfg = Config(self.ns, [self.addr(i) for i in range(len(self.ns))], self.links,
                     seed=self.seed)
        # stdin is the emulator's lifeline: it ends when `down` closes it or this process
        # dies, however it dies; its own session keeps a terminal's Ctrl-C from cutting
        # the links before the nodes are stopped
        self.emulator = subprocess.Popen(
            [sys.executable, "-m", "hearthnet.bench.linkem", cfg.to_json()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        out = self.emulator.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], ready_timeout)
        line = out.readline() if ready else b""
        if line.strip() != b"ready":
            err = self._stop_emulator()
            raise LanUnavailable(f"the link emulator did not start: {err or 'no answer'}")
        for i, ns in enumerate(self.ns):
            self._step("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            self._step("ip", "-n", ns, "link", "set", "eth0", "mtu", str(MTU), "up")
            self._step("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def _stop_emulator(self) -> str:
        """End the emulator (its TUNs go with it) and wait for it; what it wrote on
        stderr (never raises)."""
        p = self.emulator
        if p is None:
            return ""
        with contextlib.suppress(OSError):
            if p.stdin is not None:
                p.stdin.close()  # the lifeline: it exits at once
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        err = b""
        with contextlib.suppress(OSError, ValueError):
            if p.stderr is not None and p.returncode is not None:
                err = p.stderr.read()
            if p.stdout is not None and p.returncode == 0:
                self.emulator_stats = json.loads(p.stdout.read() or b"{}")
        for f in (p.stdout, p.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        return err.decode(errors="replace").strip()

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
        """Kill every process in the namespaces, stop the emulator, delete the namespaces,
        the veths and the bridge (idempotent; raises nothing of its own: a Ctrl-C while
        it waits for the emulator kills the emulator, removes the rest and goes on up)."""
        for i in range(len(self.ns)):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.kill_host(i)
        try:
            self._stop_emulator()
        except BaseException:  # a second Ctrl-C: kill it, never leave it behind
            if self.emulator is not None:
                with contextlib.suppress(OSError):
                    self.emulator.kill()
            raise
        finally:
            for i in range(len(self.ns)):
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    _run("ip", "netns", "del", self.ns[i])  # takes the veth pair with it
                    if self.shaper != "userspace":
                        _run("ip", "link", "del", self.veth[i])
            if self.shaper != "userspace":
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    _run("ip", "link", "del", self.bridge)


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
            enter_netns(ns)  # this thread only: accepted sockets stay where they were made
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


class LanMesh(LocalMesh):
    """`LocalMesh` with, given a `Lan`, each node in its own namespace listening on its LAN
    address (a client in this process reaches it by `NsForward`), and a models folder per
    node (`models_dirs`; one shared folder for every node in `bench pipeline`)."""

    def __init__(self, specs: list[NodeSpec], *, root: Path, model: str,
                 models_dirs: dict[str, Path], lan: Lan | None, threads: int,
                 timeout_s: float = 30.0) -> None:
        super().__init__(specs, root=root, model=model, threads=threads, timeout_s=timeout_s,
                         models=models_dirs[specs[0].node_id])
        self.lan = lan
        self.index = {s.node_id: i for i, s in enumerate(specs)}
        self.forwards: dict[str, NsForward] = {}
        first = self.nodes[specs[0].node_id]
        for nid, n in self.nodes.items():
            peers = [] if n is first else [f"wss://{self.host(specs[0].node_id)}:{first.port}"]
            text = node_toml(n.spec, n.port, peers, self.root / nid, models_dirs[nid],
                             model=model, timeout_s=timeout_s, threads=threads, members=specs)
            n.config.write_text(text.replace('listen_host = "127.0.0.1"',
                                             f'listen_host = "{self.host(nid)}"'))
        provision(self.root)  # the keys made above stay; the member lists are written again

    def host(self, node_id: str) -> str:
        """The address node `node_id` listens on."""
        return self.lan.addr(self.index[node_id]) if self.lan else "127.0.0.1"

    def prefix(self, node_id: str) -> list[str]:
        """The command prefix that runs a program on the node's machine."""
        return self.lan.exec_prefix(self.index[node_id]) if self.lan else []

    def node_argv(self, n: NodeProc) -> list[str]:
        return self.prefix(n.spec.node_id) + super().node_argv(n)

    def _wait_ready(self, n: NodeProc, timeout: float) -> None:
        super()._wait_ready(n, timeout)
        if self.lan is None:
            return
        nid = n.spec.node_id
        old = self.forwards.pop(nid, None)
        if old is not None:
            old.close()
        fwd = NsForward(self.lan.ns[self.index[nid]], int(n.admin.rsplit(":", 1)[1]))
        self.forwards[nid] = fwd
        n.admin = f"ws://127.0.0.1:{fwd.port}"

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        super().kill(node_id, sig)
        if self.lan is not None:  # the machine dies: nothing of it runs on
            self.lan.kill_host(self.index[node_id])

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            for f in self.forwards.values():
                f.close()
            self.forwards.clear()


@contextlib.contextmanager
def lan_mesh(specs: list[NodeSpec], *, lan: Lan | None, root: Path, model: str,
             models_dirs: dict[str, Path], threads: int, what: str) -> Iterator[LanMesh]:
    """A `LanMesh` of `specs` (not yet started) on `lan`, brought up first (None: every node
    on 127.0.0.1); on exit its nodes are stopped and `lan` taken down, however it ends.

    Raises:
        HearthNetError: `lan` could not be made (`what` names it in the message).
    """
    if lan is not None:
        try:
            lan.up()  # removes what it made when it fails
        except LanUnavailable as e:
            raise HearthNetError(f"{what} could not be made: {e}") from e
    try:
        mesh = LanMesh(specs, root=root, model=model, models_dirs=models_dirs, lan=lan,
                       threads=threads)
        try:
            yield mesh
        finally:
            mesh.stop()
    finally:
        if lan is not None:
            lan.down()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM as Ctrl-C while a benchmark's namespaces stand, so every `finally` removes
    what it made (on the main thread only: elsewhere a signal handler cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
