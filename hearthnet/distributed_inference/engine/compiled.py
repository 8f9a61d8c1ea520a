"""A compiled decode step on the CPU (M26 §5.7; DESIGN.md decision 11): one token of one
session through a sub-range of layers, run as one `torch.compile`d function instead of
one Python call per op.

Why: on a small model the products are small and eager per-op overhead is most of a
decode step (SmolLM2, 30 layers, int4: ~15 ms eager, ~7.5 ms compiled on a 2-core
AVX-512 VM). A CUDA device replays a captured graph instead (`layers._DecodeGraph`).

How:

- The step is the family's own decoder layers called by `LayeredSession.step`, traced
  whole (`fullgraph=True`) with dynamic shapes: the cached length and the slot's capacity
  are symbols, so one compiled step serves every session of a sub-range at any length.
- It is compiled once per (model weights, sub-range, format, kernel, inductor wrapper,
  torch, transformers, CPU flags, engine source) — `artefact_key` — ahead of time
  (`aot_compile`) and saved in the model store (`<models>/.compiled/`,
  `compile_dir_of`), with inductor's own cache beside it, so every node and engine that
  uses the store finds it and a restart loads it in seconds instead of compiling again
  (first compile: 30-70 s on 2 cores for SmolLM2).
- Compilation runs in a background thread; sessions decode eagerly until the step is
  ready. Guards are not kept (the artefact key stands for them), so the compiled step is
  used only for steps whose shape it was traced for: one position, at least two cached
  positions, no mask (inside every sliding window) — everything else runs eagerly.
- Before use, the compiled step's output is compared with the eager layers' (the
  family's transformers modules, the reference) on one step; a difference beyond the
  compute dtype's rounding keeps the range eager and says why.
- A speculative pass (DESIGN.md decision 16: the last token and a few proposals, 2..33
  rows under the causal mask) has its own compiled step, `verify_step`, traced with the
  rows as a symbol too and built the same way (saved as ``verify-<key>.bin``) — on the
  first such pass of a sub-range whose decode step is ready, so nodes that never
  speculate never compile it. Without it a pass of 5 rows costs about two eager decode
  steps on SmolLM2.
- A decode round of several sessions (one position each, `LayeredStack.forward_packed`)
  has its own compiled step, `round_step`, traced with the rows as a symbol: the layers'
  norms, products and rope for every row at once, and their attention as one opaque op
  that attends each row over its own session's slot (`attention.round_attention`, as
  the eager round does). Built after the decode step by a node (its chats batch) or on
  the first round, saved as ``round-<key>.bin``. A round of 8 sessions through 14 layers
  of the 1.5B shape in int8 (Zen 4, one thread): 101 ms eager, 87 ms compiled, of which
  the products take 70.
- A range that cannot be compiled (no C++ compiler, a rope whose frequencies depend on
  the step, an eager-attention family, a compile error) runs eagerly; `state` says why and
  the log records it once. ``HEARTHNET_COMPILE=0`` (or a node's ``compile_decode =
  false``) turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from hearthnet.config import COMPILE_ENV, compile_decode_enabled
from hearthnet.distributed_inference.engine import attention, q4vnni, tracegate
from hearthnet.distributed_inference.engine.kv_cache import CAPACITY_QUANTUM, SegmentsKV
from hearthnet.distributed_inference.engine.quant import kernel_of
from hearthnet.errors import ConfigError
from hearthnet.models.store import ModelEntry
from hearthnet.observability import get_logger

if TYPE_CHECKING:
    from hearthnet.distributed_inference.engine.layers import LayeredSession, LayeredStack

log = get_logger("compiled")

WRAPPER_ENV = "HEARTHNET_COMPILE_WRAPPER"
"""How a compiled step calls its kernels: ``cpp`` (default; inductor's C++ wrapper) or
``python`` (inductor's Python wrapper: about half the compile time, a slower step)."""
WRAPPERS = ("cpp", "python")


def wrapper() -> str:
    """The compiled steps' wrapper (`WRAPPER_ENV`). The C++ one calls SmolLM2's ~300
    kernels a token without the Python wrapper's per-call cost: its 30-layer step measured
    ~8 % faster (two saved steps alternated in one process, 5.3-5.6 against 5.8-6.0 ms on
    an AMD Zen 4), for a first compile about twice as long (64 against 28 s)."""
    value = os.environ.get(WRAPPER_ENV, "cpp").strip().lower() or "cpp"
    if value not in WRAPPERS:
        raise ConfigError(f"{WRAPPER_ENV}={value!r}: expected one of {', '.join(WRAPPERS)}")
    return value


_ENGINE_FILES = ("layers.py", "kv_cache.py", "quant.py", "blocks.py", "attention.py",
                 "compiled.py", "q4vnni.py", "csrc/q4_vnni.cpp")  # what a compiled step
# traces through (or calls: the int4-vnni kernel's source)
_INDUCTOR_LOCK = threading.Lock()
COMPILE_LOCK = threading.Lock()
"""One compilation (or load) at a time in a process: dynamo's tracing is not thread-safe
(the head's steps and a shard's decode step compiled side by side in one node failed
with "Failed to trace builtin operator"); the later one waits, then builds."""
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# the largest output difference from the eager step, relative to the output's largest
# magnitude, that counts as the compute dtype's rounding (fp32: fusion reorders sums;
# bf16 kernels: a flipped bf16 rounding grows through the layers — measured 0.4 % on
# SmolLM2's 30 layers with the bf16 int4 kernel)
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def tolerance(stack: LayeredStack) -> float:
    """The `TOLERANCE` of the dtype `stack`'s products round to: its compute dtype, or bf16
    where its int4 weights run in `int4pack-bf16` (an fp32 stack whose products take and
    give bf16 activations: a 28-layer 1.5B shape measured 2.6e-3 on an AMD Zen 4, over
    fp32's limit, though compiled and eager run the same kernel)."""
    blocks = bool(stack.entry.ggml_types)
    bf16 = stack.format == "int4" and kernel_of(stack.format, blocks) == "int4pack-bf16"
    return TOLERANCE.get(torch.bfloat16 if bf16 else stack.dtype, 1e-3)


def compile_dir_of(entry: ModelEntry) -> Path:
    """Where a stored model's compiled steps are kept: ``.compiled`` in its model store,
    beside the model (every node and engine on the machine that uses the store finds
    them; not a model folder, so the store skips it)."""
    return entry.path.parent / ".compiled"


def decode_step(session: LayeredSession, h: torch.Tensor, positions: torch.Tensor,
                kv_len: int) -> torch.Tensor:
    """What is compiled: one decode position of `session` (h (1, 1, H) at `positions`
    (1,), attending over `kv_len` cached positions, no mask)."""
    return session.step(h, positions, kv_len, plain=True)


def verify_step(session: LayeredSession, h: torch.Tensor, positions: torch.Tensor,
                kv_len: int) -> torch.Tensor:
    """What is compiled for a speculative pass (DESIGN.md decision 16): a few positions of
    `session` (h (1, T, H) at `positions` (T,)), attending over `kv_len` cached positions
    under the causal mask."""
    return session.step(h, positions, kv_len, plain=False)


def round_step(first: LayeredSession, h: torch.Tensor, positions: torch.Tensor,
               table: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """What is compiled for a decode round: one position of each of B sessions of
    `first`'s sub-range (h (1, B, H), row b at `positions[b]`), their rope looked up in
    `table` (the stack's, for the round's largest capacity) and their attention in
    `attention.round_attention` (the round set by `attention.decode_round`)."""
    pe = {kind: (cos[:, positions], sin[:, positions]) for kind, (cos, sin) in table.items()}
    pos_ids = positions.unsqueeze(0)
    for layer, kind in zip(first.layers, first._types, strict=True):
        h = layer(h, attention_mask=None, position_ids=pos_ids, use_cache=True,
                  position_embeddings=pe[kind],
                  **{first.stack.cache_arg: _ROUND_CACHE, attention.ROUND_KWARG: True})
    return h


class _RoundCache:
    """The cache a compiled round's layers see: the new keys/values pass through (the
    round's attention op writes them into each session's slot)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


_ROUND_CACHE = _RoundCache()
MAX_VERIFY_ROWS = 33  # the last token and up to speculate_max_tokens (≤ 32) proposals
_STEPS: dict[str, Callable[..., torch.Tensor]] = {
    "decode": decode_step, "verify": verify_step, "round": round_step}
EXTRA_KINDS = ("verify", "round")
"""The steps built only once a sub-range's decode step is ready (on first use, or after
it where `after_decode` names them)."""


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return " ".join(sorted(line.partition(":")[2].split()))


def _source_digest(stack: LayeredStack) -> str:
    """The engine's and the family's source: a changed layer or cache invalidates."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _ENGINE_FILES:
        h.update((here / name).read_bytes())
    layer = stack.layers[0]
    source = getattr(__import__(type(layer).__module__, fromlist=["_"]), "__file__", None)
    if source:
        h.update(Path(source).read_bytes())
    return h.hexdigest()


def artefact_key(stack: LayeredStack, start: int, end: int) -> str:
    """What a saved compiled step was made for; a different value is a different file."""
    parts = {
        "weights": stack.entry.weights_sha256, "range": [start, end],
        "format": stack.format, "kernel": kernel_of(stack.format, bool(stack.entry.ggml_types)),
        "dtype": str(stack.dtype), "source": _source_digest(stack), **environment(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _trace_length(stack: LayeredStack) -> int:
    """A cached length to trace with that equals no size of the model (dynamic shapes
    would otherwise take it for that size) and fits every sliding window."""
    c = stack.config
    sizes = {int(v) for v in vars(c).values() if isinstance(v, int) and not isinstance(v, bool)}
    n = 37
    window = stack.sliding_window or CAPACITY_QUANTUM
    while n in sizes or n % 2 == 0:
        n += 1
    return min(n, window - 1, CAPACITY_QUANTUM - 1)


_BUILDERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def compiling() -> bool:
    """Whether a background compilation is running in this process (`hearthnet.cli.run`:
    such a thread cannot be stopped, and an interpreter that tears it down aborts)."""
    return any(t.is_alive() for t in list(_BUILDERS))


class CompiledDecode:
    """The compiled decode steps of one stack, one per sub-range, built in the background.

    `step_for(session, kv_len)` gives the ready step for a session's decode position, or
    None (eager). `state()` says, per sub-range, ``compiling``, ``loaded`` / ``compiled``
    (with seconds) or ``eager: <reason>``.
    """

    def __init__(self, stack: LayeredStack, cache_dir: Path | None, *,
                 background: bool = True) -> None:
        self.stack, self.cache_dir, self.background = stack, cache_dir, background
        self._lock = threading.Lock()
        self._steps: dict[tuple[int, int], Callable[..., torch.Tensor]] = {}
        self._states: dict[tuple[int, int], str] = {}
        self._threads: dict[tuple[int, int], threading.Thread] = {}
        # per kind of `EXTRA_KINDS`: the speculative passes' and the decode rounds' steps
        # of a sub-range (built on first use once the decode step is ready; eager until then)
        self._extra: dict[str, dict[tuple[int, int], Callable[..., torch.Tensor]]] = {
            k: {} for k in EXTRA_KINDS}
        self._extra_states: dict[str, dict[tuple[int, int], str]] = {k: {} for k in EXTRA_KINDS}
        self._extra_threads: dict[str, dict[tuple[int, int], threading.Thread]] = {
            k: {} for k in EXTRA_KINDS}
        self.seconds: dict[tuple[int, int], float] = {}
        self.calls = 0  # steps, passes and rounds given a compiled step (tests, benchmarks)
        # kinds to build right after a sub-range's decode step rather than on first use (a
        # node, whose calls speculate by default and whose chats batch: a step compiling
        # beside the chat's first passes took a core from them, a minute on 2 cores)
        self.after_decode: tuple[str, ...] = ()

    # ---- use ----

    def step_for(self, session: LayeredSession, kv_len: int
                 ) -> Callable[..., torch.Tensor] | None:
        """The compiled step for one decode position of `session` with `kv_len` cached
        positions after it, or None (not ready, not compilable, or a shape it was not
        traced for). The first call for a sub-range starts its compilation."""
        key = (session.start, session.end)
        fn = self._steps.get(key)
        if fn is None:
            if key not in self._states:
                self.start(*key)
            return None
        window = self.stack.sliding_window
        if kv_len < 2 or (window is not None and kv_len > window):
            return None
        self.calls += 1
        return fn

    def rows_step_for(self, session: LayeredSession, rows: int, kv_len: int
                      ) -> Callable[..., torch.Tensor] | None:
        """The compiled step for a speculative pass of `rows` positions of `session` with
        `kv_len` cached positions after it, or None (eager). The first such pass of a
        sub-range whose decode step is ready starts its compilation."""
        if not 2 <= rows <= MAX_VERIFY_ROWS:  # a prefill chunk: eager
            return None
        fn = self._extra_for("verify", (session.start, session.end))
        window = self.stack.sliding_window
        if fn is None or kv_len < rows + 2 or (window is not None and kv_len > window):
            return None
        self.calls += 1
        return fn

    def round_step_for(self, first: LayeredSession, rows: int
                       ) -> Callable[..., torch.Tensor] | None:
        """The compiled step for a decode round of `rows` sessions of `first`'s sub-range
        (one position each; any lengths: each row's history is its own session's), or None
        (eager). The first round of a sub-range whose decode step is ready starts its
        compilation."""
        if rows < 2:  # one session: its own decode step
            return None
        fn = self._extra_for("round", (first.start, first.end))
        if fn is not None:
            self.calls += 1
        return fn

    def _extra_for(self, kind: str, key: tuple[int, int]
                   ) -> Callable[..., torch.Tensor] | None:
        """The ready step of `kind` for a sub-range, or None — starting its build once the
        sub-range's decode step is ready."""
        fn = self._extra[kind].get(key)
        if fn is None and key in self._steps and key not in self._extra_states[kind]:
            self._start_extra(key, kind)
        return fn

    def extra_state(self, kind: str) -> dict[str, str]:
        """``"lo-hi"`` → what the sub-range's steps of `kind` (`EXTRA_KINDS`) run as."""
        return {f"{a}-{b}": s for (a, b), s in sorted(self._extra_states[kind].items())}

    def state(self) -> dict[str, str]:
        """``"lo-hi"`` → what the sub-range's decode steps run as."""
        return {f"{a}-{b}": s for (a, b), s in sorted(self._states.items())}

    def wait(self, start: int, end: int, timeout: float | None = None) -> str:
        """Wait for a sub-range's compilation (tests, benchmarks); its state."""
        t = self._threads.get((start, end))
        if t is not None:
            t.join(timeout)
        return self._states.get((start, end), "")

    # ---- build ----

    def start(self, start: int, end: int) -> None:
        """Start compiling (or loading) the step of `[start, end]`, once."""
        key = (start, end)
        with self._lock:
            if key in self._states:
                return
            reason = self._cannot()
            if reason:
                self._eager(key, reason)
                return
            self._states[key] = "compiling"
            if not self.background:
                self._build(key)
                return
            t = threading.Thread(target=self._build, args=(key,), daemon=True,
                                 name=f"compile-{start}-{end}")
            self._threads[key] = t
            _BUILDERS.add(t)
        t.start()

    def _start_extra(self, key: tuple[int, int], kind: str) -> None:
        with self._lock:
            if key in self._extra_states[kind]:
                return
            self._extra_states[kind][key] = "compiling"
            if not self.background:
                self._build(key, kind)
                return
            t = threading.Thread(target=self._build, args=(key, kind), daemon=True,
                                 name=f"compile-{kind}-{key[0]}-{key[1]}")
            self._extra_threads[kind][key] = t
            _BUILDERS.add(t)
        t.start()

    def wait_extra(self, kind: str, start: int, end: int, timeout: float | None = None
                   ) -> str:
        """Wait for a sub-range's step of `kind` (tests, benchmarks); its state."""
        t = self._extra_threads[kind].get((start, end))
        if t is not None:
            t.join(timeout)
        return self._extra_states[kind].get((start, end), "")

    def _cannot(self) -> str:
        """Why this stack's steps cannot be compiled ("" if they can)."""
        s = self.stack
        reason = cannot_compile()
        if reason:
            return reason
        if s.device.type != "cpu":
            return f"on {s.device.type} (a CUDA device replays captured graphs instead)"
        if s.rotary.dynamic:
            return "the rope's frequencies depend on the step (dynamic or longrope)"
        if s.additive_mask is not None:
            return "the family uses eager attention with an additive mask"
        kernel = kernel_of(s.format)
        if s.format == "int8" and kernel != q4vnni.INT8_KERNEL:  # its op traces; these do not
            return (f"int8 runs in {kernel}'s packed integer GEMM, which torch.compile "
                    "cannot trace")
        return _no_compiler()

    def _eager(self, key: tuple[int, int], reason: str, kind: str = "decode") -> None:
        (self._states if kind == "decode" else self._extra_states[kind])[key] = \
            f"eager: {reason}"
        log.info(f"{kind}_step_eager", model=self.stack.entry.alias,
                 layers=list(key), reason=reason)

    def _build(self, key: tuple[int, int], kind: str = "decode") -> None:
        t0 = time.perf_counter()
        try:
            with COMPILE_LOCK:
                fn, how = self._load_or_compile(*key, kind)
            if kind == "round":
                error = _compare_round(fn, self.stack, key)
            else:
                session = self.stack.open_session(*key, CAPACITY_QUANTUM)
                try:
                    error = _compare(fn, session, _trace_length(self.stack),
                                     _trace_rows(self.stack) if kind == "verify" else 1)
                finally:
                    session.close()
            limit = tolerance(self.stack)
            if error > limit:
                self._discard(*key, kind)
                self._eager(key, f"the compiled step differs from the eager layers by "
                                 f"{error:.2e} (relative; allowed {limit:.0e})", kind)
                return
        except Exception as e:  # any compile failure: the range runs eagerly, said why
            self._eager(key, f"compilation failed: {_named(e)}", kind)
            return
        seconds = time.perf_counter() - t0
        how, _, note = how.partition(" ")
        state = f"{how} in {seconds:.1f} s{' ' + note if note else ''}"
        queued: list[str] = []
        if kind == "decode":
            self.seconds[key] = seconds
            with self._lock:  # said before the decode step: a wait for "no step compiling"
                queued = [k for k in self.after_decode if key not in self._extra_states[k]]
                for extra in queued:  # does not end between the two
                    self._extra_states[extra][key] = "compiling"
            self._states[key] = state
            self._steps[key] = fn  # after the state: status never says compiling while in use
        else:
            self._extra_states[kind][key] = state
            self._extra[kind][key] = fn
        log.info(f"{kind}_step_compiled", model=self.stack.entry.alias, layers=list(key),
                 how=how, seconds=round(seconds, 1), max_relative_error=f"{error:.1e}")
        for extra in queued:  # on this thread, one after the other: one core compiles
            self._build(key, extra)

    def _path(self, start: int, end: int, kind: str = "decode") -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"{kind}-{artefact_key(self.stack, start, end)}.bin"

    def _discard(self, start: int, end: int, kind: str = "decode") -> None:
        path = self._path(start, end, kind)
        if path is not None:
            path.unlink(missing_ok=True)

    def _load_or_compile(self, start: int, end: int, kind: str = "decode"
                         ) -> tuple[Callable[..., torch.Tensor], str]:
        path = self._path(start, end, kind)
        _use_inductor_cache(self.cache_dir)
        with build_lock(path):
            saved, note = load_saved(path, globals(), "decode_step")
            if saved is not None:
                return saved, "loaded"
            session = self.stack.open_session(start, end, CAPACITY_QUANTUM)
            try:
                fn = _aot_compile(session, _trace_length(self.stack), kind)
            finally:
                session.close()
            if path is not None:
                fn.save_compiled_function(str(path))  # a temporary, then a rename
        compiled: Callable[..., torch.Tensor] = fn
        return compiled, "compiled" + note


BUILD_LOCK_TIMEOUT_S = 1800.0  # another process's build of the same step: wait this long


def build_lock(path: Path | None) -> contextlib.AbstractContextManager[Any]:
    """Held while a saved step is loaded or built, across processes (a file lock beside
    it, released by the OS if its holder dies): the nodes of one machine share a store,
    and `make demo`'s three nodes each prepared the same head — two of them now wait and
    load the first one's file instead of compiling it again beside it."""
    if path is None:
        return contextlib.nullcontext()
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{path}.lock", timeout=BUILD_LOCK_TIMEOUT_S)


def load_saved(path: Path | None, f_globals: dict[str, Any], what: str
               ) -> tuple[Callable[..., torch.Tensor] | None, str]:
    """The compiled function saved at `path` (its module's `f_globals`), or None and a
    note for the state when there is none or it did not load (a stale or torn file:
    deleted, to be compiled afresh; the log says so as ``<what>_reload_failed``)."""
    if path is None or not path.exists():
        return None, ""
    try:
        with path.open("rb") as f:
            fn: Callable[..., torch.Tensor] = torch.compiler.load_compiled_function(
                f, f_globals=f_globals)
        return fn, ""
    except Exception as e:  # any failure to load: compiled afresh, and said why
        note = f" (the saved step did not load: {_named(e)})"
        log.info(f"{what}_reload_failed", path=str(path), error=note[2:-1])
        path.unlink(missing_ok=True)
        return None, note


def cannot_compile() -> str:
    """Why this process compiles no step at all ("" if it may): compilation turned off, or
    a wrapper setting it does not know."""
    if not compile_decode_enabled():
        return f"{COMPILE_ENV}=0"
    try:
        wrapper()
    except ConfigError as e:
        return e.message
    return ""


def _no_compiler() -> str:
    """Why no step can be built on this machine ("" if a C++ compiler is there)."""
    if shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"):
        return ""
    return "no C++ compiler on this machine (torch.compile's CPU backend needs one)"


def environment() -> dict[str, str]:
    """What every saved step's key includes besides its own: how it is built and what it
    runs on (torch, transformers, Python, the machine and its CPU flags)."""
    import transformers  # the family's modules are transformers'

    return {"wrapper": wrapper(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu": _cpu_flags()}


def _named(e: BaseException) -> str:
    """`Type: first line of its message` (≤ 200 characters): one line for status and logs."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _trace_rows(stack: LayeredStack) -> int:
    """A number of rows to trace a speculative pass with that equals no size of the model
    nor the traced cached length (dynamic shapes would take it for that size)."""
    c = stack.config
    sizes = {int(v) for v in vars(c).values() if isinstance(v, int) and not isinstance(v, bool)}
    sizes.add(_trace_length(stack))
    n = 5
    while n in sizes:
        n += 1
    return n


def _aot_compile(session: LayeredSession, kv_len: int, kind: str = "decode") -> Any:
    """`decode_step` (or `verify_step`, `round_step`) compiled ahead of time for
    `session`'s sub-range (any session of it)."""
    stack = session.stack
    rows = _trace_rows(stack) if kind != "decode" else 1
    h = torch.zeros(1, rows, stack.hidden_size, dtype=stack.dtype, device=stack.device)
    pos = torch.arange(kv_len - rows, kv_len, device=stack.device)
    if kind == "round":  # rows of different sessions, and the table of their capacity
        args: tuple[Any, ...] = (session, h, pos, stack.tables(CAPACITY_QUANTUM)[0])
    else:
        args = (session, h, pos, kv_len)
    # guards are replaced by `artefact_key` and `step_for`'s checks (they would pickle
    # the stack); floats are constants of the model (norm eps, scaling), not inputs. No
    # size asserts: the step's inputs are a session's cache slots, laid out by one
    # allocator (kv_cache.py) and checked once against the eager step (`_compare`), and
    # SmolLM2's step made ~630 assert calls a token (~5 % of its time, measured A/B).
    tracegate.install()  # eager passes on other threads wait out its fx traces
    compiled: Any = torch.compile(_STEPS[kind], fullgraph=True, dynamic=True,
                                  options={"guard_filter_fn":
                                           torch.compiler.skip_all_guards_unsafe,
                                           "size_asserts": False,
                                           "cpp_wrapper": wrapper() == "cpp"})
    with torch._dynamo.config.patch(specialize_float=True), torch.inference_mode():
        return compiled.aot_compile((args, {}))


def _compare(fn: Callable[..., torch.Tensor], session: LayeredSession, kv_len: int,
             rows: int = 1) -> float:
    """Max |compiled − eager| / max |eager| of one step of `rows` positions ending at
    `kv_len`, after an eager prefill of random hidden states (both steps write the same
    cache positions)."""
    stack = session.stack
    g = torch.Generator(device="cpu").manual_seed(0)
    prefix = torch.randn(1, kv_len - rows, stack.hidden_size, generator=g).to(stack.dtype)
    x = torch.randn(1, rows, stack.hidden_size, generator=g).to(stack.dtype)
    pos = torch.arange(kv_len - rows, kv_len, device=stack.device)
    with torch.inference_mode():
        session.forward(prefix, 0)
        ref = session.step(x, pos, kv_len, plain=rows == 1).float()
        out = fn(session, x, pos, kv_len).float()
    return float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _compare_round(fn: Callable[..., torch.Tensor], stack: LayeredStack,
                   key: tuple[int, int]) -> float:
    """Max |compiled − eager| / max |eager| of one decode round of three sessions of
    sub-range `key` after eager prefills of random hidden states of different lengths
    (both rounds write the same cache positions)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n = _trace_length(stack)
    lengths = [max(1, n - 2), n, n + 1]  # different lengths, within the first capacity
    sessions = [stack.open_session(*key, CAPACITY_QUANTUM) for _ in lengths]
    try:
        with torch.inference_mode():
            for s, length in zip(sessions, lengths, strict=True):
                s.forward(torch.randn(1, length, stack.hidden_size, generator=g
                                      ).to(stack.dtype), 0)
            x = torch.randn(1, len(lengths), stack.hidden_size, generator=g).to(stack.dtype)
            slots = [s.slot for s in sessions]

            def round_cache() -> SegmentsKV:
                return SegmentsKV(slots, lengths, [1] * len(lengths), sessions[0]._types,
                                  stack.sliding_window, stack.additive_mask, stack.device)

            ref = stack.forward_rows(sessions[0], x, round_cache(), CAPACITY_QUANTUM).float()
            out = stack.run_round(fn, sessions[0], x, round_cache(), CAPACITY_QUANTUM).float()
    finally:
        for s in sessions:
            s.close()
    return float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _use_inductor_cache(cache_dir: Path | None) -> None:
    """Inductor's cache under the node's compiled dir, so a restart finds its kernels
    built — also after a reboot empties inductor's default (``/tmp/torchinductor_<user>``:
    a saved step whose kernels are gone is rebuilt, 20-50 s on SmolLM2) — unless the user
    set ``TORCHINDUCTOR_CACHE_DIR`` (process-wide: set once). Inductor writes its default
    into the environment on first use (any compile or kernel probe before this one), so
    that value counts as unset."""
    if cache_dir is None:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    with _INDUCTOR_LOCK:
        current = os.environ.get(INDUCTOR_CACHE_ENV)
        if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
            os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir / "inductor")
