"""The status page answers "what is happening" (issue 36 §7), in a real headless chromium
against a live mesh: every member node with its state, a running chat with its tok/s and
path while it streams, live session counts, the local fallback, and no "Automatic hosting"
card on a hand-written mesh.

One mesh for the module: node-a orchestrates, node-b hosts layers 0–14, node-c 15–29, and
node-d is in every member list but never starts (a machine switched off). Screenshots go to
the test's tmp dir and, when ``HEARTHNET_SCREENSHOT_DIR`` is set, there too.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from tests.helpers.browser import Browser, chromium_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    chromium_path() is None,
    reason="Debian's chromium is not installed (`apt-get install chromium`; `make test` "
           "installs it where apt is usable)")]

RUNNING = ("node-a", "node-b", "node-c")
STORY = "Tell me a long story about a lighthouse keeper."
ROWS = ("Array.from(document.querySelectorAll('#nodes .node-row'))"
        ".map(r => r.dataset.node + ':' + r.dataset.state).join(',')")
CALL = "document.querySelector('.running-call')"


class _MeshWithAbsentMember(LocalMesh):
    """A `LocalMesh` whose last node is a member that never starts."""

    def start(self, wait_cover: bool = True, timeout: float = 120.0) -> None:
        for node_id in RUNNING:
            self.start_node(node_id, wait=False)
        for node_id in RUNNING:
            self._wait_ready(self.nodes[node_id], timeout)
        self.wait_covered("node-a", timeout=timeout)


@pytest.fixture(scope="module")
def mesh(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    with _MeshWithAbsentMember([NodeSpec("node-a"), NodeSpec("node-b", [(0, 14)]),
                                NodeSpec("node-c", [(15, 29)]), NodeSpec("node-d")],
                               root=tmp_path_factory.mktemp("mesh")) as m:
        yield m


@contextmanager
def _streaming_chat(api: str) -> Iterator[list[str]]:
    """A long greedy chat streaming through `api` in a thread for the time of the block;
    yields the texts received so far. Leaving the block drops the stream (the node closes
    the call's sessions)."""
    got: list[str] = []
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with openai.OpenAI(base_url=api + "/v1", api_key="local", max_retries=0,
                               timeout=300) as client:
                stream = client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": STORY}],
                    max_tokens=2000, temperature=0, stream=True)
                try:
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            got.append(chunk.choices[0].delta.content)
                        if stop.is_set():
                            break
                finally:
                    stream.close()
        except BaseException as e:  # seen by the test after the block
            failed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield got
    finally:
        stop.set()
        t.join(120)
    assert not failed, failed


def _shots(tmp_path: Path) -> list[Path]:
    out = [tmp_path / "screenshots"]
    if os.environ.get("HEARTHNET_SCREENSHOT_DIR"):
        out.append(Path(os.environ["HEARTHNET_SCREENSHOT_DIR"]))
    return out


def _screenshot(b: Browser, dirs: list[Path], name: str) -> None:
    first = b.screenshot(dirs[0] / name)
    for d in dirs[1:]:
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(first, d / name)


def _running_call(b: Browser, *, fallback: bool, tokens: int, timeout: float) -> Any:
    """Wait until the page shows a running call decoding (or on the local engine) with at
    least `tokens` tokens and a tok/s; its dataset."""
    state = "local fallback" if fallback else "decoding"
    return b.wait_for(f"(() => {{ const c = {CALL}; return c && c.dataset.state === "
                      f"'{state}' && Number(c.dataset.tokens) >= {tokens} && "
                      f"Number(c.dataset.tps) > 0 ? Object.assign({{}}, c.dataset) : null; "
                      f"}})()", timeout)


