"""The node's HTTP listener: OpenAI-compatible API and web status page (DESIGN.md decision 13).

An aiohttp application running in the node's own event loop (asyncio/uvloop): aiohttp is
one dependency, serves server-sent events with a plain `StreamResponse`, and cancels a
handler whose client went away (``handler_cancellation``), so an abandoned stream closes its
shard sessions at once. Routes:

- ``GET /v1/models`` — the stored models, with their layer coverage in ``hearthnet``;
- ``POST /v1/chat/completions`` — streaming (SSE, one chunk per ``token_delta``, ``[DONE]``)
  or not; errors in OpenAI's shape with the matching HTTP status (`openai_compat`);
- ``GET /api/status`` — the node's `mesh_status` JSON, polled by the page;
- ``GET /`` and ``/static/*`` — the status page (plain HTML/CSS/JS, no build step, no CDN).

Who may call (DESIGN.md decision 13): on a loopback address anyone on this machine; on any other
address every ``/v1`` and ``/api`` call needs ``Authorization: Bearer <key>``, compared in
constant time (`hmac.compare_digest`); refusals count in
``hearthnet_auth_failures_total{reason="api_key"}``. Body size, message count and
``max_tokens`` are bounded before any work; a call over ``max_concurrent_pipelines`` is
refused with 429 instead of queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from hearthnet.api.openai_compat import (
    CompletionBuilder,
    Limits,
    ParsedChat,
    openai_error,
    parse_chat_request,
)
from hearthnet.errors import HearthNetError, ModelNotFound
from hearthnet.frames import StreamFrame
from hearthnet.observability import Metrics, get_logger

log = get_logger("api")

STATIC = Path(__file__).parent / "static"
Json = dict[str, Any]  # an OpenAI-shaped chunk
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PUBLIC = ("/", "/favicon.ico")  # the page itself (and /static/*) holds no mesh data


class ApiHost(Protocol):
    """What the API needs of its node."""

    node_id: str
    metrics: Metrics

    def chat(self, args: dict[str, Any]) -> AsyncGenerator[StreamFrame, None]: ...

    def model_known(self, name: str) -> None: ...

    def pipelines_free(self) -> bool: ...

    async def status(self) -> dict[str, Any]: ...


def _error(code: str, message: str, param: str | None = None) -> web.Response:
    status, body = openai_error(code, message, param=param)
    return web.json_response(body, status=status)


class ApiServer:
    """The HTTP listener of one node; `start` binds it, `stop` closes it."""

    def __init__(self, host: ApiHost, *, listen_host: str, listen_port: int,
                 keys: list[str], limits: Limits, max_body_bytes: int,
                 require_key: bool) -> None:
        self.host = host
        self.listen_host, self.listen_port = listen_host, listen_port
        self._keys = [k.encode() for k in keys]
        self.require_key = require_key
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = self.listen_host if ":" not in self.listen_host else f"[{self.listen_host}]"
        return f"http://{host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[self._guard])
        app.router.add_get("/", self._page)
        app.router.add_static("/static/", STATIC, show_index=False)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/api/status", self._status)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.listen_host, self.listen_port,
                           shutdown_timeout=2.0)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else self.listen_port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- who may call: loopback by default, keys on the LAN (DESIGN.md decision 13) ----

    def _authorised(self, request: web.Request) -> bool:
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        ok = False
        for key in self._keys:  # every key compared: the time does not tell which matched
            ok |= hmac.compare_digest(given, key)
        return ok

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        public = request.path in _PUBLIC or request.path.startswith("/static/")
        if self.require_key and not public and not self._authorised(request):
            self.host.metrics.auth_failures_total.labels(reason="api_key").inc()
            log.info("api_refused", path=request.path[:64], peer=request.remote)
            refusal = _error("auth_failed", "a valid API key is required: "
                          "Authorization: Bearer <key> (see [api] keys)")
            refusal.headers["WWW-Authenticate"] = "Bearer"
            return refusal
        resp: web.StreamResponse
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            if e.status == 413:
                resp = _error("request_too_large", f"the body is over {self.max_body_bytes} "
                              "bytes ([api] max_body_bytes)")
            elif e.status in (404, 405):
                resp = _error("not_found" if e.status == 404 else "method_not_allowed",
                              f"{request.method} {request.path[:200]}: {e.reason}")
            else:
                raise
        self.host.metrics.api_requests_total.labels(
            path=_route_name(request), status=str(resp.status)).inc()
        return resp

    # ---- routes ----

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html",
                                headers={"Cache-Control": "no-cache"})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(await self.host.status())

    async def _models(self, request: web.Request) -> web.Response:
        st = await self.host.status()
        data = [{"id": m["alias"], "object": "model", "created": 0, "owned_by": "hearthnet",
                 "hearthnet": {k: m[k] for k in ("model_id", "num_layers", "fully_covered",
                                                 "uncovered", "coverage") if k in m}}
                for m in st.get("models", [])]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > self.max_body_bytes:
            return _error("request_too_large", f"the body is over {self.max_body_bytes} "
                          "bytes ([api] max_body_bytes)")
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            return _error("bad_request", f"the body is not JSON: {e}")
        try:
            parsed = parse_chat_request(body, self.limits)
            self.host.model_known(parsed.model)
        except ModelNotFound as e:
            return _error("model_not_found", e.message, "model")
        except HearthNetError as e:
            return _error(e.code, e.message, e.details.get("param"))
        if not self.host.pipelines_free():
            return _error("rate_limit_exceeded", "every pipeline slot of this node is busy "
                          "(max_concurrent_pipelines); retry shortly")
        async with contextlib.aclosing(self.host.chat(parsed.args)) as frames:
            return await self._answer(request, parsed, frames)

    async def _answer(self, request: web.Request, parsed: ParsedChat,
                      frames: AsyncIterator[StreamFrame]) -> web.StreamResponse:
        """Run the call; its first token (or error) decides the HTTP status."""
        out = CompletionBuilder(parsed.model)
        first: Json | None = None
        try:
            async for frame in frames:
                chunk = out.feed(frame)
                if chunk is not None or out.done is not None:
                    first = chunk
                    break
        except HearthNetError as e:  # failed before the first token: an HTTP error
            return _error(e.code, e.message)
        if not parsed.stream:
            try:
                async for frame in frames:
                    out.feed(frame)
            except HearthNetError as e:
                return _error(e.code, e.message)
            return web.json_response(out.response())
        return await self._stream(request, parsed, out, first, frames)

    async def _stream(self, request: web.Request, parsed: ParsedChat, out: CompletionBuilder,
                      first: Json | None, frames: AsyncIterator[StreamFrame]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            await _sse(resp, out.first_chunk())
            if first is not None:
                await _sse(resp, first)
            try:
                async for frame in frames:
                    chunk = out.feed(frame)
                    if chunk is not None:
                        await _sse(resp, chunk)
            except HearthNetError as e:  # mid-stream: OpenAI's error event, no [DONE]
                await _sse(resp, openai_error(e.code, e.message)[1])
                return resp
            await _sse(resp, out.last_chunk())
            if parsed.include_usage:
                await _sse(resp, out.usage_chunk())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            log.info("api_client_gone", id=out.id)  # aclosing closes the shard sessions
        except asyncio.CancelledError:
            log.info("api_client_gone", id=out.id)
            raise
        return resp


async def _sse(resp: web.StreamResponse, obj: Json) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _route_name(request: web.Request) -> str:
    """A bounded label for the request metric (the matched route, not the raw path)."""
    info = request.match_info.route.resource
    return info.canonical if info is not None else "other"
