"""The node's HTTP listener: OpenAI-compatible API and web status page (DESIGN.md decision 13).

An aiohttp application running in the node's own event loop (asyncio/uvloop): aiohttp is
one dependency, serves server-sent events with a plain `StreamResponse`, and cancels a
handler whose client went away (``handler_cancellation``), so an abandoned stream closes its
shard sessions at once. Routes:

- ``GET /v1/models`` — the stored models, with their layer coverage in ``hearthnet``;
  ``GET /v1/models/{id}`` one of them (by alias, model id or weights hash), or a 404
  ``model_not_found``;
- ``POST /v1/chat/completions`` — streaming (SSE, one chunk per ``token_delta``, ``[DONE]``)
  or not; errors in OpenAI's shape with the matching HTTP status (`openai_compat`);
- ``POST /v1/completions`` — the legacy text completion: a raw prompt continued without the
  chat template, in OpenAI's ``text_completion`` shape, streaming or not;
- ``GET /api/status`` — the node's `mesh_status` JSON, polled by the page;
- ``GET /api/plan`` — the live nodes' facts a plan needs (budgets, speeds, layers held, the
  measured hop cost), and with ``?model=NAME`` (a model of this node's store) the plan
  itself: who would host which layers, what each fetches, whether it fits, predicted tok/s
  (`distributed_inference.placement.predict`; `hearthnet plan`);
- ``GET /`` and ``/static/*`` — the status page (plain HTML/CSS/JS, no build step, no CDN).

Who may call (DESIGN.md decision 13): on a loopback address anyone on this machine; on any other
address every ``/v1`` and ``/api`` call needs ``Authorization: Bearer <key>``, compared in
constant time (`hmac.compare_digest`); refusals count in
``hearthnet_auth_failures_total{reason="api_key"}``. Body size, message count and
``max_tokens`` are bounded before any work; a call over ``max_concurrent_pipelines`` is
refused with 429 instead of queueing.

Which pages may call (a loopback listener is no defence against the browser of the same
machine): every request's ``Host`` must name this listener (`HostPolicy`) or it is refused
with 403 — a DNS-rebinding page sends its own name; an ``Origin``, when present, must be
the node's own page (``http://`` + the Host) or a configured one — another site's fetch or
form; a POST body must be ``application/json`` (415), which no form and no CORS-free fetch
can send, and nests at most ``Limits.max_json_depth`` deep. A client has ``read_timeout_s``
to send its headers (aiohttp's ``keepalive_timeout``: its timer runs from the connection's
start and closes it while no complete request has arrived) and again its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from hearthnet.api.openai_compat import (
    CompletionBuilder,
    Limits,
    ParsedChat,
    TextCompletionBuilder,
    find_model,
    model_object,
    openai_error,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from hearthnet.errors import HearthNetError, ModelNotFound
from hearthnet.frames import StreamFrame
from hearthnet.observability import Metrics, get_logger

log = get_logger("api")

STATIC = Path(__file__).parent / "static"
Json = dict[str, Any]  # an OpenAI-shaped chunk
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PUBLIC = ("/", "/favicon.ico")  # the page itself (and /static/*) holds no mesh data
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD = frozenset({"0.0.0.0", "::"})


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


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _norm(name: str) -> str:
    """A host name compared case-blind without its root dot; an IP address canonical."""
    ip = _ip(name)
    return ip.compressed if ip is not None else name.lower().rstrip(".")


def split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port or None) of a ``Host`` value (RFC 9110 §7.2; an IPv6 address in
    brackets, RFC 3986 §3.2.2), the name normalised; None when it is malformed."""
    v = value.strip()
    if v.startswith("["):
        name, sep, rest = v[1:].partition("]")
        if not sep or _ip(name) is None or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
    elif v.count(":") > 1:
        return None  # an IPv6 address without brackets
    else:
        name, _, port = v.partition(":")
    if not name or (port and not (port.isascii() and port.isdigit() and len(port) <= 5)):
        return None
    return _norm(name), int(port) if port else None


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` and ``Origin`` values name this listener (DNS rebinding, cross-site
    requests): a browser always sends the name the page's script used, so a rebinding
    page's request carries the attacker's name, never one of these.

    - this listener's own address and port (a request without a port is for port 80);
    - ``localhost``, ``127.0.0.1`` and ``::1`` on a loopback or wildcard bind;
    - any IP address on a wildcard bind (a page at ``http://<ip>:<port>`` that reaches
      this listener was served by it: an address is not a name a rebinding site controls);
    - ``extra_hosts``: a bare name with any port, ``name:port`` with that port only.

    An ``Origin`` is the node's own page (``http://`` + a Host above) or in ``origins``.
    """

    listen_host: str
    port: int
    extra_hosts: frozenset[tuple[str, int | None]] = frozenset()
    origins: frozenset[str] = frozenset()

    @classmethod
    def build(cls, listen_host: str, port: int, hosts: Sequence[str] = (),
              origins: Sequence[str] = ()) -> HostPolicy:
        extra = {h for h in map(split_host, hosts) if h is not None}
        return cls(listen_host.strip("[]"), port, frozenset(extra),
                   frozenset(o.lower().rstrip("/") for o in origins))

    def host_ok(self, name: str, port: int | None) -> bool:
        if (name, port) in self.extra_hosts or (name, None) in self.extra_hosts:
            return True
        if (port if port is not None else 80) != self.port:
            return False
        bound = self.listen_host
        if bound in _WILDCARD:
            return name in _LOOPBACK_NAMES or _ip(name) is not None
        if name == _norm(bound):
            return True
        ip = _ip(bound)
        loopback = bound == "localhost" or (ip is not None and ip.is_loopback)
        return loopback and name in _LOOPBACK_NAMES

    def origin_ok(self, origin: str, host: str) -> bool:
        """`origin` (a browser's ``Origin``) is this host's own page, or a configured one."""
        origin = origin.strip().lower().rstrip("/")
        return origin == "http://" + host.strip().lower() or origin in self.origins


class ApiServer:
    """The HTTP listener of one node; `start` binds it, `stop` closes it."""

    def __init__(self, host: ApiHost, *, listen_host: str, listen_port: int,
                 keys: list[str], limits: Limits, max_body_bytes: int,
                 require_key: bool, allowed_hosts: Sequence[str] = (),
                 allowed_origins: Sequence[str] = (), read_timeout_s: float = 10.0) -> None:
        self.host = host
        self.listen_host, self.listen_port = listen_host, listen_port
        self._keys = [k.encode() for k in keys]
        self.require_key = require_key
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts, self.allowed_origins = list(allowed_hosts), list(allowed_origins)
        self.read_timeout_s = read_timeout_s
        self.policy = HostPolicy.build(listen_host, listen_port)  # its port once bound
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._sizes: dict[tuple[str, str], Any] = {}  # /api/plan: headers read once

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
        # a model id may hold a "/" (a Hugging Face repo id), percent-encoded or not
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/plan", self._plan)
        return app

    async def start(self) -> None:
        # keepalive_timeout is aiohttp's only timer on a request still being read: armed
        # when the connection opens and after each answer, it closes the connection while
        # no complete request head has arrived (a half-sent header is not held open)
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                     keepalive_timeout=self.read_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.listen_host, self.listen_port,
                           shutdown_timeout=2.0)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = int(sockets[0].getsockname()[1]) if sockets else self.listen_port
        self.policy = HostPolicy.build(self.listen_host, self.port, self.allowed_hosts,
                                       self.allowed_origins)

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

    def _refuse_page(self, request: web.Request) -> web.Response | None:
        """403 for a request that names another host or comes from another site's page."""
        raw = request.headers.get("Host", "")
        host = split_host(raw)
        if host is None:  # RFC 9112 §3.2: a request without a valid Host is a 400
            return _error("bad_request", "a valid Host header is required")
        origin = request.headers.get("Origin")
        if not self.policy.host_ok(*host):
            reason, why = "api_host", (f"Host {raw[:100]!r} is not this node's API (port "
                                       f"{self.port}); a name it is reached by must be "
                                       "listed in [api] allowed_hosts")
        elif origin is not None and not self.policy.origin_ok(origin, raw):
            reason, why = "api_origin", (f"requests from the page at {origin[:100]!r} are "
                                         "refused: only the node's own status page, or an "
                                         "[api] allowed_origins entry, may call this API "
                                         "from a browser")
        else:
            return None
        self.host.metrics.auth_failures_total.labels(reason=reason).inc()
        log.info("api_refused", reason=reason, path=request.path[:64], peer=request.remote)
        return _error("forbidden", why)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        public = request.path in _PUBLIC or request.path.startswith("/static/")
        refusal = self._refuse_page(request)
        if refusal is not None:
            return refusal
        if self.require_key and not public and not self._authorised(request):
            self.host.metrics.auth_failures_total.labels(reason="api_key").inc()
            log.info("api_refused", path=request.path[:64], peer=request.remote)
            refusal = _error("auth_failed", "a valid API key is required: "
                          "Authorization: Bearer <key> (see [api] keys)")
            refusal.headers["WWW-Authenticate"] = "Bearer"
            return refusal
        if request.method == "POST" and request.content_type != "application/json":
            # no HTML form and no fetch without a CORS preflight can send this type
            return _error("unsupported_media_type", "a POST body must be JSON, sent with "
                          "Content-Type: application/json")
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

    async def _plan(self, request: web.Request) -> web.Response:
        """The facts of a plan, and the plan of ``?model=`` (a stored model) on them."""
        name = request.query.get("model")
        try:
            return web.json_response(await plan_body(self.host, name, self._sizes))
        except ModelNotFound as e:
            return _error("model_not_found", e.message, "model")
        except HearthNetError as e:
            return _error("bad_request", e.message, "model")

    async def _models(self, request: web.Request) -> web.Response:
        st = await self.host.status()
        data = [model_object(m) for m in st.get("models", [])]
        return web.json_response({"object": "list", "data": data})

    async def _model(self, request: web.Request) -> web.Response:
        """One model object (OpenAI's ``models.retrieve``), or a 404 ``model_not_found``."""
        name = request.match_info["model"]
        found = find_model((await self.host.status()).get("models", []), name)
        if found is None:
            return _error("model_not_found", f"unknown model {name[:200]!r}; "
                          "GET /v1/models lists the models of this node", "model")
        return web.json_response(found)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, parse_chat_request, CompletionBuilder)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        """A text completion: the same call with a raw prompt instead of messages."""
        return await self._call(request, parse_completion_request, TextCompletionBuilder)

    async def _call(self, request: web.Request,
                    parse: Callable[[Any, Limits], ParsedChat],
                    builder: type[CompletionBuilder] | type[TextCompletionBuilder]
                    ) -> web.StreamResponse:
        if (request.content_length or 0) > self.max_body_bytes:
            return _error("request_too_large", f"the body is over {self.max_body_bytes} "
                          "bytes ([api] max_body_bytes)")
        try:
            async with asyncio.timeout(self.read_timeout_s):
                raw = await request.read()
        except TimeoutError:
            return _error("request_timeout", f"the body did not arrive within "
                          f"{self.read_timeout_s:g} s ([api] read_timeout_s)")
        try:
            parsed = parse(parse_json_body(raw, self.limits), self.limits)
            self.host.model_known(parsed.model)
        except ModelNotFound as e:
            return _error("model_not_found", e.message, "model")
        except HearthNetError as e:
            return _error(e.code, e.message, e.details.get("param"))
        if not self.host.pipelines_free():
            return _error("rate_limit_exceeded", "every pipeline slot of this node is busy "
                          "(max_concurrent_pipelines); retry shortly")
        out = builder(parsed.model, parsed.logprobs)
        if isinstance(out, CompletionBuilder):  # the tool calls its text may hold
            out.tools, out.parallel_tools = parsed.tools, parsed.parallel_tools
        async with contextlib.aclosing(self.host.chat(parsed.args)) as frames:
            return await self._answer(request, parsed, out, frames)

    async def _answer(self, request: web.Request, parsed: ParsedChat,
                      out: CompletionBuilder | TextCompletionBuilder,
                      frames: AsyncIterator[StreamFrame]) -> web.StreamResponse:
        """Run the call; its first token (or error) decides the HTTP status."""
        first: Json | None = None
        try:
            async for frame in frames:
                chunk = out.feed(frame)
                if chunk is not None or out.done is not None:
                    first = chunk
                    break
        except HearthNetError as e:  # failed before the first token: an HTTP error
            return _error(e.code, e.message, e.details.get("param"))
        if not parsed.stream:
            try:
                async for frame in frames:
                    out.feed(frame)
            except HearthNetError as e:
                return _error(e.code, e.message)
            return web.json_response(out.response())
        return await self._stream(request, parsed, out, first, frames)

    async def _stream(self, request: web.Request, parsed: ParsedChat,
                      out: CompletionBuilder | TextCompletionBuilder, first: Json | None,
                      frames: AsyncIterator[StreamFrame]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            opening = out.first_chunk()  # chat's role chunk; a text completion has none
            if opening is not None:
                await _sse(resp, opening)
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
            for chunk in out.pending_chunks():  # held-back text: tool calls, or content
                await _sse(resp, chunk)
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


async def plan_body(host: Any, name: str | None, cache: dict[tuple[str, str], Any]
                    ) -> dict[str, Any]:
    """``/api/plan``'s answer (see the module docstring) from what `host` knows: its
    status, the capacity events (`PlacementView`), its model store's headers, its own
    hop-overhead histogram. Headers are read (once per weights hash) off the event loop."""
    from hearthnet.distributed_inference.placement import predict

    status = await host.status()
    models = getattr(host, "models", None)
    view = getattr(host, "placement", None)
    cfg = getattr(host, "cfg", None)
    auto = getattr(host, "auto", None)
    loop = asyncio.get_running_loop()
    entries = models.entries() if models is not None else []
    costs: dict[str, Any] = {}
    for e in entries:
        key = (e.model_id, e.weights_sha256)
        if key not in cache:
            cache[key] = await loop.run_in_executor(None, _entry_sizes, e)
        costs[e.model_id] = predict.layer_costs(cache[key], "native")
    fresh = cfg.di.advertisement_expiry_s if cfg is not None else 3600.0
    caps: dict[str, dict[str, tuple[float, int]]] = {}
    for mid in costs:
        for h, c in (view.capacities(mid, fresh) if view is not None else {}).items():
            caps.setdefault(h, {})[mid] = (c.speed, c.max_layers)
    samples = [(s.name, s.labels, s.value)
               for m in host.metrics.hop_overhead_ms.collect() for s in m.samples]
    hop = predict.hop_from_histogram(samples) or predict.Sourced(
        predict.DEFAULT_HOP_MS, predict.DEFAULT_HOP_SOURCE)
    shapes = {mid: (c.params_per_layer, c.mean_held) for mid, c in costs.items()}
    budget = auto.budget_mb * 2**20 if auto is not None else None
    nodes = predict.mesh_facts(status, caps, shapes, hop, own_budget_bytes=budget)
    body: dict[str, Any] = {"node_id": host.node_id, "nodes": nodes,
                            "hop": {"ms": round(hop.value, 3), "source": hop.source}}
    if name is None:
        return body
    if models is None:
        raise ModelNotFound(f"unknown model {name[:200]!r}: this node has no model store")
    entry = models.get(name)
    c = costs[entry.model_id]
    probe = await loop.run_in_executor(None, _probe_speed, c, cache[
        (entry.model_id, entry.weights_sha256)].hidden_size)
    fallback = predict.Sourced(probe * c.params_per_layer, "measured by this node now: "
                               "matrix-vector probe of a layer (no speed published)")
    facts = predict.node_facts(nodes, c, entry.model_id, fallback)
    plan = predict.plan(c, facts, hop)
    body["plan"] = plan.to_dict()
    body["plan_text"] = predict.describe(plan)
    return body


def _entry_sizes(entry: Any) -> Any:
    from hearthnet.models.sizes import safetensors_sizes

    return safetensors_sizes(entry.path, source=entry.alias)


def _probe_speed(costs: Any, hidden: int) -> float:
    from hearthnet.distributed_inference.engine.quant import compute_dtype_of
    from hearthnet.distributed_inference.placement.planner import measure_speed

    return measure_speed(costs.params_per_layer, hidden, dtype=compute_dtype_of(costs.fmt),
                         repeats=5)


async def _sse(resp: web.StreamResponse, obj: Json) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _route_name(request: web.Request) -> str:
    """A bounded label for the request metric (the matched route, not the raw path)."""
    info = request.match_info.route.resource
    return info.canonical if info is not None else "other"
