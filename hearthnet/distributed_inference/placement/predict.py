"""A plan before the download: who would host which layers, what each fetches, whether it
fits, and the tok/s to expect (`hearthnet plan`, ``/api/plan``; DESIGN.md decision 14,
M26 §10).

Pure functions, no I/O: callers hand in the model's sizes (`models.sizes`, read from headers
alone) and every live node's facts (`NodeFacts`: budget, measured speed, layers held), and
say where each number came from; every figure of the answer carries its source.

**Placement** is the automatic hosts' own rule (`planner`): nodes that hold layers keep
them; every other node's window length is `split_lengths` over all nodes' speeds and budgets
(`budget_layers` at the model's mean held bytes per layer; the orchestrator's budget less
its head) and it sits where coverage is weakest (`best_start`), fastest node first.

**Prediction** of one chat's decode rate (the pipeline of M26 §5.4: the orchestrator sends
each decode step through the stages in turn, each a round trip, then runs the head)::

    step = Σ stages (layers used / node speed) + head matmul / orchestrator speed
           + stages × hop cost
    single-chat tok/s = 1 / step

Speed is decoder-layer steps per second for one token (`planner.measure_speed`: a
matrix-vector product over a layer's weights); the head's lm_head costs
``head_matmul_params / params_per_layer`` layer steps. The hop cost is the per-hop
overhead (round trip minus the shard's compute: transport, serialisation, executor
hand-offs).

**Eight chats** (continuous batching, one decode round carries every chat's row): from a
measured factor ``aggregate(8) / single`` when one is given, else the stated model
`BATCH_MODEL`: a round of B rows streams each layer's weights once and pays the hops once,
so it costs one row's step plus a fixed ``row_ms`` per extra row (its attention, its
activations, the batcher's per-row work) — fixed in milliseconds, not a fraction of the
step: a small model's rows cost as much as a big one's (3.1x at 8 chats on SmolLM2, 6.9x
on the 1.5B shape, on the same machine).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hearthnet.distributed_inference.directory.formats import (
    QUANTISED,
    head_format,
    resolve_format,
)
from hearthnet.distributed_inference.engine.quant import held_nbytes
from hearthnet.distributed_inference.placement.planner import (
    HostCapacity,
    Span,
    best_start,
    budget_layers,
    coverage,
    gap_lengths,
    split_lengths,
)
from hearthnet.errors import BadRequest
from hearthnet.models.sizes import ModelSizes, TensorSize

GIB = 2**30
MIB = 2**20
CHATS = 8  # the batched figure's chats (the batching goals compare 8 with 1)

DEFAULT_HOP_MS = 1.54
DEFAULT_HOP_SOURCE = ("default: bench pipeline's per-hop overhead p50 on SmolLM2, 2 shards, "
                      "loopback (docs/benchmarks.md); no hop measured on this mesh yet")
ROW_MS = 8.5
BATCH_MODEL = (f"model: a round of {CHATS} rows costs one row's step plus {ROW_MS} ms per "
               f"extra row (fitted to docs/benchmarks.md's {CHATS}-chat aggregates on the "
               f"2-core VM: SmolLM2 3.1x, the Qwen2.5-1.5B shape 6.9x); no node reports "
               f"its batched-round scaling yet")


@dataclass(frozen=True, slots=True)
class Sourced:
    """A number and where it came from (printed beside it)."""

    value: float
    source: str


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """A model as the plan sees it in one held format: bytes per layer and of the head."""

    model: str
    num_layers: int
    fmt: str  # the resolved held format of the layers
    head_fmt: str
    held: tuple[int, ...]  # per layer, as held
    stored: tuple[int, ...]  # per layer, as stored (what a fetch moves)
    head_held: int
    head_stored: int
    params_per_layer: int
    head_matmul_params: int

    @property
    def mean_held(self) -> int:
        return -(-sum(self.held) // max(1, self.num_layers))

    def held_of(self, lo: int, hi: int) -> int:
        return sum(self.held[lo:hi + 1])

    def stored_of(self, lo: int, hi: int) -> int:
        return sum(self.stored[lo:hi + 1])


def _held(t: TensorSize, fmt: str) -> int:
    return held_nbytes(t.shape, fmt, len(t.shape) == 2, t.ggml_type)


def layer_costs(sizes: ModelSizes, weights: str) -> LayerCosts:
    """Held and stored bytes of every layer and of the head of `sizes` held as `weights`
    (a format name; ``native`` resolves to the stored one), as `engine.memory` counts them.

    Raises:
        BadRequest: an unknown format.
    """
    fmt = resolve_format(weights, sizes.stored_format)
    head = resolve_format(head_format(weights), sizes.stored_format)
    held = [0] * sizes.num_layers
    for t in sizes.tensors:
        if t.layer is not None and t.layer < sizes.num_layers:
            held[t.layer] += _held(t, fmt)
    head_held = sum(held_nbytes(t.shape, head, len(t.shape) == 2 and head in QUANTISED,
                                t.ggml_type) for t in sizes.head_tensors())
    return LayerCosts(sizes.source, sizes.num_layers, fmt, head, tuple(held),
                      tuple(sizes.layer_stored_bytes()), head_held, sizes.head_stored_bytes(),
                      sizes.params_per_layer(), sizes.head_matmul_params())


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """One live node as the plan sees it.

    `speed`: decoder-layer steps per second of this model for one token, with its source;
    `budget_bytes`: memory it gives the model's layers (None: unstated, no limit);
    `holds`: the layer ranges it already hosts or holds in its store;
    `orchestrator`: it runs the head (the node you chat through).
    """

    node_id: str
    speed: Sourced
    budget_bytes: int | None = None
    budget_source: str = "unstated"
    holds: tuple[tuple[int, int], ...] = ()
    orchestrator: bool = False
    head_held: bool = False
    # the head's step (embed, norm + lm_head, pick) as layer steps per second of its
    # matmul, timed or probed; None: the layer speed
    head_speed: float | None = None


@dataclass
class NodePlan:
    """What one node would do: its layers, what it fetches and holds, whether it fits."""

    node_id: str
    layers: list[tuple[int, int]]
    fetch_bytes: int
    held_bytes: int
    budget_bytes: int | None
    budget_source: str
    speed: Sourced
    orchestrator: bool
    fetch_head: bool
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node_id, "layers": [list(r) for r in self.layers],
                "fetch_bytes": self.fetch_bytes, "held_bytes": self.held_bytes,
                "budget_bytes": self.budget_bytes, "budget_source": self.budget_source,
                "speed": round(self.speed.value, 3), "speed_source": self.speed.source,
                "orchestrator": self.orchestrator, "fetch_head": self.fetch_head,
                "fits": self.fits}


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of the predicted pipeline: `node` runs layers `lo..hi`."""

    node_id: str
    lo: int
    hi: int
    ms: float


