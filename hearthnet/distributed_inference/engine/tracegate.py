"""Eager forwards and torch.fx's tracers take turns (M26 §5.6: a decode step compiles in
the background while sessions decode eagerly, `compiled.py`).

While a `torch.fx.Tracer` traces, it replaces `torch.nn.Module.__call__` (and
``__getattr__``) on the class, for every thread of the process. Inductor traces with one
while it generates a step's code, so an eager forward on another thread at that moment ran
its submodules through the tracer and failed ("module is not installed as a submodule";
seen as a `hearthnet chat --local` that answered while its step compiled, then exited 1
with a traceback). `eager()` is held by every eager pass through the engine's modules,
shared; a trace by such a tracer holds the gate alone, so each waits for the other (a trace
takes milliseconds; a step, what a step takes).

`make_fx`'s tracer (`PythonKeyTracer`, AOT autograd's seconds-long trace of a step) runs a
module it meets as itself and changes nothing an eager call sees, so it does not wait:
only tracers that resolve modules by their path in the traced root are gated.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


class TraceGate:
    """Many eager passes at once, or one gated trace; a trace waits for the passes in
    progress, and passes that begin while a trace waits or runs wait for it (so a stream
    of steps cannot hold a compile off)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._passes = 0  # eager passes in progress
        self._queued = 0  # traces waiting for the passes to end
        self._tracing = 0  # gated traces in progress (nested traces on one thread)
        self._tracer: int | None = None  # the thread tracing
        self._depth = threading.local()  # this thread's eager passes in progress
        self.waiting = 0  # eager passes waiting for a trace (observable in tests)
        self._pass = _Pass(self)

    def eager(self) -> contextlib.AbstractContextManager[None]:
        """Held around an eager pass through modules (shared with other passes); a
        context manager object rather than a generator: it is entered every step."""
        return self._pass

    def _enter(self) -> None:
        depth = getattr(self._depth, "n", 0)
        with self._cond:
            # a pass inside a pass of this thread, or on the tracing thread, never waits:
            # the trace would be waiting for this thread
            if (self._tracing or self._queued) and not depth \
                    and self._tracer != threading.get_ident():
                self.waiting += 1
                try:
                    self._cond.wait_for(lambda: not self._tracing and not self._queued)
                finally:
                    self.waiting -= 1
            self._passes += 1
        self._depth.n = depth + 1

    def _exit(self) -> None:
        self._depth.n -= 1
        with self._cond:
            self._passes -= 1
            if not self._passes and self._queued:
                self._cond.notify_all()

    @contextlib.contextmanager
    def trace(self) -> Iterator[None]:
        """Held around a trace that patches `torch.nn.Module` for the whole process."""
        me = threading.get_ident()
        with self._cond:
            if self._tracer != me:  # not a trace inside this thread's own trace
                # this thread's own eager pass (a trace started inside it) is not waited for
                mine = getattr(self._depth, "n", 0)
                self._queued += 1
                try:
                    self._cond.wait_for(lambda: not self._tracing and self._passes == mine)
                finally:
                    self._queued -= 1
                self._tracer = me
            self._tracing += 1
        try:
            yield
        finally:
            with self._cond:
                self._tracing -= 1
                if not self._tracing:
                    self._tracer = None
                    self._cond.notify_all()


class _Pass:
    """`TraceGate.eager()`'s context manager."""

    __slots__ = ("gate",)

    def __init__(self, gate: TraceGate) -> None:
        self.gate = gate

    def __enter__(self) -> None:
        self.gate._enter()

    def __exit__(self, *exc: object) -> None:
        self.gate._exit()


GATE = TraceGate()


def eager() -> contextlib.AbstractContextManager[None]:
    """`GATE.eager()`, or nothing while torch.compile traces the caller itself (the gate's
    lock is no part of a compiled step)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return GATE.eager()


def _gated(trace: Callable[..., Any]) -> Callable[..., Any]:
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer

    @functools.wraps(trace)
    def gated_trace(self: torch.fx.Tracer, *args: Any, **kwargs: Any) -> Any:
        if type(self).call_module is PythonKeyTracer.call_module:
            return trace(self, *args, **kwargs)
        with GATE.trace():
            return trace(self, *args, **kwargs)

    gated_trace.__hearthnet_gated__ = True  # type: ignore[attr-defined]
    return gated_trace


_INSTALL_LOCK = threading.Lock()


def install() -> None:
    """Gate `torch.fx.Tracer.trace` (once per process): called before anything compiles."""
    with _INSTALL_LOCK:
        current = torch.fx.Tracer.trace
        if not getattr(current, "__hearthnet_gated__", False):
            torch.fx.Tracer.trace = _gated(current)  # type: ignore[method-assign]
