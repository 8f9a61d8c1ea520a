"""`hearthnet bench household`: one model on a household's machines (M26 §1, §8.2, §10).

N node processes (``--nodes``, default 3), each on its own emulated machine: a network
namespace on a bridge whose link is shaped by ``--profile`` (`hearthnet.bench.lan`:
``gigabit``, ``wifi``, ``mixed`` — the first node on gigabit, the others on Wi-Fi — or
``loopback``: every node on 127.0.0.1). Every node hosts automatically (``shards =
"auto"``) with a memory budget smaller than the model (``--budget-fraction`` of the
model's layers as held in ``--weights``, or ``--budgets-mb``); the first node is the
community's steward, puts the model on the served-model list and answers the chats.

``--import-on all``: every node's store holds the model (as in every other benchmark).
``--import-on one``: only the first node's does; the others start with empty stores and
fetch their layers from the members (M26 §10's household: one import covers the house).
The bench reads each node's fetches from its ``/status`` (``fetches``: bytes done per
model) and reports them against the stored size of the layers it hosts.

Measured, in order, on one mesh:

1. coverage: from the start of the node processes until the first node sees every layer
   hosted (fetches and loads included), each node's layers and bytes fetched; a model not
   covered within ``--cover-timeout`` ends the run with the nodes that hold nothing;
2. single chat: first token and decode tokens/s, the median of ``--runs`` greedy chats;
3. ``--concurrency`` levels (default 1 and 8 chats at once, `hearthnet.bench.concurrency`);
4. one node other than the first is killed (SIGKILL, its whole namespace on a LAN) after
   ``--kill-after`` tokens of a chat: the chat must still end — through another host,
   the first node's local engine where its budget holds the whole model, or else with an
   error naming the layers no live node holds — and its tokens are compared with the
   unkilled answer.

``--compare-loopback`` builds the same household on the loopback beside the first (both
stand at once, and their single chats alternate, so a change in the machine's load hits
both) and gives the ratio of the single-chat tokens/s (the goal: Wi-Fi ≥ 0.85 ×
loopback); its concurrency levels and kill follow the first's. The links are shaped by
`tc netem` where the kernel has it, else by the user-space emulator
(`hearthnet.bench.linkem`; ``--shaper`` picks one), and the report says which. Where
namespaces cannot be made (not root, no iproute2, neither netem nor ``/dev/net/tun``) the
output says why and the same runs on the loopback. Processes, namespaces, links, the
bridge, the emulator and temporary folders are removed at the end, also on failure, Ctrl-C
and SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet.argtypes import at_least, decode_tokens, number_in, positive
from hearthnet.bench import (
    PROMPTS,
    concurrency,
    machine,
    median,
    single_model_dir,
    table,
    write_results,
)
from hearthnet.bench.lan import (
    PROFILES,
    Lan,
    LanMesh,
    Link,
    add_shaper_arg,
    lan_mesh,
    links_for,
    terminate_as_interrupt,
)
from hearthnet.bench.pipeline import prediction_report
from hearthnet.distributed_inference.directory.formats import (
    FORMATS,
    head_format,
    policy_for,
    resolve_format,
)
from hearthnet.errors import BadRequest, HearthNetError, ShardUnavailable, error_from_code
from hearthnet.mesh.launcher import NodeSpec, log_tails

GOALS = {"budget_fraction_max": 0.45, "fetch_ratio_max": 1.1, "wifi_ratio_min": 0.85}
"""The issue's household: each budget below 45 % of the model, each node fetching at most
1.1 × its layers, single-chat tokens/s on Wi-Fi ≥ 0.85 × the same mesh on loopback."""
GOAL_SCENE = ("qwen2.5-7b", 3)  # the model and node count the goals were set for
_MIB = 2**20
_LAYER = re.compile(r"layers\.(\d+)\.")


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench household`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store (any stored "
                   "or synthetic model, e.g. `hearthnet models synth qwen2.5-7b`)")
    p.add_argument("--weights", default="fp32", choices=FORMATS,
                   help="format the hosts hold their layers in (default fp32)")
    p.add_argument("--nodes", type=at_least(2), default=3, help="machines (default 3)")
    p.add_argument("--profile", choices=PROFILES, default="wifi",
                   help="the links: gigabit (0.2 ms, 1 Gbit/s), wifi (2 ms ± 0.5 ms, "
                        "300 Mbit/s, 0.1 %% loss), mixed (the first node on gigabit, the "
                        "others on wifi) or loopback; each link shapes both directions, so "
                        "a packet between two nodes pays two links (default wifi)")
    add_shaper_arg(p)
    p.add_argument("--import-on", choices=["one", "all"], default="all",
                   help="whose store holds the model: every node's, or only the first's "
                        "(the others fetch their layers; default all)")
    p.add_argument("--budget-fraction", type=number_in(0, 1), default=0.4,
                   help="each node's memory budget as a fraction of the model's layers as "
                        "held (default 0.4)")
    p.add_argument("--budgets-mb", default=None,
                   help="each node's budget in MiB, comma-separated (one per node; instead "
                        "of --budget-fraction)")
    p.add_argument("--tokens", type=decode_tokens, default=48, help="tokens per chat")
    p.add_argument("--runs", type=positive, default=3,
                   help="single chats measured (median) and rounds per concurrency level")
    p.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8],
                   help="chats at once for the aggregate figure (default 1 8)")
    p.add_argument("--kill-after", type=positive, default=12,
                   help="kill a node after this many tokens of the faulted chat (default 12)")
    p.add_argument("--cover-timeout", type=positive, default=900,
                   help="seconds the model may take to be covered, fetches included "
                        "(default 900)")
    p.add_argument("--compare-loopback", action="store_true",
                   help="then the same household on the loopback, and the tokens/s ratio")
    p.add_argument("--node-threads", type=positive, default=1, help="torch threads per node")
    p.add_argument("--wire", choices=["fp32", "bf16", "fp16"], default="fp16",
                   help="wire dtype of the hidden states (default fp16)")
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for household-<profile>.json (default bench-results)")


# ---- pure parts --------------------------------------------------------------------------


def budgets_mb(layers_held_bytes: int, num_layers: int, nodes: int, fraction: float,
               explicit: str | None) -> list[int]:
    """Each node's budget in MiB: `explicit` (comma-separated, one per node) or `fraction`
    of the layers' held bytes.

    Raises:
        BadRequest: a malformed list, or budgets that together cannot hold every layer
            (the model could never be covered: said before anything starts).
    """
    if explicit is not None:
        try:
            out = [int(x) for x in explicit.split(",")]
        except ValueError:
            out = []
        if len(out) != nodes or min(out) < 1:
            raise BadRequest(f"--budgets-mb must be {nodes} positive integers (one per "
                             f"node), not {explicit!r}")
    else:
        out = [max(1, int(fraction * layers_held_bytes / _MIB))] * nodes
    per_layer = -(-layers_held_bytes // max(1, num_layers))
    held = sum(min(num_layers, b * _MIB // per_layer) for b in out)
    if held < num_layers:
        raise BadRequest(f"the budgets {out} MiB hold {held} of the model's {num_layers} "
                         f"layers ({per_layer / _MIB:.1f} MiB each): it could never be "
                         f"covered; raise --budget-fraction or --nodes")
    return out


def split_of(status: dict[str, Any], model_id: str) -> dict[str, list[list[int]]]:
    """{host: its layer ranges} of `model_id`'s usable, online shards in a `/status`."""
    out: dict[str, list[list[int]]] = {}
    for s in status.get("shards", []):
        if s.get("model_id") == model_id and s.get("state") != "offline" and \
                s.get("usable", True):
            out.setdefault(str(s["host"]), []).append(list(s["layers"]))
    return {h: sorted(r) for h, r in sorted(out.items())}


