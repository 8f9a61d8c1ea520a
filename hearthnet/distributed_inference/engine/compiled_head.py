"""The head's compiled steps on the CPU (M26 §5.7; DESIGN.md decision 11): the embedding
lookup and the final norm + lm_head (+ Gemma-2's soft-cap) of the orchestrator's head, each
run as one `torch.compile`d function instead of one Python call per op.

Built like the layers' decode steps (`compiled.py`): ahead of time, in a background thread,
saved in the model store's ``.compiled/`` (``head-logits-<key>.bin``, ``head-embed-<key>
.bin``) with inductor's kernels beside them, so a restart loads them in a second; compared
with the eager head (the family's own norm and embedding modules, the reference) before use;
eager with the reason in `state` where they cannot be built. The number of rows is unbacked
(`mark_unbacked`): one artefact serves one decode row, a round of several chats' rows, a
speculative pass's rows and a prompt's embedding alike, one row included.

Sampling stays where the logits are: the head's device (on the CPU, the host) — the sampler
(`generation.Sampler`) masks, penalises and draws with the call's own generator there.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hearthnet.distributed_inference.engine import compiled, tracegate
from hearthnet.distributed_inference.engine.quant import Int8Linear, Q8Linear, kernel_of
from hearthnet.observability import get_logger

if TYPE_CHECKING:
    from hearthnet.distributed_inference.engine.head import LayeredHead

log = get_logger("compiled")

KINDS = ("logits", "embed")
_HEAD_FILES = ("head.py", "compiled_head.py", "quant.py", "blocks.py", "q4vnni.py",
               "csrc/q4_vnni.cpp")  # what a compiled head traces through (or calls)
_TRACE_ROWS = 5  # rows to trace with; the count is unbacked, so any count runs


def head_logits(head: LayeredHead, h: torch.Tensor) -> torch.Tensor:
    """What is compiled: (T, vocab) fp32 logits of final hidden rows h (T, H)."""
    return head.logits_of(h)


def head_embed(head: LayeredHead, ids: torch.Tensor) -> torch.Tensor:
    """What is compiled: (1, T, H) input hidden states of token ids (1, T)."""
    return head.embed_of(ids)


_STEPS = {"logits": head_logits, "embed": head_embed}


def _source_digest(head: LayeredHead) -> str:
    """The engine's head source and the family's (its norm and embedding modules)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _HEAD_FILES:
        h.update((here / name).read_bytes())
    for module in (head.norm, head.embed_tokens):
        source = getattr(__import__(type(module).__module__, fromlist=["_"]), "__file__", None)
        if source:
            h.update(Path(source).read_bytes())
    return h.hexdigest()