@dataclass
class Plan:
    """The answer: placement, fetches, fit, and the predicted decode rates."""

    costs: LayerCosts
    nodes: list[NodePlan]
    missing: list[tuple[int, int]]
    missing_bytes: int
    problems: list[str]
    stages: list[Stage]
    hop: Sourced
    head_ms: float
    single_tps: float | None
    chats_tps: float | None
    chats_source: str
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def step_ms(self) -> float | None:
        return 1000.0 / self.single_tps if self.single_tps else None

    def to_dict(self) -> dict[str, Any]:
        c = self.costs
        return {"model": c.model, "num_layers": c.num_layers, "weights": c.fmt,
                "head_weights": c.head_fmt, "layer_held_bytes": list(c.held),
                "head_held_bytes": c.head_held, "head_stored_bytes": c.head_stored,
                "fits": self.fits, "problems": self.problems,
                "missing_layers": [list(r) for r in self.missing],
                "missing_bytes": self.missing_bytes,
                "nodes": [n.to_dict() for n in self.nodes],
                "stages": [{"node": s.node_id, "layers": [s.lo, s.hi], "ms": round(s.ms, 3)}
                           for s in self.stages],
                "hop_ms": round(self.hop.value, 3), "hop_source": self.hop.source,
                "head_ms": round(self.head_ms, 3),
                "step_ms": round(self.step_ms, 3) if self.step_ms else None,
                "single_chat_tokens_per_s": _r(self.single_tps),
                f"chats_{CHATS}_tokens_per_s": _r(self.chats_tps),
                f"chats_{CHATS}_source": self.chats_source, "notes": self.notes}


