"""`ShardServer`: hosts one contiguous layer range and serves sessions on it (M26 §4.2).

A session is one WebSocket stream (transport `ServerStream`): the caller OPENs it with the
model, `weights_sha256`, a sub-range `[start, end]` inside the hosted range, a max length and
a wire dtype; every STEP carries the new positions' hidden state and gets the sub-range's
output back. Each session has its own KV cache (DESIGN.md decision 2); an OPEN may name
another open session of the same caller (`fork`) whose first positions the new one copies
instead of being sent them (a shared prompt prefix, DESIGN.md decision 12).

Limits are checked before any work (DESIGN.md decision 5): a wrong hash is
`weights_mismatch`, a range outside is `bad_request`, one open over
`max_concurrent_streams` is `shard_unavailable` at once — never queued (M26 §5.6), with
``busy: true`` in its details (the orchestrator may wait for a slot). Forwards
run on the node's compute executor so the event loop keeps serving heartbeats and other
sessions (DESIGN.md decision 6). Weights unused for `shard_eviction_idle_seconds` are evicted
and reloaded on the next open.

Devices (DESIGN.md decision 11): the layers run on `ShardSettings.device`; the weights and the
sessions' preallocated KV caches are counted against `max_vram_mb` (`shard_max_vram_mb`, M26
§5.6): an open whose cache would not fit is refused `shard_unavailable`, and a device
out-of-memory in a step ends that session alone with `shard_unavailable` (the orchestrator fails
over) while the shard serves the others. Hidden states cross device ↔ host through each
session's reused pinned buffers (`device.Staging`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearthnet.background import detach
from hearthnet.constants import WIRE_DTYPES
from hearthnet.distributed_inference.directory.descriptors import (
    ShardDescriptor,
    ShardHealth,
    make_shard_id,
    to_datetime,
)
from hearthnet.distributed_inference.directory.formats import resolve_format
from hearthnet.distributed_inference.engine.base import LayerSession, LayerStack
from hearthnet.distributed_inference.engine.batcher import MAX_LANES, RoundBatcher
from hearthnet.distributed_inference.engine.device import (
    Staging,
    device_info,
    is_out_of_memory,
    resolve_device,
    rows_independent,
)
from hearthnet.distributed_inference.engine.layers import LayeredSession, LayeredStack
from hearthnet.distributed_inference.engine.memory import plan_shard, release_free_heap
from hearthnet.distributed_inference.engine.quant import kernel_of
from hearthnet.distributed_inference.seams import ShardStream
from hearthnet.errors import (
    BadRequest,
    ConnectionLost,
    HearthNetError,
    ShardUnavailable,
    StepFailed,
    StreamStalled,
    WeightsMismatch,
    WireOverflow,
)
from hearthnet.models.store import ModelEntry
from hearthnet.observability import Metrics, get_logger
from hearthnet.stats import LatencyWindow
from hearthnet.transport.codec import WireDtype, cast_to_wire
from hearthnet.transport.websocket import PROGRESS_EVERY_S

log = get_logger("shard")
FAIR_SHARE_WINDOW_S = 300.0  # another member's open in this window makes shares fair
MAX_REF_CHARS = 64  # a session's `ref`: the caller's opaque name for it


def _ref(value: Any, what: str, *, required: bool = False) -> str | None:
    """A validated session ref (a short str) or None (absent, unless `required`);
    `BadRequest` otherwise."""
    if value is None and not required:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_REF_CHARS:
        raise BadRequest(f"{what} must be a string of 1..{MAX_REF_CHARS} characters")
    return value


@dataclass(frozen=True)
class ShardSettings:
    """The host-side knobs of one shard (config `[research.distributed_inference.host]`)."""

    max_concurrent_streams: int = 8
    eviction_idle_s: float = 600.0
    session_idle_timeout_s: float = 120.0
    max_session_tokens: int = 8192
    weights: str = "fp32"  # held format (formats.py); `native` = the stored dtype
    # refused at start above this (M26 §5.6), and opens whose cache would not fit the
    # real allocation (weights + admitted sessions' caches); None: no cap
    max_vram_mb: int | None = None
    prefill_chunk_tokens: int = 256  # a long step runs in chunks of this many positions
    device: str = "cpu"  # auto | cpu | cuda | cuda:N | mps (DESIGN.md decision 11)
    cuda_graphs: bool = True
    compile_decode: bool = False  # CPU decode steps compiled (engine/compiled.py)
    compile_dir: Path | None = None  # where compiled steps are saved and loaded from
    incarnation: str = ""  # the host process's boot id (ShardDescriptor.incarnation)
    batch_window_ms: float = 2.0  # DESIGN.md decision 12: wait this long for other sessions' steps
    mixed_prefill_tokens: int = 32  # mixed rounds: prefill positions a round takes


@dataclass(frozen=True)
class StepJob:
    """One session's step (or prefill chunk) queued for the shard's batcher."""

    session: LayerSession
    staging: Staging | None
    x: torch.Tensor
    start_pos: int
    step: int
    wire: torch.dtype


@dataclass(frozen=True)
class OpenRequest:
    """The validated parameters of a session open."""

    shard_id: str
    start: int
    end: int
    max_length: int
    wire_dtype: str
    caller: str
    lane: int = 0  # the caller's micro-batch lane (`ShardServer.lane_batcher`)
    ref: str | None = None  # the caller's name for the session (a later open's `fork`)
    fork: tuple[str, int] | None = None  # (another session's ref, positions to take)

    @property
    def wire(self) -> torch.dtype:
        """The torch dtype of `wire_dtype` (validated by `validate_open`)."""
        return WireDtype.from_name(self.wire_dtype).torch_dtype


def _fork_of(value: Any, max_len: int) -> tuple[str, int] | None:
    """An open's validated ``fork`` — {ref: another session's ref, positions: how many of
    its first positions to take} — as (ref, positions), or None; `BadRequest` otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"ref", "positions"}:
        raise BadRequest("fork must be a map of ref and positions")
    ref, at = _ref(value["ref"], "fork.ref", required=True), value["positions"]
    assert ref is not None  # required
    if not isinstance(at, int) or isinstance(at, bool) or not 1 <= at < max_len:
        raise BadRequest(f"fork.positions must be an integer in 1..{max_len - 1} (below "
                         f"max_length)")
    return ref, at