def covered(status: dict[str, Any], alias: str) -> bool:
    return any(m.get("alias") == alias and m.get("fully_covered")
               for m in status.get("models", []))


def fetched_bytes(status: dict[str, Any], names: tuple[str, ...]
                  ) -> tuple[int, list[Any]] | None:
    """(bytes fetched, the fetch entries) of a model named any of `names` in a node's own
    `/status`; None where the node reports no ``fetches`` at all (it cannot fetch)."""
    if "fetches" not in status:
        return None
    rows = [f for f in status["fetches"] if f.get("model") in names]
    return sum(int(f.get("bytes_done", 0)) for f in rows), rows


def unhosted_fetches(rows: list[Any], ranges: list[list[int]]) -> list[list[int]]:
    """The layer ranges of finished fetches that `ranges` (a node's hosted layers) do not
    yet contain: layers fetched for a shard that is still loading."""
    held = {i for lo, hi in ranges for i in range(lo, hi + 1)}
    return [f["layers"] for f in rows if f.get("state") == "done" and f.get("layers")
            and not set(range(f["layers"][0], f["layers"][1] + 1)) <= held]


def not_covered_message(timeout: float, nodes: list[str], split: dict[str, Any],
                        fetch_reported: bool) -> str:
    """Why the run ends when the model is not covered in time: the nodes holding nothing."""
    empty = [n for n in nodes if not split.get(n)]
    msg = f"the model was not covered within {timeout:.0f} s"
    if empty:
        msg += f": nodes {', '.join(empty)} hold nothing"
    if not fetch_reported:
        msg += " (no node reports fetches: these nodes cannot fetch layers they do not hold)"
    return msg


