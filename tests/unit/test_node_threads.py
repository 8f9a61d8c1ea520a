"""A node's event loop runs torch serially, so its process holds one OpenMP team: the
compute thread's (hearthnet/node/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hearthnet.node import threads

# run in a fresh interpreter: it changes the calling thread's OpenMP and MKL settings
SCRIPT = textwrap.dedent("""
    import json, os, torch
    from concurrent.futures import ThreadPoolExecutor
    from hearthnet.node.threads import serial_torch_here
    torch.set_num_threads(2)
    torch.randn(512, 512).cos().sum()  # start-up work gives this thread a team
    before = len(os.listdir("/proc/self/task"))
    ok = serial_torch_here()
    released = len(os.listdir("/proc/self/task"))
    x = torch.randn(2_000_000)
    (x * 2).sum(), x.cos().sum(), x.exp().sum()  # ATen parallel_for and MKL's vector maths
    after_loop_work = len(os.listdir("/proc/self/task"))
    compute = ThreadPoolExecutor(1, thread_name_prefix="compute")
    compute_threads = compute.submit(torch.get_num_threads).result()
    compute.submit(lambda: (x.cos() * 2).sum()).result()
    print(json.dumps({"ok": ok, "loop_threads": torch.get_num_threads(),
                      "compute_threads": compute_threads, "before": before,
                      "released": released, "after_loop_work": after_loop_work,
                      "with_compute": len(os.listdir("/proc/self/task"))}))
""")


@pytest.mark.skipif(threads._openmp() is None, reason="torch here has no OpenMP runtime")
def test_the_event_loop_thread_holds_no_openmp_team_and_compute_keeps_its_threads():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    r = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"] and r["loop_threads"] == 1 and r["compute_threads"] == 2
    assert r["released"] == r["before"] - 1  # the loop thread's team helper let go
    assert r["after_loop_work"] == r["released"]  # big ops on the loop open no team
    # the compute thread and its one helper: the process's only team
    assert r["with_compute"] == r["released"] + 2