def _r(v: float | None) -> float | None:
    return round(v, 2) if v is not None else None


def place(costs: LayerCosts, nodes: Sequence[NodeFacts]) -> dict[str, list[tuple[int, int]]]:
    """Layer ranges per node: held ranges kept, the others placed as the automatic hosts
    place themselves (see the module docstring). Deterministic."""
    n = costs.num_layers
    out: dict[str, list[tuple[int, int]]] = {f.node_id: [] for f in nodes}
    spans = []
    for f in nodes:
        for lo, hi in f.holds:
            lo, hi = max(0, lo), min(n - 1, hi)
            if lo <= hi:
                out[f.node_id].append((lo, hi))
                spans.append(Span(f.node_id, lo, hi, f.speed.value))
    newcomers = sorted((f for f in nodes if not out[f.node_id]),
                       key=lambda f: (-f.speed.value, f.node_id))
    # the layers no one holds are shared among the others by speed and budget
    free = sum(1 for c in coverage(n, spans) if c <= 0)
    lengths = split_lengths(free, [HostCapacity(f.node_id, f.speed.value,
                                                _max_layers(costs, f)) for f in newcomers])
    for f in newcomers:
        length = lengths.get(f.node_id, 0)
        if length <= 0:
            continue
        lo = best_start(coverage(n, spans), length)
        out[f.node_id].append((lo, lo + length - 1))
        spans.append(Span(f.node_id, lo, lo + length - 1, f.speed.value))
    return out


def _max_layers(costs: LayerCosts, f: NodeFacts) -> int:
    if f.budget_bytes is None:
        return costs.num_layers
    room = f.budget_bytes - (costs.head_held if f.orchestrator else 0)
    return budget_layers(max(0, room), costs.mean_held, costs.num_layers)


def chain(costs: LayerCosts, ranges: Mapping[str, list[tuple[int, int]]],
          speeds: Mapping[str, float]) -> list[Stage]:
    """The stages a call would take (the router's further-reach rule, M26 §5.2: from the
    first uncovered layer, the range reaching furthest, then the faster); [] when a layer
    has no host."""
    cands = [(lo, hi, nid) for nid, rs in ranges.items() for lo, hi in rs]
    cursor, stages = 0, []
    while cursor < costs.num_layers:
        here = [c for c in cands if c[0] <= cursor <= c[1]]
        if not here:
            return []
        _, hi, nid = max(here, key=lambda c: (c[1], speeds[c[2]], c[2]))
        stages.append(Stage(nid, cursor, hi, 1000.0 * (hi - cursor + 1) / speeds[nid]))
        cursor = hi + 1
    return stages


def single_chat_tps(stages: Sequence[Stage], head_ms: float, hop_ms: float) -> float:
    """One chat's decode tokens per second (the module docstring's formula)."""
    step = sum(s.ms for s in stages) + head_ms + len(stages) * hop_ms
    return 1000.0 / step if step > 0 else math.inf


def chats_tps(stages: Sequence[Stage], head_ms: float, hop_ms: float,
              measured_factor: Sourced | None, chats: int = CHATS,
              row_ms: float = ROW_MS) -> Sourced:
    """Aggregate tokens per second of `chats` chats at once: the measured factor applied to
    the single-chat rate, else `BATCH_MODEL`."""
    single = single_chat_tps(stages, head_ms, hop_ms)
    if measured_factor is not None:
        return Sourced(single * measured_factor.value, measured_factor.source)
    round_ms = 1000.0 / single + (chats - 1) * row_ms
    return Sourced(1000.0 * chats / round_ms, BATCH_MODEL)


