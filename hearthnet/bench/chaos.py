"""`hearthnet bench chaos`: fault scenarios against real node processes (M26 §5.4, §8.2).

Each scenario starts a small fresh mesh of SmolLM2 (`LocalMesh`, separate processes on
127.0.0.1): node-a orchestrates, node-b hosts layers 0–14, node-c and node-d both host
15–29 (each the other's spare), plus what the scenario needs. It runs ``--chats`` greedy
answers of ``--tokens`` tokens with one fault among them:

1. ``kill`` — kill -9 of the last-stage host after ``--kill-after`` tokens; the spare
   covers its range;
2. ``stall`` — SIGSTOP of that host instead (failover after the call's step deadline,
   ``--step-timeout``); SIGCONT once the answer ended;
3. ``restart`` — kill -9 of that host, then a restart of it;
4. ``int8`` — node-d restarted holding int8 weights; in the last answer the lossless
   host of 15–29 (node-c) is killed, so the int8 shard is the only one left there: calls
   of the default policy (lossless) must fall back rather than use it. One more call with
   ``weights=int8`` (not counted) shows the int8 shard does serve when a call accepts it;
5. ``partition`` — a relay node-r is every node's configured gossip peer (LocalMesh links
   each node to the first one) and node-a keeps only that link (``min_gossip_links = 1``);
   node-r is stopped for 2.5 × the health timeout, then resumed; answers during the
   partition and after (repair links may heal it before the resume: that is reported);
6. ``flood`` — another orchestrator, node-f, opens ``--flood`` chats at once while the
   hosts allow 2 streams each; node-a's single chat (another member's) must still finish;
7. ``orchestrator`` — kill -9 of node-a mid-answer while a second orchestrator, node-g,
   answers; then more answers through node-g, a restart of node-a and one answer through
   it. node-b is the gossip hub here, so node-a's death cuts no gossip link.

Figures per scenario: answers started, completed (ended with `done`), lost (an answer
whose tokens differ from the reference — the local engine's greedy answer, computed once
in this process with no fault — or that ended without `done`; the tokens past the common
prefix are ``lost_tokens``), wrong-format uses (a `shard_status` or the `done` frame's
``formats.stages`` naming a weight format the call's ``weights`` policy does not accept),
fallbacks to the orchestrator's local engine, failovers, hangs (an answer that did not end
within ``HANG_S``), fault → next token, and re-cover time: seconds from the fault — or from
the restart (the process's start, its own start-up time included), or from SIGCONT — until
node-a's status (``/status``: ``models[i].fully_covered``) shows the model fully
covered *and* agrees with what was done: a killed host's shards no longer counted, a
restarted or resumed host's shard back (in the format it now holds).

Goals: 0 lost (in ``orchestrator``: outside the answers whose own orchestrator was
killed, which must end — with an error or a lost connection — rather than hang), 0
wrong-format, and re-cover ≤ 10 s wherever a node was restarted or resumed (``stall``,
``restart``, ``int8``, ``partition``, ``orchestrator``; ``kill`` reports its re-cover
without a goal). A scenario that cannot be set up is ``skipped`` with the reason; one that
fails is ``error``: neither counts as a met goal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hearthnet.argtypes import at_least, number_in, positive
from hearthnet.bench import PROMPTS, machine, single_model_dir, table, write_results
from hearthnet.distributed_inference.directory.formats import DEFAULT_POLICY, accepts
from hearthnet.errors import BadRequest, HearthNetError

GOAL_LOST = 0
GOAL_WRONG_FORMAT = 0
GOAL_RECOVER_S = 10.0
HANG_S = 90.0  # an answer still open after this long is a hang, not a slow answer
RECOVER_WAIT_S = 60.0  # no re-cover within this long: reported as never (goal missed)
POLL_S = 0.1  # status polls while waiting on state
FLOOD_STREAMS = 2  # every host's max_concurrent_streams in `flood`: the flood fills them
FLOOD_STEP_TIMEOUT_S = 30.0  # `flood` calls wait for busy slots this long (the default)

# hosts hold fp32 whatever the store keeps (a GGUF's Q4 blocks would be held as int4 by
# default, whose kernel rounds activations): the reference answer and node-a's local
# fallback are fp32, so any difference is a fault's doing. No decode step is compiled: a
# compile takes 30-70 s of both cores, and the chaos figures are about faults, not speed
_HOST = {"weights": "fp32", "compile_decode": False}
# a pure host orchestrates nothing here: no head loaded at start (less memory, faster start)
_HOST_DI = {"prepare_heads_at_start": False}


class Skip(Exception):
    """The scenario cannot be set up on this machine or build; the message says why."""


@dataclass
class Answer:
    """One chat as the client saw it."""

    node: str
    prompt: int  # index into PROMPTS
    frames: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each frame
    started: float = 0.0
    ended: float = 0.0
    error: str | None = None
    hung: bool = False
    orphaned: bool = False  # its own orchestrator was killed on purpose
    policy: str | None = None  # the call's `weights`; None: the node's default
    fault_at: float | None = None  # when a fault was injected during this answer
    counted: bool = True  # False: a control call outside the scenario's counts

    @property
    def done(self) -> dict[str, Any] | None:
        last = self.frames[-1] if self.frames else None
        return last if last is not None and last.get("type") == "done" else None

    def tokens(self) -> list[int]:
        return [int(f["token_id"]) for f in self.frames if f.get("type") == "token_delta"]


_SECONDS = number_in(0, 600, "seconds")  # a bad one is a usage error before any node starts


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench chaos`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store")
    p.add_argument("--scenarios", nargs="+", type=_scenario_name, metavar="NAME",
                   default=list(SCENARIOS),
                   help=f"scenarios to run, by name or number (default all: "
                        f"{' '.join(SCENARIOS)})")
    p.add_argument("--chats", type=positive, default=3,
                   help="answers per scenario, the faulted one included (default 3)")
    p.add_argument("--tokens", type=at_least(8), default=16,
                   help="greedy tokens per answer (default 16)")
    p.add_argument("--kill-after", type=positive, default=5,
                   help="the fault comes after this many tokens reached the client")
    p.add_argument("--flood", type=positive, default=6,
                   help="chats node-f opens at once in `flood` (default 6)")
    p.add_argument("--health-timeout", type=_SECONDS, default=6.0,
                   help="the nodes' shard_health_timeout_seconds (default 6)")
    p.add_argument("--step-timeout", type=_SECONDS, default=3.0,
                   help="the calls' per-step deadline, params.timeout_s (default 3)")
    p.add_argument("--node-threads", type=positive, default=1, help="torch threads per node")
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for chaos.json (default bench-results)")


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Run the chosen scenarios, each on its own mesh; returns (figures, report)."""
    from hearthnet.models import ModelStore

    if args.kill_after > args.tokens - 4:
        raise BadRequest("--kill-after must leave at least 4 tokens of the answer after it")
    entry = ModelStore().get(args.model)
    names = list(dict.fromkeys(args.scenarios))  # once each, in the order given
    refs = _references(entry, args.tokens, _prompts_needed(args), args.node_threads)
    figures: dict[str, Any] = {
        "benchmark": "chaos", "model": args.model, "model_id": entry.model_id,
        "tokens": args.tokens, "chats": args.chats, "machine": machine(),
        "settings": {"kill_after_tokens": args.kill_after, "flood": args.flood,
                     "health_timeout_s": args.health_timeout,
                     "step_timeout_s": args.step_timeout, "node_torch_threads": args.node_threads,
                     "sampling": "greedy", "wire_dtype": "auto (fp32)",
                     "hosts_hold": "fp32", "hang_s": HANG_S, "recover_wait_s": RECOVER_WAIT_S,
                     "reference": "local engine in the bench process, no fault"},
        "goals": {"lost": GOAL_LOST, "wrong_format": GOAL_WRONG_FORMAT,
                  "recover_s_max": GOAL_RECOVER_S},
        "scenarios": {}}
    for name in names:
        figures["scenarios"][name] = _scenario(SCENARIOS[name], entry, refs, args)
    figures["summary"] = _summary(figures["scenarios"])
    figures["results_file"] = str(write_results("chaos", figures, Path(args.results_dir)))
    return figures, report(figures)


