"""Membership and trust against a real node daemon (issue 7).

One `hearthnet node` process (node-b, hosting layers 0-3) with three members provisioned
by `LocalMesh`: node-a (trusted), node-g (guest) and itself. Each refusal of issue 7 is
driven over the real listener: TLS handshakes, signed session opens, signed gossip
events, garbage, and a member removed by `hearthnet node --reload`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    ShardDescriptor,
    advertisement_payload,
)
from hearthnet.distributed_inference.placement.community import CAPACITY
from hearthnet.errors import AuthError, ConnectionLost, HearthNetError
from hearthnet.mesh.eventlog import Event, EventLog
from hearthnet.mesh.gossip import decode_message, encode_events, encode_hello
from hearthnet.mesh.launcher import NodeSpec
from hearthnet.security import MemberDirectory, NodeKey, client_context, reason_of, sign_open
from hearthnet.security.provision import replace_member_tables
from hearthnet.transport.websocket import TensorChannel
from tests.helpers.mesh import TestMesh

HOST = "node-b"


@pytest.fixture(scope="module")
def mesh(smollm2):
    specs = [NodeSpec(HOST, [(0, 3)], extra_host={"shard_eviction_idle_seconds": 1.0}),
             NodeSpec("node-a"), NodeSpec("node-g", trust="guest")]
    m = TestMesh(specs)
    try:
        m.start_node(HOST)  # node-a and node-g are members whose keys we hold; not started
        yield m
    finally:
        m.stop()


def _params(smollm2: Any, **kw: Any) -> dict[str, Any]:
    p = {"shard_id": f"{smollm2.model_id}:0-3@{HOST}", "model_id": smollm2.model_id,
         "weights_sha256": smollm2.weights_sha256, "start": 0, "end": 3, "max_length": 16,
         "wire_dtype": "fp32"}
    p.update(kw)
    return p


async def _open(m: TestMesh, fields: dict[str, Any], *, as_node: str = "node-a",
                ssl: Any = None) -> TensorChannel:
    return await TensorChannel.connect(m.nodes[HOST].listen_uri + "/shard", fields,
                                       ssl=ssl or m.client_ssl(as_node, HOST), deadline_s=20)


async def _refused(m: TestMesh, fields: dict[str, Any], reason: str, **kw: Any) -> None:
    with pytest.raises(AuthError) as e:
        ch = await _open(m, fields, **kw)
        await ch.close()
    assert e.value.details.get("reason") == reason, e.value.details


def _count(m: TestMesh, metric: str, **labels: str) -> float:
    """The value of `metric` with `labels` in the node's /metrics (0 if absent)."""
    for line in m.metrics(HOST).splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line
                                                 for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _loads(m: TestMesh) -> int:
    return m.log_text(HOST).count('"shard_loaded"')


# ---- session opens (issue 7 item 3) ----

async def test_refused_opens_do_not_reload_evicted_weights(mesh, smollm2):
    deadline = time.monotonic() + 30
    while '"shard_evicted"' not in mesh.log_text(HOST) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert '"shard_evicted"' in mesh.log_text(HOST)
    loads = _loads(mesh)
    stranger = NodeKey.generate()
    await _refused(mesh, _params(smollm2), "malformed")  # unsigned
    await _refused(mesh, sign_open(stranger, "node-x", _params(smollm2)), "unknown_member")
    await _refused(mesh, mesh.sign_open("node-g", _params(smollm2)), "insufficient_trust",
                   as_node="node-g")
    assert _loads(mesh) == loads  # no amplification: nothing was reloaded
    ch = await _open(mesh, mesh.sign_open("node-a", _params(smollm2)))
    try:
        out = (await ch.step(1, 0, torch.randn(1, 2, 576))).tensor
        assert out.shape == (1, 2, 576)
    finally:
        await ch.close()
    assert _loads(mesh) == loads + 1
    assert _count(mesh, "hearthnet_distributed_inference_shard_sessions_total",
                  caller="node-a") >= 1  # the caller's identity is a metric label


async def test_unknown_key_is_refused(mesh, smollm2):
    stranger = NodeKey.generate()
    # in the TLS handshake: a certificate no member list pins
    directory = mesh.directory(HOST)
    rows = [m.to_dict() for m in directory] + [
        {"node_id": "node-x", "public_key": stranger.public_key_b64, "trust": "trusted"}]
    ctx = client_context(stranger, "node-x", MemberDirectory.from_dicts(rows), expect=HOST)
    # the node drops the handshake: the client sees the connection end, or (if OpenSSL's
    # alert arrives first) a typed TLS refusal — never a bare ssl.SSLError
    with pytest.raises((ConnectionLost, AuthError)) as e:
        await _open(mesh, sign_open(stranger, "node-x", _params(smollm2)), ssl=ctx)
    assert isinstance(e.value, ConnectionLost) or reason_of(e.value) == "tls_handshake"
    # in the open: signed by a key that is not a member's
    before = _count(mesh, "hearthnet_auth_failures_total", reason="unknown_member")
    await _refused(mesh, sign_open(stranger, "node-x", _params(smollm2)), "unknown_member")
    assert _count(mesh, "hearthnet_auth_failures_total", reason="unknown_member") == before + 1