def plan(costs: LayerCosts, nodes: Sequence[NodeFacts], hop: Sourced | None = None,
         batch_factor: Sourced | None = None) -> Plan:
    """The plan for `costs` on `nodes` (see the module docstring).

    Raises:
        BadRequest: no node, two nodes of one id, or a speed that is not positive.
    """
    _check(nodes)
    hop = hop or Sourced(DEFAULT_HOP_MS, DEFAULT_HOP_SOURCE)
    ranges = place(costs, nodes)
    n = costs.num_layers
    speeds = {f.node_id: f.speed.value for f in nodes}
    spans = [Span(nid, lo, hi, speeds[nid]) for nid, rs in ranges.items() for lo, hi in rs]
    missing = gap_lengths(coverage(n, spans))
    problems, plans = [], []
    for f in nodes:
        rs = ranges[f.node_id]
        held = sum(costs.held_of(lo, hi) for lo, hi in rs) + \
            (costs.head_held if f.orchestrator else 0)
        fetch = sum(costs.stored[i] for lo, hi in rs for i in range(lo, hi + 1)
                    if not any(a <= i <= b for a, b in f.holds))
        fetch_head = f.orchestrator and not f.head_held
        fetch += costs.head_stored if fetch_head else 0
        fits = f.budget_bytes is None or held <= f.budget_bytes
        if not fits:
            problems.append(f"{f.node_id} would hold {held / MIB:.0f} MiB, over its budget "
                            f"of {f.budget_bytes / MIB:.0f} MiB by "  # type: ignore[operator]
                            f"{(held - f.budget_bytes) / MIB:.0f} MiB")  # type: ignore[operator]
        plans.append(NodePlan(f.node_id, rs, fetch, held, f.budget_bytes, f.budget_source,
                              f.speed, f.orchestrator, fetch_head, fits))
    missing_bytes = sum(costs.held_of(lo, hi) for lo, hi in missing)
    if missing:
        problems.append("layers " + ", ".join(f"{lo}-{hi}" for lo, hi in missing) +
                        f" have no host: {missing_bytes / MIB:.0f} MiB more budget needed "
                        f"(as {costs.fmt})")
    orch = next((f for f in nodes if f.orchestrator), None)
    notes = []
    if orch is None:
        notes.append("no orchestrator among the nodes: the head is timed at the mean speed")
    orch_speed = (orch.head_speed or orch.speed.value) if orch else \
        sum(speeds.values()) / len(speeds)
    head_ms = 1000.0 * costs.head_matmul_params / max(1, costs.params_per_layer) / orch_speed
    stages = chain(costs, ranges, speeds)
    if not stages:
        return Plan(costs, plans, missing, missing_bytes, problems, [], hop, head_ms,
                    None, None, "no prediction: not every layer has a host", notes)
    batched = chats_tps(stages, head_ms, hop.value, batch_factor)
    return Plan(costs, plans, missing, missing_bytes, problems, stages, hop, head_ms,
                single_chat_tps(stages, head_ms, hop.value), batched.value, batched.source,
                notes)


def _check(nodes: Sequence[NodeFacts]) -> None:
    if not nodes:
        raise BadRequest("no node to plan for: give --node NAME:BUDGET_GB[:SPEED] or run "
                         "a node (--config)")
    ids = [f.node_id for f in nodes]
    if len(set(ids)) != len(ids):
        raise BadRequest(f"two nodes named alike in {ids}")
    for f in nodes:
        if not (f.speed.value > 0 and math.isfinite(f.speed.value)):
            raise BadRequest(f"{f.node_id}: speed must be a positive number of layer steps "
                             f"per second, got {f.speed.value}")