def _prompts_needed(a: argparse.Namespace) -> int:
    return min(len(PROMPTS), max(int(a.chats), int(a.flood), 2))


def _references(entry: Any, tokens: int, n: int, threads: int) -> list[list[int]]:
    """The local engine's greedy answer to each of the first `n` prompts (no fault), on
    the nodes' torch thread count: on a busy 2-core machine two threads waited for each
    other and took 3× as long as one."""
    import torch

    from hearthnet.distributed_inference.engine.local import LocalEngine
    from hearthnet.distributed_inference.engine.sampling import SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = LocalEngine(entry, compile_decode=False)
        return [[e.token_id for e in engine.generate([{"role": "user", "content": p}],
                                                     SamplingParams(max_tokens=tokens))]
                for p in PROMPTS[:n]]
    finally:
        torch.set_num_threads(before)


# ---- one scenario ----

@dataclass(frozen=True)
class Scenario:
    """A fault scenario: its mesh and what it does to it."""

    index: int
    title: str
    specs: Callable[[], list[Any]]  # the mesh's NodeSpecs, freshly made
    act: Callable[[Run], Coroutine[Any, Any, None]]
    recover_goal: bool = True  # a node is restarted or resumed: re-cover ≤ GOAL_RECOVER_S


class Run:
    """A scenario's mesh, its answers and its timeline, while it runs."""

    def __init__(self, mesh: Any, args: argparse.Namespace, refs: list[list[int]],
                 entry: Any) -> None:
        self.mesh, self.a, self.refs, self.entry = mesh, args, refs, entry
        self.answers: list[Answer] = []
        self.timeline: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}
        self.recover_s: float | None = None
        self.recover_from: str | None = None
        self.stopped: set[str] = set()
        self.t0 = time.monotonic()

    def event(self, what: str) -> float:
        t = time.monotonic()
        self.timeline.append({"t_s": round(t - self.t0, 2), "what": what})
        return t

    # -- answers --

    async def chat(self, node: str, prompt: int,
                   on_token: Callable[[int, Answer], None] | None = None, *,
                   orphaned: bool = False, counted: bool = True, **params: Any) -> Answer:
        """One greedy answer through `node`; never raises: an error or a hang is recorded."""
        from hearthnet.distributed_inference.engine.sampling import SamplingParams
        from hearthnet.mesh.bus import bus_call
        from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

        params.setdefault("timeout_s", self.a.step_timeout)
        ans = Answer(node, prompt % len(self.refs), orphaned=orphaned, counted=counted,
                     policy=params.get("weights"))
        self.answers.append(ans)
        args = chat_args(PROMPTS[ans.prompt], self.a.model,
                         SamplingParams(max_tokens=self.a.tokens), **params)
        ans.started = time.monotonic()
        n = 0
        try:
            async with asyncio.timeout(HANG_S):
                async for f in bus_call(self.mesh.nodes[node].uri, CHAT_CAPABILITY, args):
                    ans.frames.append(f)
                    ans.arrivals.append(time.monotonic())
                    if f.get("type") == "token_delta":
                        n += 1
                        if on_token is not None:
                            on_token(n, ans)
        except TimeoutError:
            ans.hung, ans.error = True, f"no end within {HANG_S:g} s"
        except HearthNetError as e:
            ans.error = f"{e.code}: {e.message}"
        ans.ended = time.monotonic()
        if ans.error is None and ans.done is None and ans.frames:
            last = ans.frames[-1]
            ans.error = f"{last.get('code', last.get('type'))}: {last.get('message', '')}"
        return ans

    def kill_last_stage_at(self, n_tokens: int, sig: int, hits: dict[str, Any]
                           ) -> Callable[[int, Answer], None]:
        """An `on_token` that sends `sig` to the host of the last layer after `n_tokens`
        (SIGKILL: the whole process group dies; SIGSTOP: it stalls); fills `hits`."""
        last = self.entry.num_layers - 1

        def on_token(n: int, ans: Answer) -> None:
            if n != n_tokens or "host" in hits:
                return
            try:
                host = host_of_layer(ans.frames, last)
            except HearthNetError as e:  # no fault then: the scenario says so, the answer counts
                self.notes.append(f"no fault injected: {e}")
                hits["host"] = None
                return
            hits["host"] = host
            hits["t"] = ans.fault_at = self.signal(host, sig)

        return on_token

    # -- faults --

    def signal(self, node: str, sig: int) -> float:
        """Send `sig` to `node`'s process group; returns when (monotonic)."""
        name = signal.Signals(sig).name
        if sig == signal.SIGKILL or sig == signal.SIGTERM:
            t = self.event(f"{name} {node}")
            self.mesh.kill(node, sig)  # waits for the exit
            self.stopped.discard(node)
            return t
        proc = self.mesh.nodes[node].proc
        os.killpg(proc.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(node)
        elif sig == signal.SIGCONT:
            self.stopped.discard(node)
        return self.event(f"{name} {node}")

    def resume_all(self) -> None:
        """SIGCONT every node still stopped (a stopped node ignores the mesh's SIGTERM)."""
        for node in list(self.stopped):
            with contextlib.suppress(OSError):
                self.signal(node, signal.SIGCONT)

    async def restart(self, node: str) -> float:
        """Start `node` again (until its `node_ready` line); returns when it was started
        (monotonic): a re-cover counts from there, the process's own start included."""
        t = self.event(f"start {node}")
        await asyncio.to_thread(self.mesh.start_node, node)
        ready = self.event(f"{node} ready")
        self.extra.setdefault("start_to_ready_s", {})[node] = round(ready - t, 2)
        return t

    # -- state --

    async def status(self, node: str) -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(self.mesh.status, node)
        except (OSError, ValueError):
            return None

    async def wait_view(self, pred: Callable[[dict[str, Any]], bool], since: float,
                        timeout: float = RECOVER_WAIT_S) -> float | None:
        """Seconds from `since` until node-a's status satisfies `pred` (None: never within
        `timeout` of now)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = await self.status("node-a")
            if st is not None and pred(st):
                return round(time.monotonic() - since, 2)
            await asyncio.sleep(POLL_S)
        return None

    def recovered(self, seconds: float | None, since: str) -> None:
        self.recover_s, self.recover_from = seconds, since
        if since == "restart" and seconds is not None:  # the part after the node was ready
            up = sum(self.extra.get("start_to_ready_s", {}).values())
            self.extra["ready_to_recovered_s"] = round(max(0.0, seconds - up), 2)
        self.event(f"re-covered after {seconds} s (from {since})" if seconds is not None
                   else f"not re-covered within {RECOVER_WAIT_S:g} s (from {since})")


def host_of_layer(frames: list[dict[str, Any]], layer: int) -> str:
    """The host serving `layer` as the call last announced it (its `shard_status` ok frames)."""
    for f in reversed(frames):
        lay = f.get("layers")
        if f.get("type") == "shard_status" and f.get("status") == "ok" and lay \
                and lay[0] <= layer <= lay[1]:
            return str(f["shard_id"]).rsplit("@", 1)[-1]
    raise HearthNetError(f"no shard_status names the host of layer {layer}")


def coverage(st: dict[str, Any], alias: str
             ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]], set[str]]:
    """(the model's status row, {host: its shard of the model}, hosts counted as covering)."""
    m = next((m for m in st.get("models", []) if m.get("alias") == alias), None)
    if m is None:
        return None, {}, set()
    shards = {s["host"]: s for s in st.get("shards", []) if s.get("model_id") == m["model_id"]}
    covering = {h for row in m.get("coverage", []) for h in row.get("hosts", [])}
    return m, shards, covering


def covered_view(alias: str, gone: frozenset[str] | set[str] = frozenset(),
                 back: dict[str, str | None] | None = None) -> Callable[[dict[str, Any]], bool]:
    """A status predicate: the model fully covered, no host of `gone` counted as covering,
    and each host of `back` with a shard not offline — in the format given (a format the
    status says it holds), else counted as covering."""
    def pred(st: dict[str, Any]) -> bool:
        m, shards, covering = coverage(st, alias)
        if m is None or not m.get("fully_covered") or gone & covering:
            return False
        for host, fmt in (back or {}).items():
            s = shards.get(host)
            if s is None or s.get("state") == "offline":
                return False
            if fmt is None and host not in covering:
                return False
            if fmt is not None and s.get("format") != fmt:
                return False
        return True

    return pred


def _scenario(sc: Scenario, entry: Any, refs: list[list[int]],
              a: argparse.Namespace) -> dict[str, Any]:
    from hearthnet.mesh.launcher import LocalMesh

    out: dict[str, Any] = {"index": sc.index, "title": sc.title, "status": "ran",
                           "reason": None}
    root = Path(tempfile.mkdtemp(prefix="hearthnet-chaos-"))
    t0 = time.monotonic()
    r: Run | None = None
    try:
        specs = sc.specs()
        out["nodes"] = {s.node_id: [list(r) for r in s.shards] for s in specs}
        with LocalMesh(specs, root=root, model=a.model, threads=a.node_threads,
                       timeout_s=a.health_timeout, models=single_model_dir(entry, root)
                       ) as mesh:
            r = Run(mesh, a, refs, entry)
            r.event("mesh ready")
            try:
                for o in _orchestrators(specs):
                    mesh.wait_covered(o, timeout=RECOVER_WAIT_S)
                asyncio.run(sc.act(r))
            finally:
                r.resume_all()
    except Skip as e:
        out.update(status="skipped", reason=str(e))
    except Exception as e:  # a scenario that broke is reported, never a pass
        out.update(status="error", reason=f"{type(e).__name__}: {e}")
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if r is not None:
        out.update(_counts(r, entry))
        out.update(timeline=r.timeline, notes=r.notes, **r.extra)
    if out["status"] == "error" or any(x["error"] and not x["orphaned"]
                                       for x in out.get("answers", [])):
        out["logs"] = _keep_logs(root, Path(a.results_dir) / "chaos-logs" / sc_name(sc))
    shutil.rmtree(root, ignore_errors=True)
    out["goals"] = _goals(out, sc)
    return out


def sc_name(sc: Scenario) -> str:
    return next(n for n, s in SCENARIOS.items() if s is sc)


def _keep_logs(root: Path, to: Path) -> str:
    """Copy the nodes' logs of a scenario that went wrong out of its temporary folder (an
    `internal` error's cause is only there); returns the folder."""
    shutil.rmtree(to, ignore_errors=True)
    to.mkdir(parents=True)
    for log in root.glob("*.log"):
        shutil.copy2(log, to / log.name)
    return str(to)


def _orchestrators(specs: list[Any]) -> list[str]:
    return [s.node_id for s in specs if not s.shards and s.node_id != "node-r"]


def _counts(r: Run, entry: Any) -> dict[str, Any]:
    from hearthnet.distributed_inference.directory.formats import lossless_of

    lossless = lossless_of(entry)
    rows = [judge(x, r.refs[x.prompt], lossless) for x in r.answers]
    counted = [row for row in rows if row["counted"]]
    gaps = [row["fault_to_next_token_s"] for row in counted
            if row["fault_to_next_token_s"] is not None]
    return {"started": len(counted), "completed": sum(row["completed"] for row in counted),
            "lost": sum(row["lost"] for row in counted),
            "lost_tokens": sum(row["lost_tokens"] for row in counted),
            "lost_orphaned": sum(row["lost"] and row["orphaned"] for row in counted),
            "wrong_format": sum(bool(row["wrong_format"]) for row in counted),
            "fallbacks": sum(row["fallback"] for row in counted),
            "failovers": sum(row["failovers"] for row in counted),
            "hangs": sum(row["hung"] for row in counted),
            "fault_to_next_token_s": max(gaps) if gaps else None,
            "recover_s": r.recover_s, "recover_from": r.recover_from,
            "answers": rows}


def judge(x: Answer, ref: list[int], lossless: frozenset[str]) -> dict[str, Any]:
    """One answer against its reference: completed, lost (and how many tokens), the
    weight formats it used that its policy does not accept."""
    toks = x.tokens()
    done = x.done
    same = done is not None and toks == ref
    prefix = next((i for i, (p, q) in enumerate(zip(toks, ref, strict=False)) if p != q),
                  min(len(toks), len(ref)))
    after = [t for t, f in zip(x.arrivals, x.frames, strict=True)
             if f.get("type") == "token_delta" and x.fault_at is not None and t > x.fault_at]
    first = next((t for t, f in zip(x.arrivals, x.frames, strict=True)
                  if f.get("type") == "token_delta"), None)
    formats = (done or {}).get("formats") or {}
    return {"node": x.node, "prompt": x.prompt, "counted": x.counted,
            "completed": done is not None, "lost": not same,
            "lost_tokens": 0 if same else len(ref) - prefix, "tokens": len(toks),
            "wrong_format": wrong_formats(x, lossless), "fallback": bool((done or {}).get(
                "fallback")), "failovers": int((done or {}).get("failovers") or 0),
            "error": x.error, "hung": x.hung, "orphaned": x.orphaned,
            "policy": x.policy or DEFAULT_POLICY, "wall_s": round(x.ended - x.started, 2),
            "first_token_s": round(first - x.started, 2) if first is not None else None,
            "construction_ms": ((done or {}).get("timings") or {}).get("construction_ms"),
            "fault_to_next_token_s": round(after[0] - x.fault_at, 2)
            if after and x.fault_at is not None else None,
            "pipeline": (done or {}).get("pipeline"), "formats": formats or None}


def wrong_formats(x: Answer, lossless: frozenset[str]) -> list[str]:
    """The stage formats of `x` (its ok `shard_status` frames and its `done`'s
    ``formats.stages``) that its ``weights`` policy does not accept."""
    policy = x.policy or DEFAULT_POLICY
    done = x.done or {}
    own = str((done.get("formats") or {}).get("head") or "fp32")
    used = [str(f["weights_format"]) for f in x.frames if f.get("type") == "shard_status"
            and f.get("status") == "ok" and f.get("weights_format")]
    used += [str(s) for s in (done.get("formats") or {}).get("stages", [])]
    return sorted({f for f in used if not accepts(policy, f, own, lossless)})


def _goals(out: dict[str, Any], sc: Scenario) -> dict[str, Any]:
    if out["status"] != "ran":
        return {}
    lost = out["lost"] - out["lost_orphaned"]
    goals: dict[str, Any] = {
        "lost": {"measured": lost, "goal": GOAL_LOST, "met": lost <= GOAL_LOST},
        "wrong_format": {"measured": out["wrong_format"], "goal": GOAL_WRONG_FORMAT,
                         "met": out["wrong_format"] <= GOAL_WRONG_FORMAT},
        "hangs": {"measured": out["hangs"], "goal": 0, "met": out["hangs"] == 0}}
    if sc.recover_goal:
        rs = out["recover_s"]
        goals["recover_s"] = {"measured": rs, "goal": GOAL_RECOVER_S,
                              "met": rs is not None and rs <= GOAL_RECOVER_S}
    return goals


def _summary(scenarios: dict[str, Any]) -> dict[str, Any]:
    met: dict[str, list[str]] = {}
    missed: dict[str, list[str]] = {}
    for name, s in scenarios.items():
        for g, v in s["goals"].items():
            (met if v["met"] else missed).setdefault(g, []).append(name)
    not_run = {n: f"{s['status']}: {s['reason']}" for n, s in scenarios.items()
               if s["status"] != "ran"}
    return {"all_goals_met": not missed and not not_run, "met": met, "missed": missed,
            "not_run": not_run}


# ---- the scenarios ----

def _base(**extra: Any) -> list[Any]:
    """node-a, node-b 0–14, node-c and node-d 15–29 (each the other's spare)."""
    from hearthnet.mesh.launcher import NodeSpec

    def host(node_id: str, lo: int, hi: int) -> Any:
        return NodeSpec(node_id, [(lo, hi)], extra_host=dict(_HOST), extra_di=dict(_HOST_DI),
                        **extra)

    return [NodeSpec("node-a"), host("node-b", 0, 14), host("node-c", 15, 29),
            host("node-d", 15, 29)]


def _relay_first() -> list[Any]:
    import dataclasses

    from hearthnet.mesh.launcher import NodeSpec

    if "extra_node" not in {f.name for f in dataclasses.fields(NodeSpec)}:
        raise Skip("LocalMesh cannot set [node] min_gossip_links: node-a would link to the "
                   "hosts directly and no relay would be the only one")
    # LocalMesh links every node to the first one, node-r; node-a keeps that one link
    # (by default it would also dial a host, and no single relay would stand between them)
    a, *hosts = _base()
    a.extra_node = {"min_gossip_links": 1}
    return [NodeSpec("node-r", extra_di=dict(_HOST_DI)), a, *hosts]


def _flood_mesh() -> list[Any]:
    from hearthnet.mesh.launcher import NodeSpec

    a, *hosts = _base(max_streams=FLOOD_STREAMS)
    return [a, NodeSpec("node-f"), *hosts]


def _two_orchestrators() -> list[Any]:
    from hearthnet.mesh.launcher import NodeSpec

    a, b, c, d = _base()
    return [b, a, NodeSpec("node-g"), c, d]  # node-b first: the gossip hub is not killed


async def _after(r: Run, node: str, first: int) -> None:
    """The scenario's remaining answers, one after another, through `node`."""
    for i in range(first, r.a.chats):
        await r.chat(node, i)


def _faulted(hits: dict[str, Any]) -> str:
    """The host the fault hit; raises when there was none."""
    if not hits.get("host"):
        raise HearthNetError("no fault was injected: the answer ended before it, or its "
                             "last stage's host was not named")
    return str(hits["host"])


async def _kill_watched(r: Run) -> tuple[str, float | None]:
    """The first answer with kill -9 of its last-stage host mid-answer, while node-a's
    status is watched from the kill on (not from the answer's end): (the host, seconds
    until node-a no longer counts it and the model is covered)."""
    hits: dict[str, Any] = {}
    chat = asyncio.create_task(
        r.chat("node-a", 0, r.kill_last_stage_at(r.a.kill_after, signal.SIGKILL, hits)))
    while "host" not in hits and not chat.done():
        await asyncio.sleep(POLL_S / 2)
    seen = None
    if hits.get("host"):
        seen = await r.wait_view(covered_view(r.a.model, gone={hits["host"]}), hits["t"])
    await chat
    return _faulted(hits), seen


async def _kill(r: Run) -> None:
    _, seen = await _kill_watched(r)
    r.recovered(seen, "kill")
    await _after(r, "node-a", 1)


async def _stall(r: Run) -> None:
    hits: dict[str, Any] = {}
    await r.chat("node-a", 0, r.kill_last_stage_at(r.a.kill_after, signal.SIGSTOP, hits))
    _faulted(hits)
    r.extra["stopped_s"] = round(time.monotonic() - hits["t"], 2)
    _, shards, _ = coverage(await r.status("node-a") or {}, r.a.model)
    r.extra["stalled_host_state_before_sigcont"] = shards.get(hits["host"], {}).get("state")
    t = r.signal(hits["host"], signal.SIGCONT)
    r.recovered(await r.wait_view(covered_view(r.a.model, back={hits["host"]: None}), t),
                "SIGCONT")
    await _after(r, "node-a", 1)


async def _restart(r: Run) -> None:
    victim, r.extra["detect_s"] = await _kill_watched(r)
    started = await r.restart(victim)
    r.recovered(await r.wait_view(covered_view(r.a.model, back={victim: None}), started),
                "restart")
    await _after(r, "node-a", 1)


async def _int8(r: Run) -> None:
    victim, lossless_host = "node-d", "node-c"
    r.signal(victim, signal.SIGTERM)  # an operator's restart: it withdraws its shard
    set_host_weights(r.mesh.nodes[victim].config, "int8")
    try:
        started = await r.restart(victim)
    except HearthNetError as e:
        raise Skip(f"{victim} did not start holding int8 weights: {e}") from e
    r.recovered(await r.wait_view(covered_view(r.a.model, back={victim: "int8"}), started),
                "restart")
    for i in range(r.a.chats - 1):
        await r.chat("node-a", i)
    hits: dict[str, Any] = {}
    last = r.a.chats - 1
    await r.chat("node-a", last, r.kill_last_stage_at(r.a.kill_after, signal.SIGKILL, hits))
    if hits.get("host") != lossless_host:
        r.notes.append(f"the last answer's last stage was on {hits.get('host')}, not "
                       f"{lossless_host}: the int8 shard was not the only one left")
    control = await r.chat("node-a", 0, counted=False, weights="int8")
    stages = ((control.done or {}).get("formats") or {}).get("stages")
    r.extra["control_weights_int8"] = {"completed": control.done is not None,
                                       "stages": stages, "error": control.error,
                                       "used_int8": bool(stages and "int8" in stages)}


def set_host_weights(config: Path, fmt: str) -> None:
    """Make the node of `config` hold its layers as `fmt` from its next start (its
    ``[research.distributed_inference.host] weights``)."""
    header = "[research.distributed_inference.host]"
    head, sep, rest = config.read_text().partition(header + "\n")
    if not sep:
        raise Skip(f"{config.name} has no {header} table to set the weights in")
    table_, nxt, tail = rest.partition("\n[")  # the host table ends at the next table
    lines = [ln for ln in table_.split("\n") if not ln.startswith("weights =")]
    config.write_text(head + sep + f'weights = "{fmt}"\n' + "\n".join(lines) + nxt + tail)


async def _partition(r: Run) -> None:
    hosts = {"node-b", "node-c", "node-d"}
    st = await r.status("node-a")
    links = {p["node_id"] for p in (st or {}).get("peers", []) if p.get("connected")}
    if links - {"node-r"}:
        raise Skip(f"node-a has gossip links of its own to {sorted(links - {'node-r'})}: "
                   f"stopping node-r partitions nothing")
    # well past the health timeout, and long enough for a repair link (a node dials a
    # member whose heartbeats stopped: mesh.links) to show while node-r is still stopped
    hold = 2.5 * r.a.health_timeout
    t = r.signal("node-r", signal.SIGSTOP)

    def partitioned(st: dict[str, Any]) -> bool:
        _, shards, covering = coverage(st, r.a.model)
        return bool(hosts - covering) or any(s.get("state") == "offline"
                                             for s in shards.values())

    seen = await r.wait_view(partitioned, t, timeout=hold)
    r.extra["partition_seen_after_s"] = seen
    r.event("partition seen by node-a" if seen is not None
            else "partition never seen by node-a")
    during = max(1, r.a.chats // 2)
    for i in range(during):
        await r.chat("node-a", i)
    all_back = covered_view(r.a.model, back=dict.fromkeys(hosts))
    healed = await r.wait_view(all_back, t, timeout=max(0.0, hold - (time.monotonic() - t)))
    r.extra["healed_while_relay_stopped_s"] = healed
    if healed is not None:
        r.event("node-a sees every host again, node-r still stopped")
    st = await r.status("node-a")
    r.extra["node_a_links_while_relay_stopped"] = sorted(
        p["node_id"] for p in (st or {}).get("peers", []) if p.get("connected"))
    left = hold - (time.monotonic() - t)
    if left > 0:  # the relay stays stopped for the whole hold, however it went meanwhile
        await asyncio.sleep(left)
    r.extra["partition_s"] = round(time.monotonic() - t, 2)
    t_cont = r.signal("node-r", signal.SIGCONT)
    r.extra["answers_during_partition"] = during
    r.recovered(await r.wait_view(all_back, t_cont), "SIGCONT")
    await _after(r, "node-a", during)


async def _flood(r: Run) -> None:
    n = r.a.flood
    flood = [asyncio.create_task(r.chat("node-f", i, timeout_s=FLOOD_STEP_TIMEOUT_S))
             for i in range(n)]
    r.event(f"node-f opens {n} chats")

    def holding() -> int:  # flood answers under way: they hold the hosts' streams
        return sum(any(f.get("type") == "token_delta" for f in x.frames)
                   for x in r.answers if x.node == "node-f")

    deadline = time.monotonic() + RECOVER_WAIT_S
    while holding() < min(n, FLOOD_STREAMS) and time.monotonic() < deadline \
            and not all(t.done() for t in flood):
        await asyncio.sleep(POLL_S)
    r.event(f"{holding()} flood answers under way; node-a's chat starts")
    member = await r.chat("node-a", 0, timeout_s=FLOOD_STEP_TIMEOUT_S)
    r.event("node-a's chat ended")
    await asyncio.gather(*flood)
    first = next((t for t, f in zip(member.arrivals, member.frames, strict=True)
                  if f.get("type") == "token_delta"), None)
    r.extra["member"] = {"completed": member.done is not None,
                         "first_token_s": round(first - member.started, 2) if first else None,
                         "fallback": bool((member.done or {}).get("fallback")),
                         "flood_still_open_at_its_end": sum(
                             x.ended > member.ended for x in r.answers if x.node == "node-f")}


async def _orchestrator(r: Run) -> None:
    hits: dict[str, Any] = {}

    def kill_a(n: int, ans: Answer) -> None:
        if n == r.a.kill_after and not hits:
            hits["t"] = ans.fault_at = r.signal("node-a", signal.SIGKILL)

    killed, _ = await asyncio.gather(r.chat("node-a", 0, kill_a, orphaned=True),
                                            r.chat("node-g", 1))
    if not hits:
        raise HearthNetError("node-a's answer ended before the fault")
    r.extra["orphaned_call_ended_s"] = round(killed.ended - hits["t"], 2)
    r.extra["orphaned_call_error"] = killed.error
    await _after(r, "node-g", 2)
    started = await r.restart("node-a")
    r.recovered(await r.wait_view(covered_view(r.a.model), started), "restart")
    await r.chat("node-a", 2)


SCENARIOS: dict[str, Scenario] = {
    "kill": Scenario(1, "kill -9 of a shard host mid-answer", _base, _kill,
                     recover_goal=False),
    "stall": Scenario(2, "SIGSTOP of a shard host mid-answer, SIGCONT after", _base, _stall),
    "restart": Scenario(3, "kill -9 of a shard host, then its restart", _base, _restart),
    "int8": Scenario(4, "a host restarted holding int8; lossless calls must not use it",
                     _base, _int8),
    "partition": Scenario(5, "the only gossip relay stopped past the health timeout",
                          _relay_first, _partition),
    "flood": Scenario(6, "one member floods the shards; another member's chat",
                      _flood_mesh, _flood, recover_goal=False),
    "orchestrator": Scenario(7, "kill -9 of the orchestrator mid-answer; a second one serves",
                             _two_orchestrators, _orchestrator),
}
"""name → scenario, in the order they run by default."""


def _scenario_name(text: str) -> str:
    """argparse type: a scenario's name or its number."""
    by_index = {str(s.index): n for n, s in SCENARIOS.items()}
    name = by_index.get(text, text)
    if name not in SCENARIOS:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {text!r}; use one of {', '.join(SCENARIOS)} or 1-{len(SCENARIOS)}")
    return name


# ---- the report ----

def report(f: dict[str, Any]) -> str:
    """The human-readable table of a `run` result, a goal line per scenario, the summary."""
    rows = []
    lines = []
    for name, s in f["scenarios"].items():
        if s["status"] != "ran":
            rows.append([s["index"], name, s["status"]] + [None] * 9)
            lines.append(f"  {s['index']} {name}: {s['status']} — {s['reason']}")
            continue
        lost = s["lost"] if not s["lost_orphaned"] else \
            f"{s['lost']} ({s['lost_orphaned']} orphaned)"
        rows.append([s["index"], name, "ran", s["started"], s["completed"], lost,
                     s["lost_tokens"], s["wrong_format"], s["fallbacks"], s["failovers"],
                     s["fault_to_next_token_s"], _recover_cell(s)])
        lines.append(f"  {s['index']} {name}: {_goal_line(s)}")
        if detail := _details(s):
            lines.append(f"    {detail}")
    t = table(["#", "scenario", "status", "started", "completed", "lost", "lost tokens",
               "wrong format", "fallbacks", "failovers", "fault→next token s",
               "re-cover s"], rows)
    return (f"bench chaos: {f['model_id']}, {f['tokens']} greedy tokens, {f['chats']} "
            f"answers per scenario, health timeout {f['settings']['health_timeout_s']:g} s, "
            f"step deadline {f['settings']['step_timeout_s']:g} s\n{t}\n"
            f"goals: 0 lost, 0 wrong-format, re-cover ≤ {GOAL_RECOVER_S:g} s after a "
            f"restart or resume\n" + "\n".join(lines) + "\n" + _summary_line(f["summary"])
            + f"\nwritten to {f['results_file']}")


def _recover_cell(s: dict[str, Any]) -> str:
    if s["recover_from"] is None:
        return "-"
    v = s["recover_s"]
    return f"{'never' if v is None else v} (from {s['recover_from']})"


def _goal_line(s: dict[str, Any]) -> str:
    def mark(g: str) -> str:
        return "met" if s["goals"][g]["met"] else "MISSED"

    parts = [f"lost {s['lost'] - s['lost_orphaned']} ({mark('lost')})",
             f"wrong-format {s['wrong_format']} ({mark('wrong_format')})"]
    if s["hangs"]:
        parts.append(f"hangs {s['hangs']} (MISSED)")
    if "recover_s" in s["goals"]:
        v = s["recover_s"]
        parts.append(f"re-cover {'never' if v is None else f'{v} s'} ({mark('recover_s')})")
    return ", ".join(parts) + "".join(f"; {n}" for n in s.get("notes", []))


_DETAILS = (  # extra figures a scenario records, as the report words them
    ("detect_s", "kill → the killed host no longer counted: {} s"),
    ("stopped_s", "stopped for {} s"),
    ("stalled_host_state_before_sigcont", "its state on node-a before SIGCONT: {}"),
    ("start_to_ready_s", "start → node_ready (s): {}"),
    ("ready_to_recovered_s", "node_ready → re-covered: {} s"),
    ("partition_seen_after_s", "partition seen by node-a after {} s"),
    ("healed_while_relay_stopped_s", "every host back on node-a, relay still stopped, "
                                     "after {} s"),
    ("node_a_links_while_relay_stopped", "node-a's gossip links then: {}"),
    ("partition_s", "relay stopped {} s in all"),
    ("member", "node-a's chat: {}"),
    ("orphaned_call_ended_s", "the killed orchestrator's call ended {} s after the kill"),
    ("orphaned_call_error", "with {}"),
    ("control_weights_int8", "control call with weights=int8: {}"),
)


def _details(s: dict[str, Any]) -> str:
    return "; ".join(text.format(_words(s[k])) for k, text in _DETAILS if s.get(k) is not None)


def _words(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_words(x)}" for k, x in v.items())
    if isinstance(v, list):
        return " ".join(_words(x) for x in v) or "none"
    return "-" if v is None else str(v)


def _summary_line(sm: dict[str, Any]) -> str:
    head = "all goals met" if sm["all_goals_met"] else "goals NOT all met"
    met = "; ".join(f"{g}: {', '.join(v)}" for g, v in sm["met"].items()) or "none"
    missed = "; ".join(f"{g}: {', '.join(v)}" for g, v in sm["missed"].items()) or "none"
    not_run = "; ".join(f"{n} ({why})" for n, why in sm["not_run"].items()) or "none"
    return f"summary: {head}. met — {met}. missed — {missed}. not run — {not_run}"
