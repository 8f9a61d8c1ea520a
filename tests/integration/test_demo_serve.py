"""`hearthnet demo --serve`: answer, then serve the API and the status page until Ctrl-C."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from tests.helpers.processes import INTERRUPTIBLE, alive, interrupt, wait_all_gone

pytestmark = pytest.mark.slow


def test_demo_serve_keeps_the_mesh_until_ctrl_c(smollm2):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.Popen([sys.executable, "-m", "hearthnet.cli", "demo", "--serve",
                          "--api-port", "0", "--max-tokens", "8"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, **INTERRUPTIBLE)
    try:
        assert p.stdout is not None
        lines: list[str] = []
        while not any(ln.startswith("status page: ") for ln in lines):
            line = p.stdout.readline()
            assert line, (lines, p.stderr.read() if p.stderr else "")
            lines.append(line.strip())
        pids = [int(ln.rsplit("pid ", 1)[1]) for ln in lines if " pid " in ln]
        api = next(ln for ln in lines if ln.startswith("api: "))[5:]
        page = next(ln for ln in lines if ln.startswith("status page: "))[13:]
        assert api.startswith("http://127.0.0.1:") and api.endswith("/v1")
        assert page == api[:-3] + "/"
        with urllib.request.urlopen(api + "/models", timeout=30) as r:  # the mesh still runs
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["smollm2"]
        with urllib.request.urlopen(page, timeout=30) as r:
            assert b"HearthNet" in r.read()
        assert len(pids) == 3 and all(alive(x) for x in pids)
    finally:
        out, err = interrupt(p)
    assert p.returncode == 0, err[-2000:]
    assert "stopped 3 node processes" in out
    wait_all_gone(pids, "the demo's node processes to exit")