def hop_from_histogram(samples: Iterable[tuple[str, Mapping[str, str], float]],
                       name: str = "hearthnet_distributed_inference_hop_overhead_ms"
                       ) -> Sourced | None:
    """The mean per-hop overhead in a Prometheus histogram's samples (``_sum``/``_count``
    over every shard), or None when it has none."""
    total = count = 0.0
    for sample, _labels, value in samples:
        if sample == name + "_sum":
            total += value
        elif sample == name + "_count":
            count += value
    if count <= 0:
        return None
    return Sourced(total / count, f"measured: this orchestrator's {name} "
                   f"(mean of {int(count)} hops)")


def speed_for(params_per_s: float, costs: LayerCosts) -> float:
    """Layer steps per second of `costs`' layers from a speed in parameters per second
    (a one-token step is bound by streaming the layer's weights: `measure_speed`)."""
    return params_per_s / max(1, costs.params_per_layer)


def describe(p: Plan) -> str:
    """The plan as a table a person reads at a glance, every figure with its source."""
    c = p.costs
    lines = [f"plan for {c.model}: {c.num_layers} layers as {c.fmt} "
             f"({c.mean_held / MIB:.1f} MiB per layer), head as {c.head_fmt} "
             f"{c.head_held / MIB:.1f} MiB", ""]
    w = max([4, *(len(n.node_id) for n in p.nodes)])
    lines.append(f"{'NODE':<{w}}  {'LAYERS':<12} {'HOLDS MiB':>10} {'BUDGET MiB':>10} "
                 f"{'FETCH MiB':>10} {'SPEED':>8}  FITS")
    for n in p.nodes:
        layers = ", ".join(f"{lo}-{hi}" for lo, hi in n.layers) or "-"
        if n.orchestrator:
            layers += " +head"
        budget = f"{n.budget_bytes / MIB:.0f}" if n.budget_bytes is not None else "-"
        lines.append(f"{n.node_id:<{w}}  {layers:<12} {n.held_bytes / MIB:>10.1f} "
                     f"{budget:>10} {n.fetch_bytes / MIB:>10.1f} {n.speed.value:>8.1f}  "
                     f"{'yes' if n.fits else 'NO'}")
    lines.append("")
    lines += [f"  {n.node_id}: speed {n.speed.source}; budget {n.budget_source}"
              for n in p.nodes]
    lines.append("")
    lines.append("fits: yes" if p.fits else "fits: NO\n" + "\n".join(
        f"  {x}" for x in p.problems))
    if p.single_tps is not None:
        path = " -> ".join(f"{s.node_id}[{s.lo}-{s.hi}] {s.ms:.1f} ms" for s in p.stages)
        lines += [f"pipeline: {path}; head {p.head_ms:.1f} ms; {len(p.stages)} hops x "
                  f"{p.hop.value:.2f} ms",
                  f"  hop cost: {p.hop.source}",
                  f"predicted single chat: {p.single_tps:.1f} tok/s "
                  f"(decode step {p.step_ms:.1f} ms)",
                  f"predicted {CHATS} chats: {p.chats_tps:.1f} tok/s in all "
                  f"({p.chats_source})"]
    else:
        lines.append(f"predicted tok/s: {p.chats_source}")
    lines += [f"note: {x}" for x in p.notes]
    return "\n".join(lines)


# ---- a mesh's facts, portable across models ----
#
# A node's speed is kept in parameters per second (layer steps per second × the parameters
# of a layer of the model it was measured on): a one-token step streams the layer's weights,
# so the same node runs another model's layers at params_per_s / that model's layer params.