async def test_wrong_trust_level_is_refused(mesh, smollm2):
    await _refused(mesh, mesh.sign_open("node-g", _params(smollm2)), "insufficient_trust",
                   as_node="node-g")


async def test_bad_signature_is_refused(mesh, smollm2):
    fields = mesh.sign_open("node-a", _params(smollm2))
    fields["max_length"] = 15  # tampered after signing
    await _refused(mesh, fields, "bad_signature")


async def test_open_signed_by_another_member_than_the_tls_peer_is_refused(mesh, smollm2):
    # node-g holds a valid open of node-a's (say, captured) and sends it on its own link
    fields = mesh.sign_open("node-a", _params(smollm2))
    await _refused(mesh, fields, "peer_mismatch", as_node="node-g")


async def test_replayed_open_is_refused(mesh, smollm2):
    fields = mesh.sign_open("node-a", _params(smollm2))
    ch = await _open(mesh, dict(fields))
    await ch.close()
    await _refused(mesh, dict(fields), "replayed_nonce")


async def test_stale_timestamp_is_refused(mesh, smollm2):
    await _refused(mesh, mesh.sign_open("node-a", _params(smollm2), now=time.time() - 120),
                   "stale_timestamp")


async def test_plaintext_client_is_refused_by_the_tls_node(mesh, smollm2):
    uri = mesh.nodes[HOST].listen_uri.replace("wss://", "ws://")
    with pytest.raises(ConnectionLost):
        await TensorChannel.connect(uri + "/shard", mesh.sign_open("node-a", _params(smollm2)),
                                    deadline_s=10)
    with pytest.raises(OSError):
        urllib.request.urlopen(uri.replace("ws://", "http://") + "/status", timeout=5)


# ---- events (issue 7 item 2) ----

def _scratch_event(tmp: Path, origin: str, sign: Any, type: str = CAPACITY,
                   payload: dict[str, Any] | None = None, skip: int = 0) -> Event:
    log = EventLog(tmp / f"{origin}-{os.urandom(4).hex()}.sqlite3", origin, signer=sign)
    try:
        for _ in range(skip):
            log.append(CAPACITY, {"skip": True})
        return log.append(type, payload or {"n": 1})
    finally:
        log.close()


async def _gossip(m: TestMesh, as_node: str, events: list[Event]) -> list[Event]:
    """Send `events` one message each as `as_node`; return what the node then holds."""
    ctx = m.client_ssl(as_node, HOST)
    async with connect(m.nodes[HOST].listen_uri + "/gossip", ssl=ctx, open_timeout=10) as ws:
        await ws.send(encode_hello(as_node, {}))
        for ev in events:
            await ws.send(encode_events([ev]))
        await asyncio.sleep(0.5)
    async with connect(m.nodes[HOST].listen_uri + "/gossip", ssl=ctx, open_timeout=10) as ws:
        await ws.send(encode_hello(as_node, {}))
        await ws.recv()  # the node's hello
        held: list[Event] = []
        try:
            while True:
                msg = decode_message(await asyncio.wait_for(ws.recv(), 1.0))
                held.extend(getattr(msg, "events", []))
        except TimeoutError:
            return held


async def test_tampered_and_foreign_events_are_dropped_not_gossiped(mesh, tmp_path, smollm2):
    a, stranger = mesh.key("node-a"), NodeKey.generate()
    good = _scratch_event(tmp_path, "node-a", a.sign)
    # a marker no timestamp can contain: digits alone appear in every log line's time
    forged = _scratch_event(tmp_path, "node-a", stranger.sign,
                            payload={"n": 666, "mark": "forged-zqx"})
    tampered = Event(good.event_id, good.origin, good.seq, good.type, good.payload,
                     good.ts, bytes([good.signature[0] ^ 1]) + good.signature[1:])
    foreign = _scratch_event(tmp_path, "node-x", stranger.sign)
    unsigned = _scratch_event(tmp_path, "node-a", None, skip=1)
    desc = ShardDescriptor.create(model_id=smollm2.model_id,
                                  weights_sha256=smollm2.weights_sha256, layer_range=(0, 29),
                                  host=HOST, endpoint="wss://10.9.9.9:1",
                                  max_concurrent_streams=8)
    hijack = _scratch_event(tmp_path, "node-a", a.sign, type=ADVERTISED,
                            payload=advertisement_payload(desc), skip=1)
    before = {r: _count(mesh, "hearthnet_events_rejected_total", reason=r)
              for r in ("bad_signature", "unknown_origin", "unsigned", "host_not_signer")}
    held = await _gossip(mesh, "node-g", [forged, tampered, foreign, good, unsigned, hijack])
    after = {r: _count(mesh, "hearthnet_events_rejected_total", reason=r) for r in before}
    assert after["bad_signature"] - before["bad_signature"] == 2
    assert after["unknown_origin"] - before["unknown_origin"] == 1
    assert after["unsigned"] - before["unsigned"] == 1
    assert after["host_not_signer"] - before["host_not_signer"] == 1
    ids = {e.event_id for e in held}
    assert good.event_id in ids  # relayed: signed by a member
    assert not ids & {forged.event_id, foreign.event_id, unsigned.event_id, hijack.event_id}
    assert not any(e.payload.get("n") == 666 for e in held)
    assert "forged-zqx" not in mesh.log_text(HOST)  # refusals are logged without payloads