def layer_count(ranges: list[list[int]]) -> int:
    return len({i for lo, hi in ranges for i in range(lo, hi + 1)})


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The single-chat figures: medians over runs of the `done` frames' timings and the
    client's first token."""
    return {"tokens_per_second": round(median([r["tokens_per_second"] for r in runs]), 2),
            "tokens_per_second_runs": [round(r["tokens_per_second"], 2) for r in runs],
            "first_token_ms": round(median([r["first_token_ms"] for r in runs]), 1),
            "client_first_token_ms": round(median([r["client_first_token_ms"]
                                                   for r in runs]), 1),
            "completion_tokens": runs[-1]["completion_tokens"],
            # each stage's round trip and overhead p50 (median over the runs)
            "stages": {sid: {"layers": st["layers"],
                             **{k: round(median([r["stages"][sid][k] for r in runs
                                                 if sid in r.get("stages", {})]), 3)
                                for k in ("p50_ms", "overhead_p50_ms")}}
                       for sid, st in runs[-1].get("stages", {}).items()}}


def stage_lines(pred: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """Each stage's predicted compute beside its measured round trip less overhead."""
    got = {tuple(m["layers"]): m for m in measured.values()}
    out = []
    for st in pred.get("engine", {}).get("stages", []):
        m = got.get(tuple(st["layers"]))
        if m is not None:
            out.append(f"  stage {st['layers'][0]}-{st['layers'][1]}: predicted {st['ms']} ms "
                       f"of compute, measured {round(m['p50_ms'] - m['overhead_p50_ms'], 3)} "
                       f"ms (round trip p50 {m['p50_ms']} ms, overhead {m['overhead_p50_ms']})")
    return out


def warmup_hop(done: dict[str, Any]) -> dict[str, Any] | None:
    """The per-hop overhead the warm-up chat measured (the mean of its stages' p50s: a
    step pays every stage's hop), or None when it went through no stage."""
    per = done.get("timings", {}).get("per_shard", {})
    if not per:
        return None
    return {"ms": round(sum(s["overhead_p50_ms"] for s in per.values()) / len(per), 3),
            "stages": len(per)}


def goals(f: dict[str, Any]) -> dict[str, Any]:
    """Each household goal the run measured: measured, goal, met."""
    out: dict[str, Any] = {}
    frac = f["budget_fraction_of_layers"]
    out["budget_fraction"] = {"measured": frac, "goal": GOALS["budget_fraction_max"],
                              "met": frac < GOALS["budget_fraction_max"]}
    out["covered"] = {"measured": f["coverage"]["covered"], "goal": True,
                      "met": f["coverage"]["covered"]}
    ratios = [n["fetch_ratio"] for n in f["coverage"]["nodes"].values()
              if n["fetch_ratio"] is not None and n["imported"] is False]
    if f["import_on"] == "one" and ratios:
        worst = max(ratios)
        out["fetch_ratio"] = {"measured": worst, "goal": GOALS["fetch_ratio_max"],
                              "met": worst <= GOALS["fetch_ratio_max"]}
    answered = f.get("single", {}).get("completion_tokens", 0) > 0
    out["chat_answered"] = {"measured": answered, "goal": True, "met": answered}
    plan = (f.get("prediction") or {}).get("engine_vs_measured", {})
    if "ratio_single" in plan:  # the plan's single-chat tok/s against this run's
        out["plan_ratio"] = {"measured": plan["ratio_single"], "goal": "0.75..1.25",
                             "met": bool(plan["within_25_percent"])}
    ratio = f.get("ratio_to_loopback")
    if ratio is not None and f["link"]["profile"] == "wifi" and f["link"]["applied"]:
        out["wifi_ratio_to_loopback"] = {"measured": ratio, "goal": GOALS["wifi_ratio_min"],
                                         "met": ratio >= GOALS["wifi_ratio_min"]}
    return out


# ---- the mesh ----------------------------------------------------------------------------


@dataclass
class Household:
    """A started, covered household: its mesh, node ids (the first answers the chats) and
    figures so far."""

    mesh: LanMesh
    ids: list[str]
    figures: dict[str, Any]

    @property
    def uri(self) -> str:
        return self.mesh.nodes[self.ids[0]].uri

    def scrape(self) -> dict[str, str]:
        """Every node's /metrics text (the concurrency levels' batch sizes)."""
        return {n: self.mesh.metrics(n) for n in self.ids}


# ---- the run -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The household on the profile's links (and, with --compare-loopback, on the
    loopback); returns (figures, report)."""
    from hearthnet.bench import lan as lanmod
    from hearthnet.distributed_inference.placement.autohost import layer_bytes
    from hearthnet.models import ModelStore

    entry = ModelStore().get(args.model)
    held = layer_bytes(entry, resolve_format(args.weights, entry.dtype)) * entry.num_layers
    budgets = budgets_mb(held, entry.num_layers, args.nodes, args.budget_fraction,
                         args.budgets_mb)
    if not 1 <= args.kill_after <= args.tokens - 2:
        raise BadRequest(f"--kill-after must be in 1..{args.tokens - 2} (tokens - 2), not "
                         f"{args.kill_after}")
    shaper = None if args.profile == "loopback" else lanmod.pick_shaper(args.shaper)
    why = shaper.note if shaper is not None and shaper.name is None else None
    if why is not None:
        print(f"--profile {args.profile}: {why}; running on the plain loopback",
              file=sys.stderr)
    links = [] if why is not None else links_for(args.profile, args.nodes)
    figures: dict[str, Any] = {
        "benchmark": "household", "model": args.model, "model_id": entry.model_id,
        "nodes": args.nodes, "import_on": args.import_on, "tokens": args.tokens,
        "runs": args.runs, "machine": machine(),
        "budgets_mb": budgets, "layers_held_bytes": held,
        "budget_fraction_of_layers": round(max(budgets) * _MIB / held, 3),
        "link": {"profile": args.profile, "applied": bool(links), "why_not": why,
                 "shaper": shaper.name if shaper is not None and links else None,
                 "shaper_note": shaper.note if shaper is not None and links else None,
                 "links": [lk.to_dict() for lk in links]},
        "settings": {"weights": args.weights, "wire_dtype": args.wire,
                     "node_torch_threads": args.node_threads, "sampling": "greedy",
                     "prompt": args.prompt, "concurrency": args.concurrency,
                     "kill_after_tokens": args.kill_after,
                     "cover_timeout_s": args.cover_timeout,
                     "placement": "every node shards = \"auto\" with its budget; the first "
                                  "is the steward and serves the model; rebalancing off "
                                  "during the run (one placement per measurement)"}}
    with terminate_as_interrupt(), contextlib.ExitStack() as stack:
        # both households stand at once and their single chats alternate, so a change in
        # the machine's load hits both sides of the ratio
        built = [stack.enter_context(_built(args, entry, budgets, links))]
        if args.compare_loopback:
            built.append(stack.enter_context(_built(args, entry, budgets, [])))
        measured = asyncio.run(_measure(built, args))
    figures.update(measured[0])
    if args.compare_loopback:
        figures["loopback"] = measured[1]
        lo = measured[1]["single"]["tokens_per_second"]
        figures["ratio_to_loopback"] = round(
            figures["single"]["tokens_per_second"] / lo, 3) if lo else None
    figures["prediction"] = _prediction(entry, args, figures)
    scene = (args.model, args.nodes) == GOAL_SCENE
    figures["goals_source"] = ("the issue's household: qwen2.5-7b on 3 nodes" if scene else
                               f"the 7B household's goals, checked on {args.model} over "
                               f"{args.nodes} nodes")
    figures["goals"] = goals(figures)
    name = f"household-{args.model}-{args.profile}-{args.import_on}"
    figures["results_file"] = str(write_results(name, figures, Path(args.results_dir)))
    return figures, report(figures)


def _prediction(entry: Any, args: argparse.Namespace, f: dict[str, Any]
                ) -> dict[str, Any] | None:
    """`hearthnet plan`'s prediction for the split the household chose (one stage per
    node's range, the first node orchestrating; every node this machine at
    ``--node-threads``), beside the single chat and 8 chats measured on the profile's
    links (`bench.pipeline.predict_run`: a real decoder layer timed in the engine, and the
    probe automatic hosts advertise). Overlapping ranges become consecutive stages, as a
    chat's pipeline takes them; None when the split leaves a gap."""
    from hearthnet.bench.pipeline import predict_run, predicted_beside_measured

    stages: list[tuple[int, int]] = []
    nxt = 0  # a chat's stages: each host's range from the layer after the previous stage
    for lo, hi in sorted((int(r[0]), int(r[1])) for n in f["coverage"]["nodes"].values()
                         for r in n["layers"]):
        if hi < nxt:
            continue  # wholly inside the stages before it
        if lo > nxt:
            return None  # a gap: no pipeline to predict
        stages.append((nxt, hi))
        nxt = hi + 1
    if nxt != entry.num_layers:
        return None
    from hearthnet.distributed_inference.placement.predict import Sourced

    warm = f.get("warmup_hop")
    hop = None if not warm else Sourced(
        warm["ms"], f"measured on this household before the measured chats: the warm-up "
                    f"chat's per-hop overhead p50, mean of its {warm['stages']} stages")
    pred = predict_run(entry, args, stages, hop)
    stage_hops = [s["overhead_p50_ms"] for s in f["single"].get("stages", {}).values()]
    # the measured chats' hop: the stages' mean, under the key `predicted_beside_measured`
    # reads (bench pipeline's figure there is the largest stage's)
    run = {"distributed": {"tokens_per_second": f["single"]["tokens_per_second"],
                           "hops": {"overhead_p50_ms_max": round(
                               sum(stage_hops) / len(stage_hops), 3) if stage_hops
                               else pred["engine"]["hop_ms"]}},
           "concurrency": f.get("concurrency", [])}
    return predicted_beside_measured(pred, run)