def _get(url: str) -> tuple[int, Any]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_api_plan_on_the_live_mesh(mesh: LocalMesh, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``/api/plan``: the hand-placed hosts keep their layers, nothing to fetch, the head is
    in node-a's store, every figure says where it came from; the page shows it when asked
    and no fetches card while /api/status has none."""
    api = mesh.nodes["node-a"].api
    status, body = _get(api + "/api/plan?model=smollm2")
    assert status == 200, body
    p = body["plan"]
    by = {n["node"]: n for n in p["nodes"]}
    assert set(by) == set(RUNNING)  # node-d is offline
    assert by["node-b"]["layers"] == [[0, 14]] and by["node-c"]["layers"] == [[15, 29]]
    assert by["node-a"]["layers"] == [] and by["node-a"]["orchestrator"]
    assert all(n["fetch_bytes"] == 0 for n in p["nodes"]) and p["fits"]
    assert [s["node"] for s in p["stages"]] == ["node-b", "node-c"]
    assert p["single_chat_tokens_per_s"] > 0 and p["hop_source"] and all(
        n["speed_source"] for n in p["nodes"])
    status, body = _get(api + "/api/plan?model=no-such")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # `hearthnet plan --config`: the same live facts through the node's admin and API
    import json

    from hearthnet.cli import main

    assert main(["plan", "smollm2", "--config", str(mesh.nodes["node-a"].config),
                 "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["plan"]
    assert [n["layers"] for n in cli["nodes"]] == [n["layers"] for n in p["nodes"]]
    with Browser(tmp_path / "profile") as b:
        b.goto(api + "/")
        b.wait_for("(document.getElementById('plan-model') || {}).value === 'smollm2'")
        assert b.eval("document.getElementById('fetches-card').hidden") is True
        b.eval("document.getElementById('plan-go').click()")
        b.wait_for("document.getElementById('plan').dataset.state === 'done'", 60)
        assert "smollm2 as bf16: fits" in b.eval(
            "document.getElementById('plan-verdict').textContent")
        assert b.eval("document.querySelector('#plan-nodes tr[data-node=node-b]')"
                      ".textContent").startswith("node-b0–14")
        assert "tok/s for one chat" in b.eval("document.getElementById('plan-speed')"
                                              ".textContent")
        # the fetches /api/status will list (another part's schema), drawn as they come
        shown = b.eval("(renderFetches({fetches: [{model: 'smollm2', layers: [0, 14], "
                       "head: true, bytes_done: 1048576, bytes_total: 4194304, sources: "
                       "['node-b', 'node-c'], state: 'fetching', detail: ''}]}), "
                       "[document.getElementById('fetches-card').hidden, "
                       "document.getElementById('fetches').textContent])")
        assert shown == [False, "smollm2 head + layers 0–14: fetching 1.0 / 4.0 MiB (25 %) "
                                "from node-b, node-c"]


def test_status_page_shows_what_is_happening(mesh: LocalMesh, tmp_path: Path) -> None:
    dirs = _shots(tmp_path)
    api = mesh.nodes["node-a"].api
    with Browser(tmp_path / "profile") as b:
        b.viewport(1000, 900)
        b.goto(api + "/")
        # every member, not only node-a's gossip links: node-d never started
        b.wait_for(f"{ROWS} === 'node-a:online,node-b:online,node-c:online,node-d:offline'")
        reason = b.eval("document.querySelector('.node-row[data-node=node-d] .reason')"
                        ".textContent")
        assert reason.startswith("never seen"), reason
        assert b.eval("document.querySelector('.node-row[data-node=node-b]').textContent"
                      ).count("0–14") == 1
        # a hand-written mesh: no automatic hosting card
        assert b.eval("document.getElementById('placement-card').hidden") is True
        assert b.eval("document.getElementById('placement-card').offsetParent") is None
        assert "no chat running" in b.eval("document.getElementById('running').textContent")

        with _streaming_chat(api) as got:
            call = _running_call(b, fallback=False, tokens=8, timeout=240)
            path = b.eval(f"{CALL}.querySelector('.path').textContent")
            assert "node-b" in path and "node-c" in path and "→" in path, path
            assert "tok/s" in b.eval(f"{CALL}.textContent") and call["fallback"] == "false"
            # this node's calls on the shards show at once, not at the next heartbeat
            b.wait_for("Array.from(document.querySelectorAll('#shards .shard-row .sessions'))"
                       ".map(s => s.textContent).join() === '1 (1 from here),1 (1 from here)'",
                       30)
            own = [s for s in mesh.status("node-b")["shards"] if s["host"] == "node-b"]
            assert [(s["active_sessions"], s["sessions_live"]) for s in own] == [(1, True)]
            _screenshot(b, dirs, "status-page-running.png")
            b.viewport(412, 915, mobile=True)  # a phone
            _running_call(b, fallback=False, tokens=int(call["tokens"]) + 1, timeout=60)
            _screenshot(b, dirs, "status-page-running-phone.png")
            b.viewport(1000, 900)
            assert got  # the caller is being answered meanwhile
        b.wait_for(f"{CALL} === null", 60)  # the dropped call is gone from the page

        mesh.kill("node-c")  # a host dies: the next chat continues on the local engine
        b.wait_for(f"{ROWS}.includes('node-c:offline')", 60)
        with _streaming_chat(api):
            call = _running_call(b, fallback=True, tokens=3, timeout=240)
            assert b.eval(f"{CALL}.querySelector('.path').textContent") == "local fallback"
            assert "fell back" in b.eval(f"{CALL}.textContent")
            _screenshot(b, dirs, "status-page-fallback.png")
        b.wait_for(f"{CALL} === null", 60)
        assert b.eval("document.getElementById('placement-card').hidden") is True