def mesh_facts(status: Mapping[str, Any],
               capacities: Mapping[str, Mapping[str, tuple[float, int]]],
               model_shapes: Mapping[str, tuple[int, int]], hop: Sourced,
               own_speed: Sourced | None = None, own_budget_bytes: int | None = None
               ) -> list[dict[str, Any]]:
    """Every online node's facts, JSON-safe (``/api/plan``'s ``nodes``).

    Args:
        status: the node's `mesh_status` JSON.
        capacities: per host, per model id, (layer steps/s, max layers) of its
            ``experimental.placement.capacity`` event.
        model_shapes: per model id of the local store, (params per layer, held bytes per
            layer) — to turn layer counts and layer speeds into portable units.
        hop: the per-hop cost, to take out of a shard's round trip.
        own_speed: this node's speed in parameters per second, when it measured one.
        own_budget_bytes: this node's layer budget (automatic hosting), when it has one.
    """
    out = []
    shards = status.get("shards") or []
    for n in status.get("nodes") or []:
        if not n.get("online"):
            continue
        nid = str(n["node_id"])
        holds: dict[str, list[list[int]]] = {}
        for s in shards:
            if s.get("host") == nid and s.get("state") != "offline" and s.get("usable", True):
                holds.setdefault(str(s["model_id"]), []).append(list(s["layers"]))
        speed, budget = _speed_and_budget(nid, shards, capacities.get(nid, {}), model_shapes,
                                          hop)
        if n.get("self"):
            if speed is None and own_speed is not None:
                speed = own_speed
            if budget is None and own_budget_bytes is not None:
                budget = Sourced(own_budget_bytes, "this node's automatic-hosting budget")
        out.append({"node": nid, "self": bool(n.get("self")),
                    "params_per_s": speed.value if speed else None,
                    "speed_source": speed.source if speed else "unknown",
                    "budget_bytes": int(budget.value) if budget else None,
                    "budget_source": budget.source if budget else "unstated", "holds": holds,
                    # the orchestrator's store: a model there needs no head fetched
                    "stored": [str(m["model_id"]) for m in status.get("models") or []]
                    if n.get("self") else []})
    return out


def _speed_and_budget(nid: str, shards: Sequence[Mapping[str, Any]],
                      caps: Mapping[str, tuple[float, int]],
                      model_shapes: Mapping[str, tuple[int, int]], hop: Sourced
                      ) -> tuple[Sourced | None, Sourced | None]:
    for mid, (speed, max_layers) in sorted(caps.items()):
        if mid in model_shapes:
            params, held = model_shapes[mid]
            return (Sourced(speed * params, f"its capacity event for {mid} ({speed:.0f} layer "
                                            "steps/s, matrix-vector probe)"),
                    Sourced(max_layers * held, f"its capacity event: {max_layers} layers of "
                                               f"{mid}"))
    for s in shards:  # a hand-placed host: its shard's round trip less the hop
        mid = str(s.get("model_id"))
        rtt = s.get("p95_latency_ms")
        if s.get("host") == nid and mid in model_shapes and rtt:
            layers = s["layers"][1] - s["layers"][0] + 1
            compute = max(float(rtt) - hop.value, 1e-3)
            return (Sourced(1000.0 * layers / compute * model_shapes[mid][0],
                            f"measured: its shard {s['layers'][0]}-{s['layers'][1]} of {mid}, "
                            f"p95 round trip {float(rtt):.1f} ms less the hop"), None)
    return None, None


def node_facts(nodes: Sequence[Mapping[str, Any]], costs: LayerCosts, model_id: str,
               fallback: Sourced | None = None) -> list[NodeFacts]:
    """`NodeFacts` for `costs` from `mesh_facts` rows; the node marked ``self`` is the
    orchestrator. A node whose speed is unknown gets `fallback` (parameters per second),
    or is left out when there is none.
    """
    out = []
    for n in nodes:
        pps = n.get("params_per_s")
        source = str(n.get("speed_source", ""))
        if not pps:
            if fallback is None:
                continue
            pps, source = fallback.value, fallback.source
        holds = tuple((int(lo), int(hi)) for lo, hi in (n.get("holds") or {}).get(model_id, []))
        budget = n.get("budget_bytes")
        out.append(NodeFacts(str(n["node"]), Sourced(speed_for(float(pps), costs), source),
                             int(budget) if budget is not None else None,
                             str(n.get("budget_source", "unstated")), holds,
                             orchestrator=bool(n.get("self")),
                             head_held=model_id in (n.get("stored") or [])))
    return out
