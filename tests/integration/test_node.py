"""Node daemon over real sockets: shard sessions, refusals, expiry, shutdown (issue 4)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.errors import BadRequest, ShardUnavailable, WeightsMismatch
from hearthnet.mesh.launcher import NodeSpec
from hearthnet.transport.websocket import TensorChannel
from tests.helpers.mesh import TestMesh
from tests.helpers.processes import wait_all_gone
from tests.helpers.waiting import wait_for, wait_until


@pytest.fixture(scope="module")
def mesh(smollm2):
    # short health timeout: heartbeats every 0.75 s, advertisements expire after 6 s
    specs = [NodeSpec("node-a"), NodeSpec("node-b", [(0, 14)]), NodeSpec("node-c", [(15, 29)])]
    for s in specs:
        s.extra_di = {"shard_health_timeout_seconds": 1.5}
    specs[1].extra_di["fallback_to_local"] = True
    with TestMesh(specs) as m:
        yield m


async def _open(m, host, params, *, as_node="node-a", **kw):
    """A signed shard session on `host`, over mutual TLS as member `as_node` (issue 7)."""
    return await TensorChannel.connect(m.nodes[host].listen_uri + "/shard",
                                       m.sign_open(as_node, params),
                                       ssl=m.client_ssl(as_node, host), **kw)


def _params(smollm2, **kw):
    p = {"shard_id": f"{smollm2.model_id}:0-14@node-b", "model_id": smollm2.model_id,
         "weights_sha256": smollm2.weights_sha256, "start": 0, "end": 14, "max_length": 64,
         "wire_dtype": "fp32"}
    p.update(kw)
    return p


async def test_shard_session_matches_backend(mesh, smollm2):
    # the node computes with 1 torch thread; so do we here, so the comparison can be exact
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        await _compare_session(mesh, smollm2)
    finally:
        torch.set_num_threads(threads)


async def _compare_session(mesh, smollm2):
    head = LayeredHead(smollm2)
    ids = head.chat_prompt_ids([{"role": "user", "content": "Hello there"}])
    x = head.embed(ids)
    ref = LayeredStack(smollm2, 0, 14).open_session(3, 9, 64)
    ch = await _open(mesh, "node-b", _params(smollm2, start=3, end=9), deadline_s=10)
    try:
        got = (await ch.step(1, 0, x)).tensor
        assert torch.equal(got, ref.forward(x, 0))
        nxt = head.embed([42])
        got2 = (await ch.step(2, len(ids), nxt)).tensor
        assert torch.equal(got2, ref.forward(nxt, len(ids)))
    finally:
        await ch.close()


@pytest.mark.parametrize(("override", "err"), [
    ({"weights_sha256": "0" * 64}, WeightsMismatch),
    ({"start": 10, "end": 20}, BadRequest),
    ({"max_length": 0}, BadRequest),
    ({"wire_dtype": "int8"}, BadRequest),
    ({"shard_id": "nope"}, ShardUnavailable),
])
async def test_refused_opens_are_typed(mesh, smollm2, override, err):
    with pytest.raises(err):
        await _open(mesh, "node-b", _params(smollm2, **override), deadline_s=10)


async def test_max_concurrent_streams_refuses_at_once(mesh, smollm2):
    chans = [await _open(mesh, "node-b", _params(smollm2), deadline_s=10)
             for _ in range(8)]  # max_concurrent_streams = 8 in LocalMesh
    try:
        # refused, not queued until a slot frees: a queued open would end in
        # StreamStalled at its deadline, never in ShardUnavailable
        with pytest.raises(ShardUnavailable, match="max_concurrent_streams"):
            await _open(mesh, "node-b", _params(smollm2), deadline_s=10)
    finally:
        for c in chans:
            await c.close()
    await wait_until(lambda: _active_sessions(mesh, "node-b") == 0, "node-b's sessions closed")
    c = await _open(mesh, "node-b", _params(smollm2), deadline_s=10)  # a slot is free again
    await c.close()


def _active_sessions(m: TestMesh, node_id: str) -> float:
    """The shard's active-sessions gauge, summed over its shards, from its /metrics."""
    name = "hearthnet_distributed_inference_shard_active_sessions"
    return sum(float(line.rsplit(" ", 1)[1]) for line in m.metrics(node_id).splitlines()
               if line.startswith(name + "{"))


def test_metrics_endpoint_has_shard_metrics(mesh):
    text = mesh.metrics("node-b")
    for name in ("hearthnet_distributed_inference_shard_forward_ms_bucket",
                 "hearthnet_distributed_inference_shard_active_sessions",
                 "hearthnet_events_appended_total", "hearthnet_transport_bytes_in_total"):
        assert name in text


def test_killed_node_expires_and_status_says_so(mesh):
    st = mesh.wait_covered("node-a")
    assert st["models"][0]["fully_covered"]
    mesh.kill("node-c")
    st = wait_for(lambda: (s := mesh.status("node-a"))["models"][0]["fully_covered"] is False
                  and s, "node-c's advertisement expired at node-a", timeout=30)
    assert st["models"][0]["uncovered"] == [[15, 29]]
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "status", "--config",
                        str(mesh.nodes["node-a"].config)], capture_output=True, text=True,
                       timeout=60)
    assert "NOT COVERED: layers 15-29" in r.stdout
    mesh.start_node("node-c")  # back again: re-advertises
    mesh.wait_covered("node-a", timeout=60)


