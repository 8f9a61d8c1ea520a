"""Which requests the HTTP API serves at all, and how strictly a call's fields are typed.

A loopback listener is reachable by every web page the machine's browser opens, so the
API checks `Host` (DNS rebinding) and `Origin` (another site's fetch or form), takes only
``application/json`` POST bodies of bounded nesting, and gives a client a bounded time
to send its request. Every call parameter has an exact JSON type and range, on the HTTP
path (`openai_compat`) and the bus path (`DistributedChatParams.from_dict`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from hearthnet.api.openai_compat import Limits, json_depth_within
from hearthnet.api.server import ApiServer, HostPolicy, split_host
from hearthnet.distributed_inference.orchestrator.request import DistributedChatParams
from hearthnet.errors import BadRequest
from tests.unit.test_api_openai import DONE, MSG, ScriptedNode, tok

BODY = {"model": "smollm2", "messages": MSG}
JSON = {"Content-Type": "application/json"}

Serve = Callable[..., Any]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[ApiServer] = []

    async def make(**kw: Any) -> tuple[ScriptedNode, ApiServer]:
        node = ScriptedNode([tok("ok", 0), DONE])
        srv = ApiServer(node, listen_host=kw.pop("host", "127.0.0.1"), listen_port=0,
                        keys=[], limits=Limits(max_messages=4, max_tokens=64),
                        max_body_bytes=1 << 20, require_key=False, **kw)
        await srv.start()
        servers.append(srv)
        return node, srv

    yield make
    for s in servers:
        await s.stop()


async def _post(srv: ApiServer, body: Any = None, *, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(
            srv.url + "/v1/chat/completions", json=body, data=data, headers=headers) as r:
        return r.status, await r.json()


async def _get(srv: ApiServer, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(srv.url + path, headers=headers) as r:
        return r.status, (await r.json() if r.content_type == "application/json"
                          else await r.text())


# ---- Content-Type, Host, Origin ----

async def test_a_post_that_is_not_application_json_is_415_before_work(serve: Serve) -> None:
    node, srv = await serve()
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-"
                                                      "urlencoded"}, {}):
        status, body = await _post(srv, data=b'{"model": "smollm2", "messages": []}',
                                   headers=headers)
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", headers
        assert "application/json" in body["error"]["message"]
    status, _ = await _post(srv, BODY, headers={"Content-Type": "application/json; "
                                                                "charset=utf-8"})
    assert status == 200
    assert len(node.calls) == 1  # only the JSON one reached the node


async def test_a_foreign_host_is_403_on_every_route(serve: Serve) -> None:
    node, srv = await serve()
    for host in ("evil.example", f"evil.example:{srv.port}", f"127.0.0.1:{srv.port + 1}",
                 f"localhost.evil.example:{srv.port}", f"10.0.0.5:{srv.port}"):
        for path in ("/api/status", "/v1/models", "/"):
            status, body = await _get(srv, path, {"Host": host})
            assert status == 403 and body["error"]["code"] == "forbidden", (host, path)
            assert "allowed_hosts" in body["error"]["message"]
        status, body = await _post(srv, BODY, headers={"Host": host})
        assert status == 403
    assert node.calls == []
    text = node.metrics.render().decode()
    assert 'hearthnet_auth_failures_total{reason="api_host"} 20.0' in text


async def test_a_foreign_origin_is_403_and_the_own_page_is_served(serve: Serve) -> None:
    node, srv = await serve()
    own = f"127.0.0.1:{srv.port}"
    for origin in ("http://evil.example", f"http://evil.example:{srv.port}", "null",
                   f"https://{own}", f"http://localhost:{srv.port}"):
        status, body = await _post(srv, BODY, headers={"Host": own, "Origin": origin})
        assert status == 403 and body["error"]["code"] == "forbidden", origin
        assert "allowed_origins" in body["error"]["message"]
    assert node.calls == []
    # the status page's own fetches: same origin, under every loopback name
    for host in (own, f"localhost:{srv.port}", f"LOCALHOST.:{srv.port}", f"[::1]:{srv.port}"):
        status, body = await _post(srv, BODY, headers={"Host": host,
                                                       "Origin": f"http://{host}"})
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok", host
        status, _ = await _get(srv, "/api/status", {"Host": host, "Origin": f"http://{host}"})
        assert status == 200
    status, _ = await _get(srv, "/api/status", {"Host": own})  # no Origin: not a browser's
    assert status == 200
    assert 'reason="api_origin"} 5.0' in node.metrics.render().decode()


async def test_configured_hosts_and_origins_are_served(serve: Serve) -> None:
    _, srv = await serve(allowed_hosts=["hearth.lan", "localhost:9000"],
                            allowed_origins=["https://hearth.lan"])
    for host, origin in (("hearth.lan", "https://hearth.lan"),
                         ("hearth.lan:8443", "https://hearth.lan/"),
                         ("localhost:9000", "http://localhost:9000")):
        status, _ = await _post(srv, BODY, headers={"Host": host, "Origin": origin})
        assert status == 200, host
    for host in ("localhost:9001", "other.lan"):
        status, _ = await _post(srv, BODY, headers={"Host": host})
        assert status == 403, host
    status, _ = await _post(srv, BODY, headers={"Host": "hearth.lan",
                                                "Origin": "https://evil.example"})
    assert status == 403


def test_host_policy_by_bind_address() -> None:
    assert split_host("[::1]:80") == ("::1", 80) and split_host("Hearth.LAN.") == \
        ("hearth.lan", None)
    for bad in ("", ":80", "::1", "[::1", "[nope]:1", "a:b", "a:123456", "a:१२"):
        assert split_host(bad) is None, bad
    wild = HostPolicy.build("0.0.0.0", 8080)
    assert wild.host_ok("192.168.1.20", 8080) and wild.host_ok("localhost", 8080)
    assert not wild.host_ok("mynode.local", 8080) and not wild.host_ok("10.0.0.1", 8081)
    lan = HostPolicy.build("192.168.1.20", 80)
    assert lan.host_ok("192.168.1.20", None) and not lan.host_ok("localhost", 80)
    six = HostPolicy.build("[::1]", 5000)
    assert six.host_ok("::1", 5000) and six.host_ok("127.0.0.1", 5000)


# ---- the body: nesting, and time to send it ----

async def test_deep_nesting_is_a_400_before_the_parser_recurses(serve: Serve) -> None:
    node, srv = await serve()
    deep = b'{"model": "smollm2", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = await _post(srv, data=deep, headers=JSON)
    assert status == 400 and body["error"]["code"] == "bad_request"
    assert "32 deep" in body["error"]["message"]
    status, body = await _post(srv, data=b"[" * 200_000, headers=JSON)  # unbalanced too
    assert status == 400 and body["error"]["code"] == "bad_request"
    assert node.calls == []


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    for d in (1, 31, 32):
        assert json_depth_within(b'{"a":' * d + b"1" + b"}" * d, 32), d
    assert not json_depth_within(b"[" * 33 + b"]" * 33, 32)
    assert not json_depth_within(b'[{"a": [' * 11 + b"]}]" * 11, 32)  # 33: mixed kinds
    assert json_depth_within(b'{"t": "[[[[{{{{ \\" [[[[", "u": "]]]]"}', 1)
    assert json_depth_within(b"1", 0) and not json_depth_within(b"[1, 2", 32)
    assert not json_depth_within(b'["' + b'\\"' * 100_000, 32)  # unterminated: one scan


async def _raw(srv: ApiServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", srv.port)


async def test_a_half_sent_header_is_disconnected_within_the_read_timeout(
        serve: Serve) -> None:
    _, srv = await serve(read_timeout_s=0.5)
    conns = [await _raw(srv) for _ in range(5)]
    t0 = time.monotonic()
    for _, w in conns:
        w.write(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await w.drain()
    for r, _ in conns:  # EOF: the server closed it; not a response
        assert await asyncio.wait_for(r.read(), 5) == b""
    assert 0.4 < time.monotonic() - t0 < 3
    for _, w in conns:
        w.close()


async def test_a_slow_body_is_408_and_a_long_answer_is_not_cut(serve: Serve) -> None:
    node, srv = await serve(read_timeout_s=0.4)
    r, w = await _raw(srv)
    w.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
    await w.drain()
    head = await asyncio.wait_for(r.readline(), 5)
    assert head.startswith(b"HTTP/1.1 408"), head
    w.close()
    node.frames = [tok("a", 0), tok("b", 1), tok("c", 2), DONE]
    node.gate = asyncio.Event()  # the answer pauses after two tokens, as a slow mesh
    async with aiohttp.ClientSession() as s:
        resp = await s.post(srv.url + "/v1/chat/completions", json={**BODY, "stream": True})
        assert resp.status == 200
        await resp.content.readline()
        with pytest.raises(TimeoutError):  # longer than read_timeout_s: still open
            await asyncio.wait_for(resp.content.read(), 1.0)
        node.gate.set()
        assert (await asyncio.wait_for(resp.content.read(), 5)).endswith(b"[DONE]\n\n")
        resp.close()


# ---- each call parameter's exact type and range ----

HTTP_BAD: list[tuple[str, dict[str, Any]]] = [
    ("hearthnet.fallback_to_local", {"hearthnet": {"fallback_to_local": "no"}}),
    ("hearthnet.fallback_to_local", {"hearthnet": {"fallback_to_local": 0}}),
    ("hearthnet.max_shards", {"hearthnet": {"max_shards": 0}}),
    ("hearthnet.max_shards", {"hearthnet": {"max_shards": -1}}),
    ("hearthnet.max_shards", {"hearthnet": {"max_shards": 2.0}}),
    ("hearthnet.max_shards", {"hearthnet": {"max_shards": True}}),
    ("hearthnet.timeout_s", {"hearthnet": {"timeout_s": "5"}}),
    ("hearthnet.timeout_s", {"hearthnet": {"timeout_s": True}}),
    ("hearthnet.timeout_s", {"hearthnet": {"timeout_s": 0}}),
    ("hearthnet.wire_dtype", {"hearthnet": {"wire_dtype": 16}}),
    ("hearthnet.weights", {"hearthnet": {"weights": ["exact"]}}),
    ("n", {"n": 1.0}),
    ("n", {"n": True}),
    ("n", {"n": "1"}),
    ("stream", {"stream": "yes"}),
    ("stream", {"stream": 1}),
    ("stream_options.include_usage", {"stream_options": {"include_usage": "yes"}}),
    ("stream_options", {"stream_options": []}),
    ("max_tokens", {"max_tokens": 8.0}),
    ("max_completion_tokens", {"max_completion_tokens": True}),
    ("temperature", {"temperature": "0"}),
    ("top_p", {"top_p": 0}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 1.5}),
    ("messages[0].role", {"messages": [{"role": ["user"], "content": "hi"}]}),
    ("messages[0].role", {"messages": [{"role": {"a": 1}, "content": "hi"}]}),
]


async def test_each_bad_field_over_http_is_a_400_naming_it(serve: Serve) -> None:
    node, srv = await serve()
    async with aiohttp.ClientSession() as s:
        for field, extra in HTTP_BAD:
            async with s.post(srv.url + "/v1/chat/completions", json={**BODY, **extra}) as r:
                err = (await r.json())["error"]
                assert (r.status, err["code"], err["param"]) == \
                    (400, "bad_request", field), extra
                assert field.rsplit(".", 1)[-1].split("[")[0] in err["message"], err
    assert node.calls == []
    # the right types pass; an int is a number, null is the default
    status, _ = await _post(srv, {**BODY, "n": 1, "stream": None, "seed": 0,
                                  "hearthnet": {"fallback_to_local": False, "max_shards": 2,
                                                "timeout_s": 5, "wire_dtype": None}})
    assert status == 200
    assert node.calls[0]["params"] == {
        "sampling": {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "seed": 0,
                     "stop": []},
        "fallback_to_local": False, "max_shards": 2, "timeout_s": 5.0}


BUS_BAD: list[tuple[str, dict[str, Any]]] = [
    ("params.fallback_to_local", {"fallback_to_local": "no"}),
    ("params.fallback_to_local", {"fallback_to_local": 1}),
    ("params.max_shards", {"max_shards": 0}),
    ("params.max_shards", {"max_shards": -3}),
    ("params.max_shards", {"max_shards": 257}),
    ("params.max_shards", {"max_shards": 4.0}),
    ("params.max_shards", {"max_shards": False}),
    ("params.max_shards", {"max_shards": "4"}),
    ("params.timeout_s", {"timeout_s": True}),
    ("params.timeout_s", {"timeout_s": "5"}),
    ("params.timeout_s", {"timeout_s": 0.01}),
    ("params.timeout_s", {"timeout_s": math.inf}),
    ("params.timeout_s", {"timeout_s": math.nan}),
    ("params.fallback_after_failures", {"fallback_after_failures": 0}),
    ("params.fallback_after_failures", {"fallback_after_failures": 2.0}),
    ("params.wire_dtype", {"wire_dtype": 16}),
    ("params.wire_wide_dtype", {"wire_wide_dtype": b"bf16"}),
    ("params.weights", {"weights": 8}),
    ("params", {"fallback_to_locl": False}),
    ("params", {1: 2, "a": 3}),
    ("params.sampling", {"sampling": {"top_q": 1}}),
    ("params.sampling", {"sampling": []}),
    ("params.sampling.stop", {"sampling": {"stop": "x"}}),
]


@pytest.mark.parametrize(("field", "params"), BUS_BAD,
                         ids=[f"{f}={next(iter(p.values()))!r}"[:40] for f, p in BUS_BAD])
def test_each_bad_param_on_the_bus_is_a_bad_request_naming_it(field: str,
                                                              params: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as e:
        DistributedChatParams.from_dict(params, DistributedChatParams())
    assert e.value.code == "bad_request" and e.value.details["param"] == field
    assert field.rsplit(".", 1)[-1] in e.value.message or field == "params"


def test_bus_params_of_the_right_types_keep_their_values_and_null_is_the_default() -> None:
    defaults = DistributedChatParams(max_shards=8, fallback_after_failures=3)
    p = DistributedChatParams.from_dict({"fallback_to_local": False, "max_shards": 2,
                                         "timeout_s": 5, "wire_dtype": "compact",
                                         "weights": "exact", "fallback_after_failures": None},
                                        defaults)
    assert p.fallback_to_local is False and p.max_shards == 2 and p.weights == "exact"
    assert p.timeout_s == 5.0 and isinstance(p.timeout_s, float)
    assert p.fallback_after_failures == 3 and p.wire_dtype == "compact"
    assert DistributedChatParams.from_dict({}, defaults) == defaults


def test_the_api_section_takes_only_host_and_origin_shapes() -> None:
    from pydantic import ValidationError

    from hearthnet.config import ApiSection

    ok = ApiSection(allowed_hosts=["hearth.lan", "localhost:9000", "[::1]:8080"],
                    allowed_origins=["https://hearth.lan", "http://10.0.0.2:8080"])
    assert ok.read_timeout_s == 10.0 and ApiSection().allowed_hosts == []
    for bad in ({"allowed_hosts": ["*"]}, {"allowed_hosts": ["http://hearth.lan"]},
                {"allowed_origins": ["*"]}, {"allowed_origins": ["hearth.lan"]},
                {"allowed_origins": ["https://hearth.lan/path"]}, {"read_timeout_s": 0}):
        with pytest.raises(ValidationError):
            ApiSection(**bad)