# ---- hostile input (issue 7 item 6) ----

async def test_garbage_leaves_the_daemon_serving(mesh, smollm2):
    port = mesh.nodes[HOST].port
    for junk in (b"\x16\x03\x01\xff\xff" + os.urandom(300), b"GET / HTTP/1.1\r\n\r\n",
                 os.urandom(2000)):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.recv(100)
    ctx = mesh.client_ssl("node-a", HOST)
    for path in ("/shard", "/gossip", "/bus", "/nowhere"):
        async with connect(mesh.nodes[HOST].listen_uri + path, ssl=ctx,
                           open_timeout=10) as ws:
            with contextlib.suppress(ConnectionClosed):  # the node may hang up mid-flood
                for _ in range(40):
                    await ws.send(os.urandom(64))
                    await ws.send(msgpack.packb({"k": "events", "events": [{"o": 1}]}))
            # the node ends a garbage-sending connection itself (a TimeoutError fails);
            # the bus after a typed error frame, so its close may be a normal one
            await asyncio.wait_for(ws.wait_closed(), 15)
        assert ws.close_code is not None, path
    async with connect(mesh.nodes[HOST].uri + "/bus", open_timeout=10) as ws:
        await ws.send(os.urandom(100))
        with pytest.raises(ConnectionClosed):  # not a TimeoutError: the node hangs up
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    assert mesh.status(HOST)["node_id"] == HOST
    ch = await _open(mesh, mesh.sign_open("node-a", _params(smollm2)))
    await ch.close()
    assert mesh.nodes[HOST].proc.poll() is None


# ---- membership changes (issue 7 item 7) — keep last: it removes node-a ----

async def test_removed_member_is_refused_after_reload(mesh, smollm2, tmp_path):
    a = mesh.key("node-a")
    cfg = mesh.nodes[HOST].config
    text = cfg.read_text()
    rows = [r for r in tomllib.loads(text)["community"]["members"] if r["node_id"] != "node-a"]
    cfg.write_text(replace_member_tables(text, rows))
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "node", "--reload", "--config",
                        str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while '"reloaded"' not in mesh.log_text(HOST) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert '"reloaded"' in mesh.log_text(HOST)
    # new sessions: node-a's certificate is no longer pinned
    with pytest.raises((ConnectionLost, HearthNetError)):
        ch = await _open(mesh, mesh.sign_open("node-a", _params(smollm2)),
                         ssl=client_context(a, "node-a", mesh.directory("node-a"),
                                            expect=HOST))
        await ch.close()
    # new events: node-a's, relayed by a remaining member, are dropped
    before = _count(mesh, "hearthnet_events_rejected_total", reason="unknown_origin")
    late = _scratch_event(tmp_path, "node-a", a.sign, skip=5)
    held = await _gossip(mesh, "node-g", [late])
    assert late.event_id not in {e.event_id for e in held}
    assert _count(mesh, "hearthnet_events_rejected_total",
                  reason="unknown_origin") == before + 1
    assert any('"members_replaced"' in line and '"removed": ["node-a"]' in line
               for line in mesh.log_text(HOST).splitlines())


async def test_gossip_flood_is_cut_at_the_message_rate(mesh, smollm2):
    """A member's gossip connection over `[security] message_rate` is closed (issue 7 §6).

    Runs as node-g (a guest, still a member after the reload test removed node-a)."""
    from websockets.exceptions import ConnectionClosed

    ctx = mesh.client_ssl("node-g", HOST)
    sent = 0
    closed_code = None
    async with connect(mesh.nodes[HOST].listen_uri + "/gossip", ssl=ctx,
                       open_timeout=10) as ws:
        await ws.send(encode_hello("node-g", {}))
        try:
            for _ in range(5000):  # far above the default burst of 400 messages
                await ws.send(encode_events([]))
                sent += 1
            await asyncio.wait_for(ws.wait_closed(), 10)
        except ConnectionClosed:
            pass
        closed_code = ws.close_code
    assert closed_code == 1008
    # and the node goes on serving: a fresh, polite connection works
    async with connect(mesh.nodes[HOST].listen_uri + "/gossip", ssl=ctx,
                       open_timeout=10) as ws:
        await ws.send(encode_hello("node-g", {}))
        assert decode_message(await asyncio.wait_for(ws.recv(), 5)) is not None