def artefact_key(head: LayeredHead, kind: str) -> str:
    """What a saved compiled head step was made for; a different value is another file."""
    parts = {
        "kind": kind, "weights": head.entry.weights_sha256, "format": head.format,
        "kernel": _kernel(head), "dtype": str(head.dtype),
        "softcap": head.final_logit_softcapping,
        "weights_left": getattr(head, "weights_left", False),  # how the logits multiply
        "source": _source_digest(head), **compiled.environment(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _kernel(head: LayeredHead) -> str:
    """The head's product kernel: Q8_0 blocks in `int4-vnni`'s, else its format's."""
    if isinstance(head.lm_head_q, Q8Linear) or isinstance(head.embed_q, Q8Linear):
        return "int4-vnni"
    return kernel_of(head.format, False)


class CompiledHead:
    """The compiled `logits` and `embed` steps of one head, built in the background.

    `fn(kind)` gives the ready step or None (eager). `state()` says, per kind,
    ``compiling``, ``loaded`` / ``compiled`` (with seconds) or ``eager: <reason>``.
    """

    def __init__(self, head: LayeredHead, cache_dir: Path | None) -> None:
        self.head, self.cache_dir = head, cache_dir
        self._fns: dict[str, Callable[..., torch.Tensor]] = {}
        self._states: dict[str, str] = {}
        self._thread: threading.Thread | None = None
        self.seconds = 0.0  # building or loading both steps took (benchmarks)
        self.calls = 0  # head steps run compiled (tests, benchmarks)

    def fn(self, kind: str) -> Callable[..., torch.Tensor] | None:
        """The ready compiled step of `kind`, or None (not ready, or eager)."""
        f = self._fns.get(kind)
        if f is not None:
            self.calls += 1
        return f

    def state(self) -> dict[str, str]:
        """``logits`` / ``embed`` → what the head's step of that kind runs as."""
        return dict(self._states)

    def start(self) -> None:
        """Start building (or loading) both steps, once."""
        if self._states:
            return
        for kind in KINDS:
            reason = self._cannot(kind)
            if reason:
                self._eager(kind, reason)
            else:
                self._states[kind] = "compiling"
        kinds = [k for k in KINDS if self._states[k] == "compiling"]
        if not kinds:
            return
        self._thread = threading.Thread(target=self._build, args=(kinds,), daemon=True,
                                        name="compile-head")
        compiled._BUILDERS.add(self._thread)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> dict[str, str]:
        """Wait for the build (tests, benchmarks); `state`."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state()

    def _cannot(self, kind: str) -> str:
        """Why the head's `kind` step cannot be compiled ("" if it can)."""
        head = self.head
        reason = compiled.cannot_compile()
        if reason:
            return reason
        if head.device.type != "cpu":
            return f"on {head.device.type} (compiled steps are built for the CPU)"
        held = head.lm_head_q if kind == "logits" else head.embed_q
        if isinstance(held, Int8Linear) and held.kernel in ("onednn", "fbgemm") \
                and kind == "logits":
            return (f"int8 per output channel runs in {held.kernel}'s packed integer GEMM, "
                    "which torch.compile cannot trace")
        if kind == "logits" and held is None and not head.lm_head_weight.numel():
            return "the head holds no lm_head"
        return compiled._no_compiler()

    def _eager(self, kind: str, reason: str) -> None:
        self._states[kind] = f"eager: {reason}"
        log.info("head_step_eager", model=self.head.entry.alias, kind=kind, reason=reason)

    def _build(self, kinds: list[str]) -> None:
        for kind in kinds:
            t0 = time.perf_counter()
            try:
                with compiled.COMPILE_LOCK:
                    fn, how = self._load_or_compile(kind)
                error = _compare(fn, self.head, kind)
                limit = compiled.TOLERANCE.get(self.head.dtype, 1e-3)
                if error > limit:
                    self._discard(kind)
                    self._eager(kind, f"the compiled step differs from the eager head by "
                                      f"{error:.2e} (relative; allowed {limit:.0e})")
                    continue
            except Exception as e:  # any compile failure: the head runs eagerly, said why
                self._eager(kind, f"compilation failed: {compiled._named(e)}")
                continue
            seconds = time.perf_counter() - t0
            self.seconds += seconds
            how, _, note = how.partition(" ")
            self._states[kind] = f"{how} in {seconds:.1f} s{' ' + note if note else ''}"
            self._fns[kind] = fn  # after the state: status never says compiling while in use
            log.info("head_step_compiled", model=self.head.entry.alias, kind=kind, how=how,
                     seconds=round(seconds, 1), max_relative_error=f"{error:.1e}")

    def _path(self, kind: str) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"head-{kind}-{artefact_key(self.head, kind)}.bin"

    def _discard(self, kind: str) -> None:
        path = self._path(kind)
        if path is not None:
            path.unlink(missing_ok=True)

    def _load_or_compile(self, kind: str) -> tuple[Callable[..., torch.Tensor], str]:
        path = self._path(kind)
        compiled._use_inductor_cache(self.cache_dir)
        with compiled.build_lock(path):
            saved, note = compiled.load_saved(path, globals(), "head_step")
            if saved is not None:
                return saved, "loaded"
            out = _aot_compile(self.head, kind)
            if path is not None:
                out.save_compiled_function(str(path))  # a temporary, then a rename
        fn_: Callable[..., torch.Tensor] = out
        return fn_, "compiled" + note


def _example(head: LayeredHead, kind: str, rows: int = _TRACE_ROWS) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0)
    if kind == "logits":
        return torch.randn(rows, head.hidden_size, generator=g).to(head.dtype)
    vocab = int(head.config.vocab_size)
    return torch.randint(0, vocab, (1, rows), generator=g)


def _aot_compile(head: LayeredHead, kind: str) -> Any:
    """`head_logits` (or `head_embed`) compiled ahead of time for `head`, its row count
    unbacked: no 0/1 specialisation, so one row runs the same artefact as many."""
    x = _example(head, kind)
    torch._dynamo.decorators.mark_unbacked(x, 0 if kind == "logits" else 1)
    # as the layers' steps (compiled._aot_compile): guards replaced by `artefact_key`,
    # floats (norm eps, the soft-cap) constants of the model, no size asserts
    tracegate.install()  # eager passes on other threads wait out its fx traces
    fn: Any = torch.compile(_STEPS[kind], fullgraph=True, dynamic=True,
                            options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                                     "size_asserts": False,
                                     "cpp_wrapper": compiled.wrapper() == "cpp"})
    with torch._dynamo.config.patch(specialize_float=True), torch.inference_mode():
        return fn.aot_compile(((head, x), {}))


def _compare(fn: Callable[..., torch.Tensor], head: LayeredHead, kind: str) -> float:
    """Max |compiled − eager| / max |eager| over one row and over several."""
    error = 0.0
    with torch.inference_mode():
        for rows in (1, _TRACE_ROWS + 2):
            x = _example(head, kind, rows)
            ref = _STEPS[kind](head, x).float()
            out = fn(head, x).float()
            error = max(error, float((out - ref).abs().max()
                                     / ref.abs().max().clamp(min=1e-30)))
    return error
