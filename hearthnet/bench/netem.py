"""A benchmark over a slower link: the same command, run in a fresh network namespace whose
loopback delays every packet (`tc netem`), so each hop between the benchmark's node
processes pays a household network's latency (``--netem "2ms 0.5ms"``: 2 ms ± 0.5 ms each
way, a household Wi-Fi; a round trip through a shard pays it twice).

The namespace holds only its own loopback: nothing leaves it, and the machine's own
loopback is untouched. It needs root and iproute2's ``ip`` and ``tc``; where they are
missing `unavailable` says why and the benchmark runs on the plain loopback, saying so in
its figures.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ENV = "HEARTHNET_BENCH_NETEM"  # set inside the namespace: the delay already applied


def inside(netem: str) -> bool:
    """Whether this process already runs under `netem` (the re-executed benchmark)."""
    return os.environ.get(ENV) == netem


def unavailable() -> str | None:
    """Why a delayed namespace cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "a network namespace with tc netem needs root"
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not installed"
    return None


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)


class NetemUnavailable(RuntimeError):
    """The delayed namespace could not be made here (no netem qdisc in the kernel, …)."""


def run_inside(netem: str, argv: list[str]) -> dict[str, Any]:
    """Run ``hearthnet <argv>`` (a benchmark) in a namespace whose loopback delays packets
    by `netem` (tc netem arguments after ``delay``); its figures.

    Raises:
        NetemUnavailable: the namespace or the delay could not be set up (the kernel has
            no netem qdisc, …): nothing was measured.
        RuntimeError: the benchmark failed (with its stderr's end).
    """
    ns = f"hnbench{os.getpid()}"
    out = Path(tempfile.mkdtemp(prefix="hearthnet-netem-")) / "figures.json"
    try:
        for cmd in (("ip", "netns", "add", ns), ("ip", "-n", ns, "link", "set", "lo", "up"),
                    ("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                     *shlex.split(netem))):
            r = _run(*cmd)
            if r.returncode != 0:
                raise NetemUnavailable(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "hearthnet.cli",
                            *argv, "--output", str(out)], capture_output=True, text=True,
                           env={**os.environ, ENV: netem}, check=False)
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"the benchmark under netem failed (exit {r.returncode}):\n"
                               f"{r.stderr[-3000:]}")
        figures: dict[str, Any] = json.loads(out.read_text())
        return figures
    finally:
        _run("ip", "netns", "del", ns)
        shutil.rmtree(out.parent, ignore_errors=True)
