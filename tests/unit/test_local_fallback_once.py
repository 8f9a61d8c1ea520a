"""Calls that fall back to the local engine at once share one engine (pipeline._local)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from hearthnet.distributed_inference.orchestrator import pipeline


def test_concurrent_fallbacks_build_one_local_engine(monkeypatch):
    built: list[int] = []
    release = threading.Event()

    class FakeEngine:
        def __init__(self, *a, **kw):
            release.wait(10)  # every caller arrives while the first still builds
            built.append(1)

    async def head(entry):
        return SimpleNamespace(head=object())

    monkeypatch.setattr(pipeline, "LocalEngine", FakeEngine)
    orch = object.__new__(pipeline.PipelineOrchestrator)
    orch._locals, orch._local_locks = {}, {}
    orch._head = head
    orch.executor = ThreadPoolExecutor(2)
    orch.local_weights, orch.limits, orch.prefill_chunk_tokens = "fp32", None, 64
    entry = SimpleNamespace(head_key=lambda: ("m", "abc", "def"))

    async def main():
        calls = [asyncio.create_task(orch._local(entry)) for _ in range(8)]
        await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(*calls)

    engines = asyncio.run(main())
    orch.executor.shutdown()
    assert len(built) == 1 and all(e is engines[0] for e in engines)
