"""`HostProber` (issue 15 §6, issue 17 §2): a host is down after N failed probes, up again at
once (`layer_params` from SmolLM2's header: tests/integration/test_layer_params.py)."""

from __future__ import annotations

import asyncio

from hearthnet.distributed_inference.directory.liveness import HostProber


async def test_prober_marks_down_after_n_failures_and_up_again():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    prober = HostProber(failures_to_down=2, timeout_s=1.0)
    hosts = {"b": f"wss://127.0.0.1:{port}"}
    assert not await prober.probe(hosts) and not prober.is_down("b")
    server.close()
    await server.wait_closed()
    assert not await prober.probe(hosts)  # one failure is not enough
    assert await prober.probe(hosts) and prober.is_down("b")
    assert not await prober.probe(hosts)  # no change: still down
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
    try:
        assert await prober.probe(hosts) and not prober.is_down("b")
    finally:
        server.close()
        await server.wait_closed()
    prober.down_since["gone"] = 0.0
    await prober.probe({})  # hosts no longer advertised are forgotten
    assert not prober.is_down("gone")