class ShardServer:
    """Hosts layers `[lo, hi]` of one stored model; see the module docstring."""

    def __init__(self, entry: ModelEntry, lo: int, hi: int, *, node_id: str, endpoint: str,
                 settings: ShardSettings, executor: Executor, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not (0 <= lo <= hi < entry.num_layers):
            raise BadRequest(f"shard layers [{lo}, {hi}] are outside {entry.alias}'s layers; "
                             f"valid range is [0, {entry.num_layers - 1}]")
        self.entry, self.lo, self.hi = entry, lo, hi
        self.settings, self.executor, self.clock = settings, executor, clock
        self.metrics = metrics or Metrics()
        self.weights_format = resolve_format(settings.weights, entry.dtype)
        self.device = resolve_device(settings.device)  # absent: ConfigError at start-up
        self.device_info = device_info(self.device)
        # a prompt is cut into pieces by the load (`_piece`) only where that changes no
        # answer; elsewhere (a GPU) by its length alone, as when it runs alone
        self.cuts_by_load = rows_independent(self.device.type)
        self.memory = plan_shard(entry, lo, hi, self.weights_format,
                                 settings.max_concurrent_streams, settings.max_session_tokens)
        self._refuse_over_budget(make_shard_id(entry.model_id, lo, hi, node_id))
        self.descriptor = self._describe(node_id, endpoint)
        self.shard_id = self.descriptor.shard_id
        # the per-step metrics, bound to this shard's label once (DESIGN.md hot path rules)
        self._m_queue = self.metrics.shard_queue_depth.labels(self.shard_id)
        self._m_forward = self.metrics.shard_forward_ms.labels(self.shard_id)
        self._m_active = self.metrics.shard_active_sessions.labels(self.shard_id)
        self._m_batch_size = self.metrics.shard_batch_size.labels(self.shard_id)
        self._m_batch_wait = self.metrics.shard_batch_wait_ms.labels(self.shard_id)
        self.stack: LayerStack | None = None
        self._load_lock = asyncio.Lock()
        self.active = 0
        self.last_used = clock()
        self._latencies = LatencyWindow(256)
        self._streams: dict[ShardStream, str] = {}  # open session streams -> their caller
        # open sessions by (caller, ref): what a later open of the same caller may fork
        self._by_ref: dict[tuple[str, str], LayerSession] = {}
        self._callers_seen: dict[str, float] = {}  # member -> its last open (fair shares)
        self._good_stats = entry.manifest_stats()  # weights files as last verified
        self._lane_active: Counter[int] = Counter()  # open sessions per lane
        self._lanes: dict[int, RoundBatcher[StepJob, torch.Tensor]] = {}
        self.batcher = self.lane_batcher(0)  # the lane of callers that name none
        self._waiting: dict[ShardStream, float] = {}  # streams whose step is queued -> since
        self._loop: asyncio.AbstractEventLoop | None = None  # for the compute thread's beats
        self._beat_at = 0.0
        self._untrimmed = 0  # prefill positions computed since the last heap trim

    def lane_batcher(self, lane: int) -> RoundBatcher[StepJob, torch.Tensor]:
        """The batcher of one micro-batch lane (M26 §5.3, DESIGN.md decision 12): an
        orchestrator puts its concurrent chats in as many lanes as its pipeline has stages,
        and each lane's rows run as their own rounds, so while this shard computes one lane
        the next stage computes another instead of waiting for one batch of every chat.
        Rounds of all lanes share the compute executor, one at a time."""
        batcher = self._lanes.get(lane)
        if batcher is None:
            s = self.settings
            batcher = RoundBatcher(
                self._run_steps, self.executor, window_s=self._batch_window_s(),
                expected=lambda: self._lane_active[lane],
                prefill_budget=s.mixed_prefill_tokens,  # beside decode rows too
                on_batch=self._observe_batch,
                on_progress=self._progressed)
            self._lanes[lane] = batcher
        return batcher

    def _batch_window_s(self) -> float:
        """How long a round waits for other sessions' rows: none where each row replays its
        own session's graph (`LayeredStack.forward_packed`): rows share no forward there,
        so a round waiting for another's row only delays."""
        if isinstance(self.stack, LayeredStack) and self.stack.graphs:
            return 0.0
        return self.settings.batch_window_ms / 1000

    def _refuse_over_budget(self, shard_id: str) -> None:
        """A shard over `shard_max_vram_mb` is refused before loading (M26 §5.6)."""
        cap = self.settings.max_vram_mb
        if cap is None or self.memory.total_mb <= cap:
            return
        s = self.settings
        need = self.memory.describe(self.weights_format, s.max_concurrent_streams,
                                    s.max_session_tokens)
        raise ShardUnavailable(
            f"shard {shard_id} needs {need} but shard_max_vram_mb is {cap}: choose "
            f"weights = \"int8\", lower max_session_tokens or max_concurrent_streams, "
            f"host fewer layers, or raise shard_max_vram_mb", shard_id=shard_id,
            required_mb=self.memory.total_mb, budget_mb=cap)

    # ---- lifecycle ----

    async def start(self) -> None:
        """Load the weights of the hosted range (in the executor)."""
        await self._ensure_loaded()

    async def _ensure_loaded(self) -> LayerStack:
        async with self._load_lock:
            if self.stack is None:
                t0 = time.perf_counter()
                loop = asyncio.get_running_loop()
                stack = await loop.run_in_executor(self.executor, self._load)
                if isinstance(stack, LayeredStack):  # its layers beat while a forward runs
                    self._loop = loop
                    stack.on_layer = self._beat
                if stack.compiled is not None:  # ready before the first chat, if it can be
                    # its chats batch, and passes speculate by default
                    stack.compiled.after_decode = ("round", "verify")
                    stack.compiled.start(self.lo, self.hi)
                self.stack = stack
                for batcher in self._lanes.values():  # made before the stack was known
                    batcher.window_s = self._batch_window_s()
                mb = self.stack.param_bytes() / 2**20
                log.info("shard_loaded", shard_id=self.shard_id, weights=self.weights_format,
                         weights_mb=round(mb, 1), required_mb=self.memory.total_mb,
                         device=str(self.device), ms=round((time.perf_counter() - t0) * 1000))
            return self.stack

    def _load(self) -> LayeredStack:
        s = self.settings
        return LayeredStack(self.entry, self.lo, self.hi, self.weights_format,
                            device=self.device, budget_mb=s.max_vram_mb,
                            cuda_graphs=s.cuda_graphs, compile_decode=s.compile_decode,
                            compile_dir=s.compile_dir)

    def _describe(self, node_id: str, endpoint: str) -> ShardDescriptor:
        """The advertised descriptor, with the device kind and memory (DESIGN.md decision 11)."""
        info = self.device_info
        return ShardDescriptor.create(
            model_id=self.entry.model_id, weights_sha256=self.entry.weights_sha256,
            layer_range=(self.lo, self.hi), host=node_id, endpoint=endpoint,
            max_concurrent_streams=self.settings.max_concurrent_streams,
            vram_required_mb=self.memory.total_mb, weights_format=self.weights_format,
            device=self.device.type,
            device_name=str(info.get("name", ""))[:128],
            device_memory_mb=int(info.get("total_mb", 0)),
            kernel=kernel_of(self.weights_format, bool(self.entry.ggml_types)),
            incarnation=self.settings.incarnation)

    def decode_state(self) -> str | None:
        """What this shard's decode steps run as (compiled, compiling, eager and why);
        None while its layers are not loaded."""
        if self.stack is None or not isinstance(self.stack, LayeredStack):
            return None
        whole = f"{self.lo}-{self.hi}"
        parts = [f"{k}: {v}" if k != whole else v
                 for k, v in self.stack.compile_state().items()]
        if self.stack.compiled is not None:  # decode rounds' and passes' steps, once built
            parts += [f"{what}{'' if k == whole else ' ' + k}: {v}"
                      for kind, what in (("round", "rounds"), ("verify", "passes"))
                      for k, v in self.stack.compiled.extra_state(kind).items()]
        return "; ".join(parts) or "eager"

    async def evict(self) -> None:
        """Free the weights (M26 §4.2); the next open reloads them."""
        async with self._load_lock:
            if self.stack is not None and self.active == 0:
                self.stack = None
                log.info("shard_evicted", shard_id=self.shard_id)

    def maybe_evict_idle(self) -> bool:
        """True when the shard has been idle long enough to evict (the node calls evict)."""
        return (self.stack is not None and self.active == 0
                and self.clock() - self.last_used > self.settings.eviction_idle_s)

    def close_callers(self, drop: Callable[[str], bool]) -> None:
        """Close the sessions of callers for which `drop(caller)` is true (a member removed
        by a reload); their step loops end at once."""
        for stream, caller in list(self._streams.items()):
            if drop(caller):
                log.info("session_closed_member_removed", shard_id=self.shard_id,
                         caller=caller)
                detach(stream.close("member removed"))

    async def check_weights(self) -> None:
        """Raise `WeightsMismatch` when a hosted weights file was truncated, replaced or removed
        since the import (a truncated mmap would SIGBUS): a `stat` per file, re-hashed in the
        executor only when size or mtime moved. The loaded weights are the shard's own memory,
        so open sessions are unharmed; the node withdraws the shard."""
        now = self.entry.file_stats()
        if now is not None and now == self._good_stats:
            return
        await asyncio.get_running_loop().run_in_executor(self.executor,
                                                         self.entry.check_files)
        if now is not None:
            self._good_stats = now  # touched, same bytes: hash once, not every open

    async def close_all(self) -> None:
        """Close every open session (node shutdown)."""
        for s in list(self._streams):
            await s.close("shard shutting down")

    async def health(self) -> ShardHealth:
        return ShardHealth(shard_id=self.shard_id, online=True,
                           last_seen=to_datetime(self.clock()),
                           p95_latency_ms=self.p95_ms(), queue_depth=self.queue_depth,
                           active_sessions=self.active)

    def caller_share(self, caller: str) -> int:
        """How many of this shard's streams `caller` may hold (M26 §5.6, §5.9): all of them
        while no other member asked for one lately, else all but a quarter (at least one),
        so one member's burst of chats cannot starve the others — a member refused busy
        counts as asking, and gets a slot as soon as one of the burst's sessions ends."""
        total = self.settings.max_concurrent_streams
        since = self.clock() - FAIR_SHARE_WINDOW_S
        for c, t in list(self._callers_seen.items()):
            if t < since:
                del self._callers_seen[c]
        if total < 2 or not any(c != caller for c in self._callers_seen):
            return total
        return total - max(1, total // 4)

    def p95_ms(self) -> float:
        """The p95 of this shard's last 256 forward times (0.0 before any)."""
        return self._latencies.percentile(95)

    # ---- sessions ----

    def validate_open(self, params: dict[str, Any], caller: str = "anonymous") -> OpenRequest:
        """Check an OPEN's parameters before any work; raises the typed refusal."""
        if not isinstance(params, dict):
            raise BadRequest("open parameters must be a map")
        if params.get("model_id") not in (self.entry.model_id, self.entry.alias):
            raise BadRequest(f"this shard serves {self.entry.model_id}, not "
                             f"{params.get('model_id')!r}")
        if params.get("weights_sha256") != self.entry.weights_sha256:
            raise WeightsMismatch(
                f"shard {self.shard_id} has weights {self.entry.weights_sha256[:16]}…, the "
                f"caller asked for {str(params.get('weights_sha256'))[:16]}…")
        start, end, max_len = params.get("start"), params.get("end"), params.get("max_length")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, max_len)):
            raise BadRequest("start, end and max_length must be integers")
        assert isinstance(start, int) and isinstance(end, int) and isinstance(max_len, int)
        if not (self.lo <= start <= end <= self.hi):
            raise BadRequest(f"sub-range [{start}, {end}] is outside the hosted layers "
                             f"[{self.lo}, {self.hi}]")
        if not 1 <= max_len <= self.settings.max_session_tokens:
            raise BadRequest(f"max_length must be in 1..{self.settings.max_session_tokens}")
        wire = params.get("wire_dtype", "fp16")
        if wire not in WIRE_DTYPES:
            raise BadRequest(f"wire_dtype must be one of {list(WIRE_DTYPES)}")
        lane = params.get("lane", 0)
        if not isinstance(lane, int) or isinstance(lane, bool) or not 0 <= lane < MAX_LANES:
            raise BadRequest(f"lane must be an integer in 0..{MAX_LANES - 1}")
        ref = _ref(params.get("ref"), "ref")
        fork = _fork_of(params.get("fork"), max_len)
        self._callers_seen[caller] = self.clock()
        if self.active >= self.settings.max_concurrent_streams:
            raise ShardUnavailable(f"shard {self.shard_id} is at max_concurrent_streams "
                                   f"({self.settings.max_concurrent_streams}); pick another "
                                   f"or wait", busy=True)  # busy, not gone
        share = self.caller_share(caller)
        if sum(c == caller for c in self._streams.values()) >= share:
            raise ShardUnavailable(f"shard {self.shard_id}: {caller} holds its fair share "
                                   f"({share} of {self.settings.max_concurrent_streams} "
                                   f"streams) while other members use it; pick another or "
                                   f"wait", busy=True)
        return OpenRequest(self.shard_id, start, end, max_len, str(wire), caller, lane, ref,
                           fork)

    async def serve_session(self, stream: ShardStream, req: OpenRequest) -> None:
        """Run one accepted-to-be session on `stream` until the caller closes it."""
        self.active += 1  # counted before any await: a concurrent open sees it (M26 §5.6)
        self._lane_active[req.lane] += 1
        batcher = self.lane_batcher(req.lane)
        self._streams[stream] = req.caller
        self._gauge()
        session = None
        try:
            stack = await self._ensure_loaded()
            session = stack.open_session(req.start, req.end, req.max_length)  # budget: M26 §5.6
            stream.limit_tensor_bytes(self.session_tensor_bytes(req))
            forked = self._fork(session, req)
            if req.ref is not None:
                self._by_ref.setdefault((req.caller, req.ref), session)
            # what this session really runs on (M26 §5.9): the orchestrator checks it
            # against the call, not the advertisement it picked us by
            await stream.accept({"shard_id": self.shard_id, "hidden_size": stack.hidden_size,
                                 "weights_sha256": self.entry.weights_sha256,
                                 "layers": [req.start, req.end],
                                 "weights_format": self.weights_format,
                                 "kernel": self.descriptor.kernel,
                                 "compute_dtype": str(stack.dtype).removeprefix("torch."),
                                 "device": self.device.type, "forked": forked})
            self.metrics.shard_sessions_total.labels(self.shard_id, "accepted", req.caller).inc()
            await self._step_loop(stream, session, req.wire, batcher)
        except (ConnectionLost, StreamStalled) as e:
            log.info("session_ended", shard_id=self.shard_id, caller=req.caller,
                     reason=e.code)
        except StepFailed as e:  # the caller gets the typed step error; the session ends
            await stream.refuse(e, step=e.details.get("step"))
        finally:
            if req.ref is not None and self._by_ref.get((req.caller, req.ref)) is session:
                del self._by_ref[(req.caller, req.ref)]
            if session is not None:
                session.close()  # frees the KV cache also when the caller vanished
            self._streams.pop(stream, None)
            self.active -= 1
            self._lane_active[req.lane] -= 1
            # a round waiting for this session goes on, and it no longer counts as decoding
            batcher.expected_changed(None if session is None else id(session))
            self.last_used = self.clock()
            self._gauge()

    def _fork(self, session: LayerSession, req: OpenRequest) -> int:
        """A new session's first positions taken from another open session of the same
        caller (`fork`: its ref and how many positions), where that one is here, on the
        same sub-range, and holds them; how many were taken (0: the caller sends them all).
        Only the caller's own sessions: another member's cached prompt is never reachable
        (its timing would tell what that prompt began with). The copy runs here, on the
        loop, while no step of the source can be rewriting those positions: a source only
        rewrites positions it is sent again, and its caller sends the prefix once."""
        if req.fork is None:
            return 0
        ref, positions = req.fork
        source = self._by_ref.get((req.caller, ref))
        if source is None:
            return 0
        return session.copy_prefix(source, positions)

    async def _step_loop(self, stream: ShardStream, session: LayerSession,
                         wire: torch.dtype,
                         batcher: RoundBatcher[StepJob, torch.Tensor]) -> None:
        staging = Staging(self.device)  # this session's reused pinned buffers
        while True:
            inp = await stream.recv_step(deadline_s=self.settings.session_idle_timeout_s)
            if inp is None:
                return
            self._waiting[stream] = asyncio.get_running_loop().time()
            self._m_queue.set(self.queue_depth)
            try:
                t0 = time.perf_counter()
                out = await self._forward_chunked(session, staging, inp.tensor,
                                                  inp.start_pos, inp.step, wire, batcher)
                dt = time.perf_counter() - t0
            except BadRequest as e:  # a refused step leaves the session usable
                await stream.send_error(e)
                continue
            except WireOverflow as e:  # a transport limit, reported as such
                log.info("wire_overflow", shard_id=self.shard_id, step=inp.step,
                         wire_dtype=str(wire))
                await stream.send_error(e)
                continue
            except ShardUnavailable as e:  # device out of memory: this session alone ends
                await stream.send_error(e, step=inp.step)
                return
            except HearthNetError:
                raise
            except Exception as e:  # torch failed: a typed step error, the session ends
                raise self._forward_failed(inp.step, e) from e
            finally:
                self._waiting.pop(stream, None)
                self._m_queue.set(self.queue_depth)
            self._latencies.add(dt * 1000)
            self._m_forward.observe(dt * 1000)
            self.last_used = self.clock()
            await stream.send_step(inp.step, inp.start_pos, out, compute_us=int(dt * 1e6))

    @property
    def queue_depth(self) -> int:
        """Steps received and not yet answered: one per session at most."""
        return len(self._waiting)

    def _beat(self) -> None:
        """In the compute thread, after each layer of an eager forward: the work goes on, so
        the sessions waiting for it are told (`_progressed`, at most twice a second from
        here). A forward stuck inside a layer beats no more and misses the deadline."""
        now = time.monotonic()
        if now - self._beat_at < PROGRESS_EVERY_S / 2 or self._loop is None:
            return
        self._beat_at = now
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._progressed)

    def _progressed(self) -> None:
        """The work progressed: every session whose step still waits behind work is told it is
        busy, not stalled (docs/protocol.md §3.6a) — a deadline of one step must not fail a
        shard that is working through a queue of long prefills (called after each round,
        and from `_beat` while a forward runs). A forward stuck inside a layer runs no more
        rounds and beats no more, so a hung shard still misses the deadline."""
        for stream, since in list(self._waiting.items()):
            stream.progress(since)

    async def _forward_chunked(self, session: LayerSession, staging: Staging, x: torch.Tensor,
                               start_pos: int, step: int, wire: torch.dtype,
                               batcher: RoundBatcher[StepJob, torch.Tensor]) -> torch.Tensor:
        """Run a step through the shard's batcher (DESIGN.md decision 12): a decode step joins the
        next round's batch; a longer step runs in pieces (`_piece`) that join the rounds'
        forwards (mixed rounds), a round taking pieces of `mixed_prefill_tokens`
        positions in all (at least one piece), so a prefill never holds the other
        sessions' decode rows for more than one piece, and a round of several prompts'
        chunks passes each on to the next stage without waiting for the others (M26
        §5.3). One piece (every decode step) comes back through the session's pinned
        buffer."""
        t = int(x.shape[1]) if x.dim() == 3 else 1
        # a decode step (one position) is one job as it is: no piece to size on its path
        piece = self._piece(session, batcher) if t > 1 else t
        if x.dim() != 3 or t <= piece:
            return await batcher.submit(StepJob(session, staging, x, start_pos, step, wire),
                                        batchable=x.dim() == 3 and t == 1,
                                        key=id(session), tokens=t)
        outs = []
        at = 0
        while at < t:
            job = StepJob(session, None, x[:, at:at + piece], start_pos + at, step, wire)
            outs.append(await batcher.submit(job, batchable=False, key=id(session),
                                             tokens=int(job.x.shape[1])))
            at += int(job.x.shape[1])
            piece = self._piece(session, batcher)  # others may have begun or stopped decoding
        return torch.cat(outs, dim=1)

    def _piece(self, session: LayerSession,
               batcher: RoundBatcher[StepJob, torch.Tensor]) -> int:
        """Positions of the next piece of a prefill: `prefill_chunk_tokens` while no other
        session decodes here (in any lane), `mixed_prefill_tokens` beside other sessions'
        decode rows — their gaps grow by one such piece a round, not by a whole chunk
        (M26 §5.3, the chunked prefill of Sarathi-Serve: 256 positions of the 1.5B shape
        are ~2 s of one core); always `prefill_chunk_tokens` where the pieces would change
        the answer (`cuts_by_load` false: a GPU)."""
        s = self.settings
        # every lane's rounds share the compute executor: decode rows of any lane count
        if self.cuts_by_load and any(b.decoding_besides(id(session), counted=b is batcher)
                                     for b in list(self._lanes.values())):
            return min(s.prefill_chunk_tokens, s.mixed_prefill_tokens)
        return s.prefill_chunk_tokens

    # ---- batched steps (DESIGN.md decision 12); these run on the compute executor ----

    def _run_steps(self, jobs: Sequence[StepJob]) -> list[Any]:
        """One round: the decode rows and prefill chunks of sessions over the same
        sub-range run as one forward; every other job alone. One output or exception per
        job, in order."""
        results: list[Any] = [None] * len(jobs)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, job in enumerate(jobs):
            key = self._batch_key(job)
            if key is None:
                results[i] = self._solo(job)
            else:
                groups.setdefault(key, []).append(i)
        for rows in groups.values():
            for i, out in zip(rows, self._batched([jobs[i] for i in rows]), strict=True):
                results[i] = out
        self._untrimmed += sum(int(job.x.shape[1]) for job in jobs
                               if job.x.dim() == 3 and job.x.shape[1] > 1)
        if self._untrimmed >= self.settings.prefill_chunk_tokens:
            # prefill activations (tens of MiB a chunk) leave the RSS instead of staying in
            # glibc's arenas (M26 §5.6; 8 × 2,000-token prefills kept +394 MiB): 7-14 ms a
            # trim, once a chunk's worth of positions — not after every small piece
            self._untrimmed = 0
            release_free_heap()
        return results

    @staticmethod
    def _batch_key(job: StepJob) -> tuple[int, int, int] | None:
        """Sessions that can share a forward: real layered sessions (a wrapped one runs
        alone) over the same stack and sub-range. Different sub-ranges of one shard are
        kept apart: their rows would enter and leave the layers at different points, and
        an orchestrator's chats use the same stages anyway (DESIGN.md decision 12)."""
        s = job.session
        if not isinstance(s, LayeredSession) or job.x.dim() != 3:
            return None
        return (id(s.stack), s.start, s.end)

    def _solo(self, job: StepJob) -> Any:
        try:
            return self._forward(job.session, job.staging, job.x, job.start_pos, job.step,
                                 job.wire)
        except Exception as e:  # the row's own error, raised in its session's step loop
            return e

    def _batched(self, jobs: list[StepJob]) -> list[Any]:
        """Rows that pass their session's checks run as one forward (decode rows and
        prefill chunks alike, `forward_packed`); a refused row gets its `BadRequest` alone.
        A lone row takes its session's own forward (compiled on a CPU, a CUDA graph on a
        GPU)."""
        out: list[Any] = [None] * len(jobs)
        ok: list[int] = []
        for i, job in enumerate(jobs):
            try:
                assert isinstance(job.session, LayeredSession)  # `_batch_key` grouped it
                job.session.check(job.x, job.start_pos)
                ok.append(i)
            except BadRequest as e:
                out[i] = e
        for i, res in zip(ok, self._forward_rows([jobs[i] for i in ok]), strict=True):
            out[i] = res
        return out

    def _forward_rows(self, jobs: list[StepJob]) -> list[Any]:
        """`jobs` (distinct sessions, checked) as one forward; when it fails (out of
        memory, a torch error) each row runs alone, so only the sessions whose rows fail
        get an error. Rows share no attention (each reads its own cache), so a non-finite
        row is its own session's failure (`_row_out`)."""
        if len(jobs) <= 1:
            return [self._solo(j) for j in jobs]
        sessions = [s for j in jobs if isinstance(s := j.session, LayeredSession)]
        stack = sessions[0].stack
        try:
            rows = stack.forward_packed(sessions, [j.x for j in jobs],
                                        [j.start_pos for j in jobs])
        except Exception as e:
            log.warning("batch_failed_rows_run_alone", shard_id=self.shard_id, rows=len(jobs),
                        error=type(e).__name__)
            return [self._solo(j) for j in jobs]
        return [self._row_out(j, row) for j, row in zip(jobs, rows, strict=True)]

    def _row_out(self, job: StepJob, row: torch.Tensor) -> Any:
        """One row of a batch in its session's wire dtype on the host; a non-finite row
        fails its own session only (a typed step error; the orchestrator replays it)."""
        if not bool(torch.isfinite(row).all()):
            log.warning("batch_row_not_finite", shard_id=self.shard_id, step=job.step)
            return StepFailed(f"shard {self.shard_id} computed non-finite values for step "
                              f"{job.step}; retry elsewhere", step=job.step)
        try:
            wired = cast_to_wire(row, job.wire)
        except WireOverflow as e:
            return e
        return job.staging.to_host(wired, job.wire) if job.staging else wired.cpu()

    def _observe_batch(self, size: int, waits_ms: list[float]) -> None:
        self._m_batch_size.observe(size)
        for w in waits_ms:
            self._m_batch_wait.observe(w)

    def session_tensor_bytes(self, req: OpenRequest) -> int:
        """The largest tensor a session can legitimately send: all of its positions at
        the hidden width in its wire dtype: no more is allocated."""
        return req.max_length * self.entry.hidden_size * req.wire.itemsize

    def _forward(self, session: LayerSession, staging: Staging | None, x: torch.Tensor,
                 start_pos: int, step: int, wire: torch.dtype) -> torch.Tensor:
        """One step on the device; the output comes back in the wire dtype on the host,
        cast on the device first (`WireOverflow` if it does not fit), through
        `staging`'s reused pinned buffer (or a fresh host tensor without one)."""
        stack = session.stack
        try:
            x = staging.to_device(x, stack.dtype) if staging else x.to(stack.device, stack.dtype)
            out = session.forward(x, start_pos)
            out = cast_to_wire(out, wire)
            return staging.to_host(out, wire) if staging else out.cpu()
        except (RuntimeError, torch.OutOfMemoryError) as e:
            if not is_out_of_memory(e):
                raise
            log.warning("session_out_of_memory", shard_id=self.shard_id, device=str(self.device))
            raise ShardUnavailable(f"shard {self.shard_id} ran out of memory on {self.device} "
                                   f"in this session's step; retry elsewhere",
                                   reason="device_out_of_memory") from None

    def _forward_failed(self, step: int, exc: Exception) -> StepFailed:
        # the traceback names the failing op and shapes, never tensor values (M26 §5.8)
        log.error("shard_forward_failed", shard_id=self.shard_id, step=step,
                  exc_info=exc)
        return StepFailed(f"shard {self.shard_id} failed to compute step {step} "
                          f"({type(exc).__name__}); see its log", step=step)

    def _gauge(self) -> None:
        self._m_active.set(self.active)


async def refuse(stream: ShardStream, err: HearthNetError) -> None:
    """Send a typed refusal on an unaccepted stream and close it."""
    await stream.refuse(err)
