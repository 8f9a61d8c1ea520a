"""Automatic hosting: the daemon side of ``shards = "auto"`` (DESIGN.md decision 14; M26 §1, §10).

`AutoHost` runs inside a node whose config says ``shards = "auto"``. For every model on the
community's served-model list (`community.PlacementView.served`) that this node holds in
its model store, it:

1. **places** (when it hosts nothing of the model): announces its capacity, waits a jittered
   moment to hear the other hosts starting with it, sizes its window by
   `placement.split_lengths` and puts it where coverage is weakest (`placement.best_start`);
2. **re-hosts** (when some layers have no live host and its budget has room): loads a window
   over the largest gap; without room it may *move* there if its old range stays covered;
3. **rebalances** (every ``rebalance_interval_s`` ±50 %): moves when `placement.plan_move`
   says the weakest coverage rises past ``balance_quality``; the new range is loaded and
   advertised before the old one is withdrawn, and the old one is freed only when its open
   sessions have ended (no gap, no failed chat).

Every placement is a **claim** event first (`community.CLAIM`); after ``settle_s`` the node
re-checks: if an earlier overlapping claim of another host makes its window pointless, it
cancels and chooses again. Jitter plus this re-check keeps hosts that start together off the
same range.

A host is **down** for placement when the node's `HostLiveness` says so (its listener
refused ``host_probe_failures`` TCP probes in a row): a ``kill -9``ed host is noticed in
seconds, long before its advertisements expire (4 × the health timeout). The same probe
makes the router skip its shards and the status show them offline, on every node.

**A member has it like I have it** (DESIGN.md decision 17): a served model this node's store
lacks but a member holds is placed all the same — the node's `remote` callback brings its
manifest and config (a partial model holding no layer yet), costs come from the manifest's
`tensors` table, and loading a range first fetches its layers (`ShardHost.load_shard`);
each such decision records the estimated fetch time (`planner.fetch_seconds`).

Stopping (`stop`, the node's SIGTERM): from that moment no claim or load begins — checked
before every claim and load, also in a step whose cancellation an inner await swallowed —
and the loop ends within `STOP_GRACE_S`; a stopping node hosts nothing new.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from hearthnet.background import cancel_and_wait
from hearthnet.config import NodeConfig
from hearthnet.distributed_inference.directory.formats import default_held, resolve_format
from hearthnet.distributed_inference.directory.liveness import HostLiveness
from hearthnet.distributed_inference.directory.store import Advertisement, ShardStore
from hearthnet.distributed_inference.engine.memory import (
    _layer_tensor_shapes,
    layer_weight_bytes,
)
from hearthnet.distributed_inference.engine.quant import compute_dtype_of, held_nbytes
from hearthnet.distributed_inference.placement.community import (
    CAPACITY,
    CLAIM,
    Claim,
    PlacementView,
    ServedModel,
    capacity_payload,
    claim_payload,
    placement_info,
)
from hearthnet.distributed_inference.placement.planner import (
    HostCapacity,
    Span,
    best_start,
    budget_layers,
    coverage,
    fetch_seconds,
    gap_lengths,
    measure_speed,
    plan_move,
    split_lengths,
)
from hearthnet.errors import HearthNetError
from hearthnet.mesh.eventlog import EventLog
from hearthnet.models.store import ModelEntry, ModelStore, decoder_prefix, layer_of
from hearthnet.observability import get_logger

log = get_logger("distributed_inference.autohost")
STOP_GRACE_S = 2.0  # how long `AutoHost.stop` waits for its tasks to end


class HostedShard(Protocol):
    """What `AutoHost` needs of a hosted shard (`ShardServer`)."""

    shard_id: str
    lo: int
    hi: int
    entry: ModelEntry


class ShardHost(Protocol):
    """The node's side: load and drop shards, list what it hosts."""

    def hosted(self) -> Sequence[HostedShard]: ...

    async def load_shard(self, entry: ModelEntry, lo: int, hi: int,
                         placement: dict[str, Any]) -> HostedShard: ...

    async def drop_shard(self, shard_id: str, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What one layer of a model costs this host: bytes held and measured speed."""

    bytes_per_layer: int
    params_per_layer: int
    speed: float


def layer_params(entry: ModelEntry) -> int:
    """Parameters of one decoder layer (the mean over layers), from the safetensors headers
    (no tensor is read) — of a partial model, from its manifest's `tensors` table."""
    if entry.partial:
        shapes = [s for s, _ in _table_layer_tensors(entry)]
    else:
        shapes = _layer_tensor_shapes(entry, 0, entry.num_layers - 1)
    return sum(math.prod(s) for s in shapes) // max(1, entry.num_layers)


def layer_bytes(entry: ModelEntry, fmt: str) -> int:
    """Held bytes of one decoder layer as `fmt` (as `engine.memory` counts it), rounded up."""
    if entry.partial:
        total = sum(held_nbytes(s, fmt, len(s) == 2, kind)
                    for s, kind in _table_layer_tensors(entry))
    else:
        total = layer_weight_bytes(entry, 0, entry.num_layers - 1, fmt)
    return -(-total // max(1, entry.num_layers))


def _table_layer_tensors(entry: ModelEntry) -> list[tuple[tuple[int, ...], str]]:
    """(logical shape, GGML type or "") of every decoder-layer tensor of the whole model,
    from the manifest's `tensors` table (a partial model's files lack most of them)."""
    prefix = decoder_prefix(entry.tensors)
    return [(tuple(int(d) for d in (rec.get("logical_shape") or rec["shape"])),
             str(rec["dtype"]).partition(":")[2])
            for name, rec in entry.tensors.items() if layer_of(name, prefix) is not None]


def missing_bytes(entry: ModelEntry, lo: int, hi: int) -> int:
    """Stored bytes of the layers of `lo..hi` this node's store lacks (to be fetched)."""
    missing = set(entry.missing_layers(lo, hi))
    if not missing:
        return 0
    prefix = decoder_prefix(entry.tensors)
    return sum(int(rec["bytes"]) for name, rec in entry.tensors.items()
               if layer_of(name, prefix) in missing)


@dataclass
class Decision:
    """One thing this node decided, for `hearthnet status`."""

    kind: str  # initial | rehost | rebalance | cancelled | dropped
    model: str
    layers: list[int]
    detail: str
    at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model, "layers": self.layers,
                "detail": self.detail, "at": self.at}


class AutoHost:
    """Places, re-hosts and rebalances this node's shards; see the module docstring."""

    def __init__(self, cfg: NodeConfig, *, log_: EventLog, store: ShardStore,
                 models: ModelStore, host: ShardHost, view: PlacementView,
                 liveness: HostLiveness, rng: random.Random | None = None,
                 executor: Executor | None = None,
                 usable: Callable[[Advertisement, ModelEntry], bool] | None = None,
                 remote: Callable[[ServedModel], Awaitable[ModelEntry | None]] | None = None,
                 fetch_rate: Callable[[], float | None] | None = None) -> None:
        """`executor`: where the speed probe computes — the node's compute thread, so the
        process keeps one OpenMP team (node/threads.py); None: asyncio's default.
        `usable`: whether a call may use an advertised shard (the node's
        `shard_usable`: trust, liveness, format); a shard no call may use covers nothing.
        None: every advertisement whose host is not probed down.
        `remote(served)`: the entry of a served model a member holds, its manifest and
        config brought into this node's store (None: no member holds it); None: only
        models in the store are placed. `fetch_rate()`: the last measured fetch rate in
        bytes/s (None: `planner.DEFAULT_FETCH_BYTES_PER_S`)."""
        self.remote, self.fetch_rate = remote, fetch_rate
        self.cfg, self.auto = cfg, cfg.di.auto
        self.executor = executor
        self.node_id = cfg.node.id
        self.events, self.store, self.models = log_, store, models
        self.host, self.view = host, view
        self.rng = rng or random.Random()
        self.format = cfg.di.host.weights or cfg.di.host.compute_dtype  # as the shards hold
        self.budget_mb = self.auto.memory_mb or cfg.di.host.shard_max_vram_mb
        self.liveness = liveness
        self.usable = usable or (lambda ad, _e: not liveness.is_down(ad.descriptor.host))
        self.decisions: list[Decision] = []
        self._costs: dict[str, ModelCost] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._next_rebalance = 0.0
        self.clock = time.monotonic  # the rebalance schedule's; tests replace it
        self.started = False
        self.stopping = False  # set by `stop`: no claim or load begins after it

    # ---- lifecycle ----

    def start(self) -> None:
        self.events.subscribe(self._on_event)
        self.liveness.on_change(self._wake.set)  # a host went down or came back
        self._tasks = [asyncio.create_task(self._run(), name="autohost")]

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop placing: once this is called no claim or load begins (a stopping node
        hosts nothing new, DESIGN.md decision 14), even in a step whose cancellation an
        inner await swallowed; cancel the loop and the drops, wait up to `grace_s`."""
        self.stopping = True
        self._wake.set()
        stuck = await cancel_and_wait(self._tasks, grace_s)
        if stuck:
            log.warning("autohost_stop_stuck", tasks=[t.get_name() for t in stuck])

    def _check_running(self) -> None:
        """Raise `CancelledError` once stopping began or this task was asked to cancel.

        Python 3.11's ``asyncio.wait_for`` (here or in a library) returns a result that
        completes as the cancel arrives and drops the cancel; the task's ``cancelling()``
        still counts it. Checked before each round and before every claim and load, so
        such a step cannot go on to host after ``node_stopping``.
        """
        task = asyncio.current_task()
        if self.stopping or (task is not None and task.cancelling()):
            raise asyncio.CancelledError("automatic hosting is stopping")

    def _on_event(self, ev: Any) -> None:
        self._wake.set()

    async def _run(self) -> None:
        await self._announce()
        await asyncio.sleep(self.auto.settle_s + self.rng.uniform(0, self.auto.start_jitter_s))
        self.started = True
        self._schedule_rebalance()
        while True:
            self._check_running()
            self._wake.clear()
            due = self.clock() >= self._next_rebalance
            try:
                await self.step(rebalance=due)
            except HearthNetError as e:
                log.warning("autohost_step_failed", code=e.code, error=e.message)
            except Exception:  # the loop must outlive a bug in one step
                log.exception("autohost_step_crashed")
            self._check_running()  # a cancel the step swallowed or turned into an error
            if due:
                self._schedule_rebalance()
            wait = max(0.05, self._next_rebalance - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    def _schedule_rebalance(self) -> None:
        self._next_rebalance = self.clock() + self.auto.rebalance_interval_s * \
            self.rng.uniform(0.5, 1.5)

    # ---- costs ----

    async def _announce(self) -> None:
        caps = {}
        for e in self.models.entries():  # every local model: the served list may change
            cost = await self.cost(e)
            caps[e.model_id] = (cost.speed, self._max_layers(e, cost))
        self.events.append(CAPACITY, capacity_payload(caps))

    async def cost(self, entry: ModelEntry) -> ModelCost:
        """Bytes per layer in the held format and this host's speed (measured once)."""
        got = self._costs.get(entry.model_id)
        if got is None:
            # as `_host_shard` will hold it (`native`: the stored dtype)
            fmt = resolve_format(self.cfg.di.host.weights or default_held(
                self.cfg.di.host.compute_dtype, entry.q4_blocks), entry.dtype)
            params = layer_params(entry)
            speed = self.auto.speed or await asyncio.get_running_loop().run_in_executor(
                self.executor, lambda: self._measure(entry, fmt, params))
            got = ModelCost(layer_bytes(entry, fmt), params, float(speed))
            self._costs[entry.model_id] = got
            log.info("autohost_cost", model=entry.alias, mb_per_layer=round(
                got.bytes_per_layer / 2**20, 2), speed=round(got.speed, 2))
        return got

    @staticmethod
    def _measure(entry: ModelEntry, fmt: str, params: int) -> float:
        """Layer steps per second here, for the split: the matrix-vector probe on every
        host, so hosts compare like with like. A host that holds the model could time its
        real layers (`measure_layer_speed`, what `hearthnet plan` uses), but a host that
        is to fetch its layers holds none to time: mixing the two gave the fetching hosts
        11 layers each and the holder 8 in `bench household` (the probe overstates a
        SmolLM2 layer's speed 2.4x)."""
        return measure_speed(params, entry.hidden_size, dtype=compute_dtype_of(fmt))

    def _max_layers(self, entry: ModelEntry, cost: ModelCost) -> int:
        return budget_layers(self.budget_mb * 2**20, cost.bytes_per_layer, entry.num_layers)

    def _room(self, entry: ModelEntry, cost: ModelCost) -> int:
        """Layers of `entry` the budget still holds next to everything hosted now."""
        used = 0
        for s in self.host.hosted():
            c = self._costs.get(s.entry.model_id)
            used += (s.hi - s.lo + 1) * (c.bytes_per_layer if c else cost.bytes_per_layer)
        free = max(0, self.budget_mb * 2**20 - used)
        return budget_layers(free, cost.bytes_per_layer, entry.num_layers)

    def _local(self, served: ServedModel) -> ModelEntry | None:
        entry = self.models.find(served.model_id) or self.models.find(served.alias)
        if entry is None or entry.weights_sha256 != served.weights_sha256:
            return None
        return entry

    # ---- the view of one model ----

    def spans(self, entry: ModelEntry, *, claims: bool = True) -> list[Span]:
        """Live hosts of `entry` (down ones left out), plus others' claims still loading
        unless `claims` is false (a claim may justify where to load, never a drop)."""
        cost = self._costs.get(entry.model_id)
        default = cost.speed if cost else 1.0
        caps = self.view.capacities(entry.model_id, self.cfg.di.advertisement_expiry_s)
        out = [Span(h, lo, hi, caps[h].speed if h in caps else default)
               for h, lo, hi in self._hosted_ranges(entry)]
        if claims:
            out += [Span(c.origin, c.lo, c.hi, c.speed) for c in self._loading(entry)]
        return out

    def _hosted_ranges(self, entry: ModelEntry) -> set[tuple[str, int, int]]:
        """(host, lo, hi) of every live host of `entry` a call may use, ours included: a
        host below the routing trust, probed down or holding a format calls refuse covers
        nothing (M26 §5.3)."""
        out = {(ad.descriptor.host, ad.descriptor.lo, ad.descriptor.hi)
               for ad in self.store.candidates(entry.model_id, entry.weights_sha256)
               if self.usable(ad, entry)}
        # ours count at once, before our advertisement comes back
        return out | {(self.node_id, s.lo, s.hi) for s in self._mine(entry)}

    def _loading(self, entry: ModelEntry) -> list[Claim]:
        """Other hosts' pending claims on `entry` they have not advertised yet."""
        hosted = self._hosted_ranges(entry)
        return [c for c in self.view.pending(entry.model_id, self.auto.claim_ttl_s)
                if c.origin != self.node_id and not self.liveness.is_down(c.origin)
                and (c.origin, c.lo, c.hi) not in hosted
                and c.weights_sha256 == entry.weights_sha256]

    def _placing(self, entry: ModelEntry) -> list[str]:
        """Other hosts that announced themselves lately and host nothing of `entry` yet:
        a gap may be theirs to fill (hosts starting together), not a lost range."""
        hosting = {h for h, _, _ in self._hosted_ranges(entry)}
        fresh = self.view.capacities(entry.model_id, self.auto.claim_ttl_s)
        return sorted(h for h in fresh if h != self.node_id and h not in hosting
                      and not self.liveness.is_down(h))

    def _mine(self, entry: ModelEntry) -> list[HostedShard]:
        return [s for s in self.host.hosted() if s.entry.model_id == entry.model_id]

    def _capacities(self, entry: ModelEntry, cost: ModelCost) -> list[HostCapacity]:
        caps = self.view.capacities(entry.model_id, self.auto.claim_ttl_s +
                                    self.cfg.di.advertisement_expiry_s)
        out = [HostCapacity(h, c.speed, c.max_layers) for h, c in caps.items()
               if h != self.node_id and not self.liveness.is_down(h)]
        return [*out, HostCapacity(self.node_id, cost.speed, self._max_layers(entry, cost))]

    # ---- one round ----

    async def step(self, *, rebalance: bool) -> None:
        """Look at every served model once and act on at most what it needs now."""
        for served in self.view.served():
            entry = self._local(served)
            if entry is None and self.remote is not None:
                self._check_running()
                entry = await self.remote(served)  # a member holds it: as if it were here
                if entry is not None:
                    await self._announce()  # the other hosts split with us
            if entry is None:
                continue
            await self._place_model(entry, rebalance)

    async def _place_model(self, entry: ModelEntry, rebalance: bool) -> None:
        cost = await self.cost(entry)
        mine = self._mine(entry)
        cov = coverage(entry.num_layers, self.spans(entry))
        gaps = gap_lengths(cov)
        room = self._room(entry, cost)
        if not mine:
            length = min(room, split_lengths(entry.num_layers,
                                             self._capacities(entry, cost))[self.node_id])
            if length > 0:
                await self._claim_and_load(entry, cost, length, "initial")
        elif gaps and room > 0 and not self._placing(entry):
            longest = max(hi - lo + 1 for lo, hi in gaps)
            await self._claim_and_load(entry, cost, min(room, longest), "rehost")
        elif gaps or rebalance:
            await self._maybe_move(entry, cost, "rehost" if gaps else "rebalance")

    async def _claim_and_load(self, entry: ModelEntry, cost: ModelCost, length: int,
                              reason: str) -> HostedShard | None:
        """Claim the weakest window of `length` layers, re-check, load it (see above)."""
        for attempt in range(3):
            if reason != "initial" or attempt:  # hosts woken by the same news: spread out
                await asyncio.sleep(self.rng.uniform(0, self.auto.start_jitter_s))
            self._check_running()
            cov = coverage(entry.num_layers, self.spans(entry))
            lo = best_start(cov, length)
            hi = lo + length - 1
            if reason == "rehost" and min(cov[lo:hi + 1]) > 0:
                return None  # another host filled the gap meanwhile
            detail = _why(reason, lo, hi, cov)
            if not await self._claim_settles(entry, cost, lo, hi, reason, detail):
                continue
            return await self._load(entry, cost, lo, hi, reason, detail)
        return None

    async def _claim_settles(self, entry: ModelEntry, cost: ModelCost, lo: int, hi: int,
                             reason: str, detail: str) -> bool:
        """Claim ``lo..hi``, wait ``settle_s``, keep it unless an earlier claim wins."""
        max_layers = self._max_layers(entry, cost)
        self._check_running()
        ev = self.events.append(CLAIM, claim_payload(
            model_id=entry.model_id, weights_sha256=entry.weights_sha256, lo=lo, hi=hi,
            speed=cost.speed, max_layers=max_layers, reason=reason, detail=detail))
        await asyncio.sleep(self.auto.settle_s)
        rival = self._earlier_rival(entry, lo, hi, (ev.ts, self.node_id))
        if rival is None:
            return True
        others = coverage(entry.num_layers, self.spans(entry))
        if best_start(others, hi - lo + 1) == lo and min(others[lo:hi + 1]) <= 0:
            return True  # still the best place even with the rival's claim
        self.events.append(CLAIM, claim_payload(
            model_id=entry.model_id, weights_sha256=entry.weights_sha256, lo=lo, hi=hi,
            speed=cost.speed, max_layers=max_layers, reason=reason, state="cancelled",
            detail=f"yielded to {rival}"))
        self._note("cancelled", entry, lo, hi, f"{rival} claimed it first")
        return False

    def _earlier_rival(self, entry: ModelEntry, lo: int, hi: int,
                       order: tuple[float, str]) -> str | None:
        for c in self._loading(entry):
            if c.lo <= hi and lo <= c.hi and c.order < order:
                return c.origin
        return None

    async def _load(self, entry: ModelEntry, cost: ModelCost, lo: int, hi: int, reason: str,
                    detail: str) -> HostedShard:
        self._check_running()  # the claim's settle time may have seen the stop begin
        need = missing_bytes(entry, lo, hi)
        if need:  # fetched from members before it loads (DESIGN.md decision 17)
            rate = self.fetch_rate() if self.fetch_rate is not None else None
            detail += (f"; fetches {need / 2**20:.0f} MB from members first "
                       f"(about {fetch_seconds(need, rate):.0f} s)")
        info = placement_info(model_id=entry.model_id, speed=cost.speed,
                              max_layers=self._max_layers(entry, cost), reason=reason,
                              detail=detail)
        shard = await self.host.load_shard(entry, lo, hi, info)
        self._note(reason, entry, lo, hi, detail)
        return shard

    async def _maybe_move(self, entry: ModelEntry, cost: ModelCost, reason: str) -> None:
        spans = self.spans(entry, claims=False)  # only what is up now keeps the old range
        for s in sorted(self._mine(entry), key=lambda s: s.lo):
            mine = next((x for x in spans if x.host == self.node_id and x.lo == s.lo
                         and x.hi == s.hi), None)
            if mine is None:
                continue
            move = plan_move(entry.num_layers, spans, mine, self.auto.balance_quality)
            if move is None:
                continue
            detail = (f"{reason}: moving {s.lo}-{s.hi} to {move.new_lo}-{move.new_hi} raises "
                      f"the weakest coverage {move.min_before:.3g} -> {move.min_after:.3g} "
                      f"tok/s (quality {move.quality:.2f} < {self.auto.balance_quality})")
            if not await self._claim_settles(entry, cost, move.new_lo, move.new_hi, reason,
                                             detail):
                return
            await self._load(entry, cost, move.new_lo, move.new_hi, reason, detail)
            # M26 §4.2: only now the old one goes; draining its sessions must not hold up
            # the next round (a lost range elsewhere), so it runs on its own
            note = (f"{reason}: withdrawn after {move.new_lo}-{move.new_hi} was up, freed "
                    "once its open sessions ended")
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.create_task(self._drop(entry, s, reason, note),
                                                   name="autohost-drop"))
            return

    async def _drop(self, entry: ModelEntry, s: HostedShard, reason: str, note: str) -> None:
        await self.host.drop_shard(s.shard_id, reason)
        self._note("dropped", entry, s.lo, s.hi, note)

    def _note(self, kind: str, entry: ModelEntry, lo: int, hi: int, detail: str) -> None:
        d = Decision(kind, entry.alias, [lo, hi], detail)
        self.decisions = [*self.decisions[-19:], d]
        log.info("autohost_decision", kind=kind, model=entry.alias, layers=[lo, hi],
                 detail=detail)

    # ---- status ----

    def status(self) -> dict[str, Any]:
        """This node's automatic-hosting facts (`hearthnet status`)."""
        last = {k: next((d.to_dict() for d in reversed(self.decisions) if d.kind == k), None)
                for k in ("initial", "rehost", "rebalance")}
        return {"enabled": True, "budget_mb": self.budget_mb, "format": self.format,
                "placed": self.started,
                "models": {mid: {"speed": round(c.speed, 2),
                                 "mb_per_layer": round(c.bytes_per_layer / 2**20, 2)}
                           for mid, c in self._costs.items()},
                "down_hosts": self.liveness.down_hosts(),
                "decisions": [d.to_dict() for d in self.decisions[-10:]],
                "last": last}


def _why(reason: str, lo: int, hi: int, cov: Iterable[float]) -> str:
    window = list(cov)[lo:hi + 1]
    weakest = min(window) if window else 0.0
    if weakest <= 0:
        return f"{reason}: layers {lo}-{hi} had no live host"
    return f"{reason}: layers {lo}-{hi} had the weakest coverage ({weakest:.3g} tok/s)"