def test_sigterm_withdraws_at_once(mesh):
    mesh.wait_covered("node-a", timeout=60)
    mesh.kill("node-b", signal.SIGTERM)
    wait_for(lambda: not any(s["host"] == "node-b" for s in mesh.status("node-a")["shards"]),
             "node-b's shard gone from node-a's view", timeout=30)
    # gone by the withdrawal, not by expiry: node-a never expired node-b's advertisement
    assert not [line for line in mesh.log_text("node-a").splitlines()
                if '"advertisements_expired"' in line and "@node-b" in line]
    assert '"node_stopped"' in mesh.log_text("node-b")
    mesh.start_node("node-b")
    mesh.wait_covered("node-a", timeout=60)


def test_bad_config_exits_2_naming_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[node]\nid = "node-x"\nlisten_port = 99999\n')
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "node", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert str(bad) in r.stderr and "listen_port" in r.stderr and "Traceback" not in r.stderr


def test_research_disabled_emits_nothing(smollm2):
    m = TestMesh([NodeSpec("node-q", [(0, 29)])])
    cfg = m.nodes["node-q"].config
    cfg.write_text(cfg.read_text().replace("[research]\nenable = true",
                                           "[research]\nenable = false"))
    m.start(wait_cover=False)
    try:
        st = m.status("node-q")
        assert st["shards"] == []  # M26 §5.1: opted out, no advertisement
        assert st["models"][0]["fully_covered"] is False
    finally:
        m.stop()


async def test_idle_shard_evicts_and_reloads_on_next_open(smollm2):
    spec = NodeSpec("node-e", [(0, 14)], extra_di={"shard_health_timeout_seconds": 1.0},
                    extra_host={"shard_eviction_idle_seconds": 1.0})
    m = TestMesh([spec])
    m.start(wait_cover=False)  # one node with half the model: never fully covered
    try:
        await wait_until(lambda: '"shard_evicted"' in m.log_text("node-e"),
                         "node-e evicted its idle shard")
        assert m.log_text("node-e").count('"shard_loaded"') == 1
        params = _params(smollm2, shard_id=f"{smollm2.model_id}:0-14@node-e")
        ch = await _open(m, "node-e", params, as_node="node-e", deadline_s=30)
        try:
            out = (await ch.step(1, 0, torch.randn(1, 4, 576))).tensor
            assert out.shape == (1, 4, 576)
        finally:
            await ch.close()
        assert m.log_text("node-e").count('"shard_loaded"') == 2  # reloaded for the open
    finally:
        m.stop()


def test_metrics_port_serves_plain_http_metrics(smollm2):
    import urllib.request

    from hearthnet.mesh.launcher import free_port

    port = free_port()
    m = TestMesh([NodeSpec("node-m")])
    cfg = m.nodes["node-m"].config
    cfg.write_text(cfg.read_text().replace("[node]\n", f"[node]\nmetrics_port = {port}\n", 1))
    m.start(wait_cover=False)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "hearthnet_distributed_inference_failovers_total" in text
    finally:
        m.stop()


def test_nodes_exit_when_their_launcher_is_killed(tmp_path):
    """A demo or test killed with SIGKILL leaves no orphan node processes."""
    script = tmp_path / "launch.py"
    script.write_text(
        "import os\n"
        "from pathlib import Path\n"
        "from hearthnet.mesh.launcher import LocalMesh, NodeSpec\n"
        # under tmp_path: the killed launcher cannot remove its mesh folder itself
        f"root = Path({str(tmp_path / 'mesh')!r})\n"
        "root.mkdir()\n"
        "m = LocalMesh([NodeSpec('node-o')], root=root)\n"
        "m.start(wait_cover=False)\n"
        "print(m.nodes['node-o'].proc.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120)
    pid = int(r.stdout.strip())
    wait_all_gone([pid], "the node process to exit with its launcher")


def test_port_flag_overrides_the_configured_port(tmp_path):
    """`hearthnet node --port N` listens on N (it crashed on the frozen settings before)."""
    from hearthnet.mesh.launcher import free_port, wait_node_ready

    m = TestMesh([NodeSpec("node-p")], root=tmp_path)
    port = free_port()
    log = tmp_path / "node-p.stderr"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hearthnet.cli", "node", "--config",
             str(m.nodes["node-p"].config), "--port", str(port)],
            stdout=subprocess.PIPE, stderr=err, text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        ready = wait_node_ready(proc, 120, "node-p", log.read_text)
        assert ready["endpoint"].endswith(f":{port}")
        assert ready["endpoint"] != m.nodes["node-p"].listen_uri  # not the config's port
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_node_that_exits_while_a_mesh_starts_says_why(monkeypatch, tmp_path):
    """The mesh's folder (and the node's log) goes when the mesh stops, so the error names
    the log's last lines: here a kernel setting that names no kernel, refused before the
    node starts."""
    from hearthnet.errors import HearthNetError
    from hearthnet.mesh.launcher import LocalMesh

    monkeypatch.setenv("HEARTHNET_INT8_KERNEL", "avx9")
    mesh = LocalMesh([NodeSpec("node-a")], root=tmp_path)
    with pytest.raises(HearthNetError) as e, mesh:
        pass
    assert "node node-a exited with 2" in str(e.value)
    assert "hearthnet: config error: HEARTHNET_INT8_KERNEL='avx9' is not an int8 kernel" \
        in str(e.value)