def _specs(args: argparse.Namespace, budgets: list[int]) -> list[NodeSpec]:
    """Every node hosts automatically; the first is the steward and orchestrates."""
    head = head_format(args.weights)
    # the first node is a host too (every machine of the house holds a part), so its
    # pipelines may use its own shard (M26 §7 allow_self_as_shard, §10 "mixed local +
    # distributed")
    di: dict[str, Any] = {"head_weights": head, "speculate": "off",
                          "weights": policy_for(args.weights), "allow_self_as_shard": True,
                          "max_concurrent_pipelines": max(4, *args.concurrency)}
    # one placement per measurement: a move mid-run would change what is measured
    auto = {"rebalance_interval_s": 3600.0}
    return [NodeSpec(f"node-{i + 1}", auto={**auto, "memory_mb": b},
                     trust="steward" if i == 0 else "trusted",
                     extra_host={"weights": args.weights},
                     extra_di=di if i == 0 else {**di, "prepare_heads_at_start": False})
            for i, b in enumerate(budgets)]


@contextlib.contextmanager
def _built(args: argparse.Namespace, entry: Any, budgets: list[int], links: list[Link]
           ) -> Iterator[Household]:
    """A household started and covered (its figures so far); stopped and removed on exit,
    also on an error (which then carries the nodes' logs) or Ctrl-C."""
    specs = _specs(args, budgets)
    ids = [s.node_id for s in specs]
    root = Path(tempfile.mkdtemp(prefix="hearthnet-household-"))
    lan = Lan(links, shaper=args.shaper) if links else None
    try:
        shared = single_model_dir([entry], root)
        dirs = {nid: shared if args.import_on == "all" or i == 0 else _empty(root / nid)
                for i, nid in enumerate(ids)}
        with lan_mesh(specs, lan=lan, root=root, model=args.model, models_dirs=dirs,
                      threads=args.node_threads, what="the household's network") as mesh:
            t0 = time.monotonic()
            mesh.start(wait_cover=False, timeout=1800.0)  # multi-GB models take minutes
            _serve(mesh, ids[0], args.model)
            figures: dict[str, Any] = {"coverage": _coverage(mesh, entry, args, ids, t0)}
            figures["decode_steps"] = mesh.wait_decode_steps()
            yield Household(mesh, ids, figures)
    except HearthNetError as e:  # the same error, with the nodes' logs before they go
        raise error_from_code(e.code, f"{e.message}\n{log_tails(root)}") from e
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _empty(d: Path) -> Path:
    """An empty models folder beside node folder `d` (a store that holds nothing)."""
    d = d.parent / f"{d.name}-models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _serve(mesh: LanMesh, steward: str, model: str) -> None:
    """Put the model on the served-model list through the steward (`hearthnet models serve`
    on its machine)."""
    r = subprocess.run([*mesh.prefix(steward), sys.executable, "-m", "hearthnet.cli", "models",
                        "serve", model, "--config", str(mesh.nodes[steward].config)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise HearthNetError(f"models serve failed: {r.stderr.strip()[-1000:]}")


def stored_layer_bytes(entry: Any, ranges: list[list[int]]) -> int:
    """Bytes of the layers in `ranges` as stored (what a fetch of them moves), from the
    safetensors headers (no tensor is read)."""
    from hearthnet.models.hashing import read_safetensors_header_and_metadata

    want = {i for lo, hi in ranges for i in range(lo, hi + 1)}
    total = 0
    for f in sorted(entry.path.glob("*.safetensors")):
        header, _, _ = read_safetensors_header_and_metadata(f)
        for name, info in header.items():
            m = _LAYER.search(name)
            if m and int(m.group(1)) in want:
                lo, hi = (int(x) for x in info["data_offsets"])  # type: ignore[attr-defined]
                total += hi - lo
    return total


def wait_covered(status: Callable[[], dict[str, Any]], alias: str, model_id: str,
                 timeout: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, settle: float = 3.0
                 ) -> tuple[float | None, dict[str, list[list[int]]]]:
    """Poll `status` (the first node's) until `alias` is covered and the split holds still
    for `settle` s; (seconds until first covered or None, the split)."""
    start = clock()
    first: float | None = None
    split: dict[str, list[list[int]]] = {}
    since = start
    while clock() - start < timeout:
        try:
            st = status()
        except OSError:
            st = {}
        now, new = clock(), split_of(st, model_id)
        if covered(st, alias):
            first = now - start if first is None else first
            if new != split:
                since = now
            elif now - since >= settle:
                return first, new
        else:
            since = now
        split = new
        sleep(0.5)
    return first, split


def _coverage(mesh: LanMesh, entry: Any, args: argparse.Namespace, ids: list[str],
              t0: float) -> dict[str, Any]:
    """Wait for the model to be covered; each node's layers and fetched bytes."""
    from hearthnet.distributed_inference.placement.autohost import layer_bytes

    since_start = time.monotonic() - t0
    first, split = wait_covered(lambda: mesh.status(ids[0]), entry.alias, entry.model_id,
                                float(args.cover_timeout))
    names = (entry.alias, entry.model_id)
    # a node may fetch more layers once the model is covered (automatic hosting adds a
    # second range where its budget allows): its figures count them once they are hosted
    end = time.monotonic() + min(120.0, float(args.cover_timeout))
    while True:
        statuses = {n: _status(mesh, n) for n in ids}
        fetches = {n: fetched_bytes(st, names) for n, st in statuses.items()}
        if first is None or time.monotonic() > end or not any(
                unhosted_fetches(f[1], split.get(n, [])) for n, f in fetches.items() if f):
            break
        time.sleep(1.0)
        split = split_of(_status(mesh, ids[0]), entry.model_id)
    if first is None:
        raise ShardUnavailable(not_covered_message(args.cover_timeout, ids, split, any(
            f is not None for f in fetches.values())))
    per_layer_held = layer_bytes(entry, resolve_format(args.weights, entry.dtype))
    nodes: dict[str, Any] = {}
    for i, n in enumerate(ids):
        ranges = split.get(n, [])
        stored = stored_layer_bytes(entry, ranges)
        got = fetches[n]
        nodes[n] = {"layers": ranges, "layer_count": layer_count(ranges),
                    "imported": args.import_on == "all" or i == 0,
                    "budget_mb": mesh.nodes[n].spec.auto["memory_mb"]  # type: ignore[index]
                    if mesh.nodes[n].spec.auto else None,
                    "layers_held_bytes": layer_count(ranges) * per_layer_held,
                    "layers_stored_bytes": stored,
                    "bytes_fetched": got[0] if got else None,
                    "fetch_ratio": round(got[0] / stored, 3) if got and stored else None,
                    "fetches": got[1] if got else None}
    return {"covered": True, "covered_s": round(since_start + first, 1),
            "serve_to_covered_s": round(first, 1),
            "fetch_reported": any(f is not None for f in fetches.values()), "nodes": nodes}


def _status(mesh: LanMesh, node_id: str) -> dict[str, Any]:
    try:
        return mesh.status(node_id)
    except OSError:
        return {}


async def _chat(uri: str, a: argparse.Namespace, tokens: int,
                on_token: Callable[[list[tuple[float, dict[str, Any]]]], Any] | None = None,
                ends: tuple[str, ...] = ("done",)
                ) -> tuple[float, list[tuple[float, dict[str, Any]]]]:
    """One greedy chat through `uri`: (its start, its frames with their arrival times).
    `on_token(frames)` is awaited after each token (the frames so far); a last frame of a
    type not in `ends` raises."""
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    call = chat_args(a.prompt, a.model, SamplingParams(max_tokens=tokens), wire_dtype=a.wire)
    frames: list[tuple[float, dict[str, Any]]] = []
    t0 = time.perf_counter()
    async for f in bus_call(uri, CHAT_CAPABILITY, call):
        frames.append((time.perf_counter(), f))
        if on_token is not None and f.get("type") == "token_delta":
            await on_token(frames)
    if not frames or frames[-1][1].get("type") not in ends:
        raise HearthNetError(f"the chat did not finish: {[f for _, f in frames[-1:]]}")
    return t0, frames


def _tokens(frames: list[tuple[float, dict[str, Any]]]) -> list[int]:
    return [int(f["token_id"]) for _, f in frames if f.get("type") == "token_delta"]


def _distributed(frames: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """The `done` frame of a chat that ran through the mesh to its end.

    Raises:
        HearthNetError: it fell back to the first node's local engine (with the reason).
    """
    done = frames[-1][1]
    if done.get("fallback"):  # the local engine's figure is not the household's
        why = next((f.get("reason") for _, f in frames if f.get("type") in (
            "pipeline_aborted", "shard_failover")), "?")
        raise HearthNetError(f"the chat fell back to the first node's local engine "
                             f"({why}): no household figure to report")
    return done


async def _single(uri: str, a: argparse.Namespace) -> tuple[dict[str, Any], list[int]]:
    """One measured chat: its figures and token ids."""
    t0, frames = await _chat(uri, a, a.tokens)
    done = _distributed(frames)
    first = next(t for t, f in frames if f.get("type") == "token_delta")
    ids = _tokens(frames)
    return {"tokens_per_second": float(done["timings"]["tokens_per_second"]),
            "first_token_ms": float(done["timings"]["first_token_ms"]),
            "client_first_token_ms": (first - t0) * 1000, "completion_tokens": len(ids),
            "stages": {sid: {k: s[k] for k in ("layers", "p50_ms", "overhead_p50_ms")}
                       for sid, s in done["timings"].get("per_shard", {}).items()}}, ids


async def _measure(built: list[Household], a: argparse.Namespace) -> list[dict[str, Any]]:
    """Single chats (alternating between the households), then each household's
    concurrency levels and its kill; each household's figures."""
    for h in built:  # warm-up; its hops are the plan's measured hop cost (M26 §10)
        h.figures["warmup_hop"] = warmup_hop(_distributed((await _chat(h.uri, a, 8))[1]))
    runs: list[list[dict[str, Any]]] = [[] for _ in built]
    reference: list[list[int]] = [[] for _ in built]
    for _ in range(a.runs):
        for k, h in enumerate(built):
            fig, reference[k] = await _single(h.uri, a)
            runs[k].append(fig)
    a.level_prompts = list(PROMPTS)
    for k, h in enumerate(built):
        h.figures["single"] = summary(runs[k])
        h.figures.update(await concurrency.measure(
            h.uri, a, h.scrape))
        h.figures["kill"] = await _killed(h.mesh, h.ids, a, reference[k])
    return [h.figures for h in built]


async def _killed(mesh: LanMesh, ids: list[str], a: argparse.Namespace,
                  reference: list[int]) -> dict[str, Any]:
    """A chat during which a node other than the first dies (see the module docstring)."""
    kill: dict[str, Any] = {}

    async def on_token(frames: list[tuple[float, dict[str, Any]]]) -> None:
        if len(_tokens(frames)) == a.kill_after:
            victim = _victim(frames, ids)
            kill.update(node=victim, t=time.perf_counter())
            await asyncio.to_thread(mesh.kill, victim)

    # a household whose remaining nodes cannot hold the killed one's layers ends the
    # answer with an error after the tokens it gave (M26 §5.4), never silently
    t0, frames = await _chat(mesh.nodes[ids[0]].uri, a, a.tokens, on_token,
                             ends=("done", "error"))
    if not kill:
        raise HearthNetError("the chat ended before the kill")
    kinds = [f.get("type") for _, f in frames]
    after = next((t for t, f in frames if t > kill["t"] and f.get("type") == "token_delta"),
                 None)
    done = frames[-1][1]
    got = _tokens(frames)
    how = "local fallback" if done.get("fallback") else (
        "failover" if "shard_failover" in kinds else "no stage lost")
    if done.get("type") == "error":  # no live node holds the killed one's layers
        how = f"ended with an error: {done.get('code')}"
    return {"node": kill["node"], "completed": done.get("type") == "done",
            "completion_tokens": len(got),
            "tokens_identical": got == reference[:len(got)] if done.get("type") == "error"
            else got == reference,
            "how": how, "wall_ms": round((frames[-1][0] - t0) * 1000, 1),
            "kill_to_next_token_ms": round((after - kill["t"]) * 1000, 1) if after else None,
            "pipeline_after": done.get("pipeline"),
            "error": str(done.get("message"))[:2000] if done.get("type") == "error" else None,
            "frames": {k: kinds.count(k) for k in sorted({str(x) for x in kinds})}}


def _victim(frames: list[tuple[float, dict[str, Any]]], ids: list[str]) -> str:
    """The host of the call's last stage that is not the first node (else the last node)."""
    stages = [f for _, f in frames if f.get("type") == "shard_status"
              and f.get("status") == "ok"]
    for f in sorted(stages, key=lambda f: f["layers"][0], reverse=True):
        host = str(f["shard_id"]).rsplit("@", 1)[-1]
        if host in ids[1:]:
            return host
    return ids[-1]


# ---- the report --------------------------------------------------------------------------


def _mb(x: int | None) -> str:
    return "-" if x is None else f"{x / _MIB:.1f}"


def _one_report(f: dict[str, Any], label: str) -> list[str]:
    cov = f["coverage"]
    rows = [[n, " ".join(f"{lo}-{hi}" for lo, hi in v["layers"]) or "nothing",
             v["layer_count"], v["budget_mb"], "yes" if v["imported"] else "no",
             _mb(v["layers_stored_bytes"]), _mb(v["bytes_fetched"]), v["fetch_ratio"]]
            for n, v in cov["nodes"].items()]
    s, k = f["single"], f["kill"]
    lines = [f"{label}: covered in {cov['covered_s']} s from the nodes' start "
             f"({cov['serve_to_covered_s']} s after serving)"
             + ("" if cov["fetch_reported"] else "; no node reports fetches"),
             table(["node", "layers", "count", "budget MiB", "imported", "layers MiB stored",
                    "fetched MiB", "fetched / layers"], rows),
             f"single chat: {s['tokens_per_second']} tok/s (runs {s['tokens_per_second_runs']}),"
             f" first token {s['first_token_ms']} ms (client {s['client_first_token_ms']} ms)",
             concurrency.report(f["concurrency"], f["concurrency_goals"]),
             f"{k['node']} killed after the kill-after token: chat "
             f"{'completed' if k['completed'] else 'did not complete'} ({k['how']}), "
             f"{k['completion_tokens']} tokens, identical to the unkilled answer"
             f"{'' if k['completed'] else ' as far as it went'}: "
             f"{k['tokens_identical']}, {k['wall_ms']} ms, kill → next token "
             f"{k['kill_to_next_token_ms']} ms"
             + (f"\n  the error: {k['error']}" if k.get("error") else "")]
    return lines


def report(f: dict[str, Any]) -> str:
    """The human-readable report of a `run` result."""
    link = f["link"]
    net = (f"{link['profile']} links ({', '.join(lk['name'] for lk in link['links'])}"
           f"{'; ' + link['shaper_note'] if link.get('shaper_note') else ''})"
           if link["applied"] else "the loopback" +
           (f" (--profile {link['profile']} not applied: {link['why_not']})"
            if link["why_not"] else ""))
    lines = [f"bench household: {f['model_id']} on {f['nodes']} nodes over {net}, import on "
             f"{f['import_on']}, budgets {f['budgets_mb']} MiB "
             f"({f['budget_fraction_of_layers']} of the layers as held), weights "
             f"{f['settings']['weights']}, {f['tokens']} tokens, median of {f['runs']}"]
    lines += _one_report(f, "household")
    if "loopback" in f:
        lines += _one_report(f["loopback"], "the same on the loopback")
        lines.append(f"single-chat tok/s / loopback's: {f['ratio_to_loopback']}" + (
            "" if link["applied"] else " (both on the loopback: the profile was not "
            "applied, so this ratio shows only the machine's noise)"))
    if f.get("prediction"):
        lines.append(prediction_report(f["prediction"]))
        lines += stage_lines(f["prediction"], f["single"].get("stages", {}))
    lines.append(f"goals ({f['goals_source']}): " + ", ".join(
        f"{k} {g['measured']} ({'met' if g['met'] else 'MISSED'}, goal {g['goal']})"
        for k, g in f["goals"].items()))
    lines.append(f"written to {f['results_file']}")
    return "\n".join(lines)
