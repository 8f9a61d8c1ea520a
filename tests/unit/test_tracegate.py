"""Eager forwards wait out torch.fx traces that patch `torch.nn.Module` for the process
(`engine/tracegate.py`): a step decoding beside a compile must not run through a tracer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from hearthnet.distributed_inference.engine import tracegate
from hearthnet.distributed_inference.engine.tracegate import TraceGate

DEADLINE_S = 30.0


def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_an_eager_forward_during_a_trace_waits_for_it_and_computes_the_same(smollm2):
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    tracegate.install()
    stack = LayeredStack(smollm2, 0, 1)
    x = torch.randn(1, 5, stack.hidden_size, generator=torch.Generator().manual_seed(0))
    want = stack.open_session(0, 1, 8).forward(x, 0)

    inside, seen = threading.Event(), {}

    def traced(v: torch.Tensor) -> torch.Tensor:
        # inside the trace nn.Module.__call__ is the tracer's for every thread: hold it
        # until the eager forward below is waiting at the gate (it would fail otherwise)
        inside.set()
        _until(lambda: tracegate.GATE.waiting >= 1, "the eager forward to wait")
        seen["waiting"] = tracegate.GATE.waiting
        return v

    errors: list[BaseException] = []

    def trace() -> None:
        try:
            torch.fx.Tracer().trace(traced)
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    t = threading.Thread(target=trace)
    t.start()
    assert inside.wait(DEADLINE_S)
    got = stack.open_session(0, 1, 8).forward(x, 0)  # blocks until the trace has ended
    t.join(DEADLINE_S)
    assert not errors and not t.is_alive()
    assert seen["waiting"] == 1
    assert torch.equal(got, want)


def test_a_trace_waits_for_passes_in_progress_and_later_passes_wait_for_it():
    gate = TraceGate()
    order: list[str] = []
    release_a = threading.Event()

    def pass_a() -> None:
        with gate.eager():
            order.append("a starts")
            release_a.wait(DEADLINE_S)
            order.append("a ends")

    def trace_b() -> None:
        with gate.trace():
            order.append("b traces")

    def pass_c() -> None:
        with gate.eager():
            order.append("c runs")

    a = threading.Thread(target=pass_a)
    a.start()
    _until(lambda: order == ["a starts"], "pass a")
    b = threading.Thread(target=trace_b)
    b.start()
    _until(lambda: gate._queued == 1, "the trace to queue")
    c = threading.Thread(target=pass_c)
    c.start()
    _until(lambda: gate.waiting == 1, "pass c to wait behind the queued trace")
    assert order == ["a starts"]  # neither the trace nor the later pass has run
    release_a.set()
    for th in (a, b, c):
        th.join(DEADLINE_S)
        assert not th.is_alive()
    assert order == ["a starts", "a ends", "b traces", "c runs"]


def test_a_thread_never_waits_on_itself():
    gate = TraceGate()
    with gate.eager():
        # a trace begun inside this thread's own pass, and a pass inside that trace (the
        # compile's own check of its step)
        with gate.trace(), gate.eager():
            pass
        with gate.eager():  # nested passes
            pass
    assert gate._passes == 0 and gate._tracing == 0 and gate._tracer is None


def test_install_is_idempotent_and_make_fx_does_not_wait():
    tracegate.install()
    gated = torch.fx.Tracer.trace
    tracegate.install()
    assert torch.fx.Tracer.trace is gated
    # AOT autograd's tracer runs modules as themselves: a held pass does not stop it
    from torch.fx.experimental.proxy_tensor import make_fx

    with tracegate.GATE.eager():
        done = threading.Event()
        th = threading.Thread(target=lambda: (make_fx(lambda v: v * 2)(torch.ones(2)),
                                              done.set()))
        th.start()
        assert done.wait(DEADLINE_S)
        th.join(DEADLINE_S)


def test_the_gate_is_released_when_the_body_raises():
    gate = TraceGate()
    with pytest.raises(RuntimeError), gate.eager():
        raise RuntimeError("a failed step")
    with pytest.raises(RuntimeError), gate.trace():
        raise RuntimeError("a failed trace")
    assert gate._passes == 0 and gate._tracing == 0 and gate._queued == 0
