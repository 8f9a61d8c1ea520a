"""The per-token path (issue 10 §8): one sanity reduction, a step's input converted once to
the wire dtype, one deadline per step, manifests parsed once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hearthnet.distributed_inference.orchestrator.decode import embed_for_wire
from hearthnet.distributed_inference.orchestrator.sanity import SanityChecker
from hearthnet.errors import ShardCorrupted
from hearthnet.models import store as store_module
from hearthnet.models.store import ModelStore

H = 8


def test_one_reduction_catches_nan_inf_and_an_out_of_bound_norm() -> None:
    checker = SanityChecker([10.0, 10.0])
    ok = torch.full((1, 2, H), 1.0, dtype=torch.float16)  # norm sqrt(8) < 10
    checker.check("s", 1, ok, shape=(1, 2, H), dtype=torch.float16)
    for bad, check in ((float("nan"), "finite"), (float("inf"), "finite"), (100.0, "norm")):
        x = ok.clone()
        x[0, 1, 3] = bad
        with pytest.raises(ShardCorrupted) as e:
            checker.check("s", 1, x)
        assert e.value.details["check"] == check
    SanityChecker(None).check("s", 1, ok * 1000)  # no bounds: only finiteness
    with pytest.raises(ShardCorrupted):
        SanityChecker(None).check("s", 1, torch.full((1, 1, H), float("-inf")))


class _Head:
    """Embeddings of a token id are `id` in every place (float32)."""

    def embed_host(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.float32).view(1, -1, 1).expand(1, len(ids), H)


def test_a_steps_input_is_converted_once_to_the_first_stages_wire_dtype() -> None:
    head = _Head()
    x = embed_for_wire(head, [1, 2], torch.float16)  # type: ignore[arg-type]
    assert x.dtype == torch.float16 and x.shape == (1, 2, H) and float(x[0, 1, 0]) == 2.0
    assert embed_for_wire(head, [5], torch.bfloat16).dtype == torch.bfloat16  # type: ignore[arg-type]
    big = embed_for_wire(head, [70000], torch.float16)  # type: ignore[arg-type]
    assert big.dtype == torch.float32  # overflow: left for the send to report (widen)


def _manifest(folder: Path, alias: str) -> None:
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({
        "model_id": f"org/{alias}", "alias": alias, "weights_sha256": alias * 8,
        "num_layers": 2, "hidden_size": H, "model_type": "llama", "dtype": "float32",
        "source": "test"}))


def test_manifests_are_parsed_once_and_changes_are_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ModelStore(tmp_path)
    _manifest(tmp_path / "a", "a")
    loads: list[Path] = []
    real = store_module.ModelEntry.load.__func__  # type: ignore[attr-defined]

    def counting(cls: type, folder: Path) -> Any:
        loads.append(folder)
        return real(cls, folder)

    monkeypatch.setattr(store_module.ModelEntry, "load", classmethod(counting))
    for _ in range(5):
        assert store.get("a").model_id == "org/a"
    assert loads == [tmp_path / "a"]  # one parse for five lookups
    text = (tmp_path / "a" / "manifest.json").read_text().replace("org/a", "org/a2")
    (tmp_path / "a" / "manifest.tmp").write_text(text)
    (tmp_path / "a" / "manifest.tmp").replace(tmp_path / "a" / "manifest.json")
    assert store.get("a").model_id == "org/a2"  # rewritten (atomically): read again
    _manifest(tmp_path / "b", "b")
    assert [e.alias for e in store.entries()] == ["a", "b"]  # a new model is listed
    (tmp_path / "b").rename(tmp_path / "gone.importing")
    assert [e.alias for e in store.entries()] == ["a"]  # and a removed one is not


async def test_a_step_runs_under_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TensorChannel.step` arms one timer for send and receive together."""
    from hearthnet.transport.websocket import SHARD_PATH, TensorChannel, serve

    async def echo(stream: Any) -> None:
        await stream.accept({})
        while (inp := await stream.recv_step()) is not None:
            await stream.send_step(inp.step, inp.start_pos, inp.tensor)

    server = await serve(echo)
    port = server.sockets[0].getsockname()[1]
    ch = await TensorChannel.connect(f"ws://127.0.0.1:{port}{SHARD_PATH}", {}, deadline_s=30)
    timers: list[float] = []
    real = asyncio.timeout_at

    def counting(when: float | None) -> Any:
        timers.append(when or 0.0)
        return real(when)

    try:
        monkeypatch.setattr(asyncio, "timeout_at", counting)
        now = asyncio.get_running_loop().time()
        res = await ch.step(1, 0, torch.ones(1, 1, H), deadline_s=1000)
        assert torch.equal(res.tensor.float(), torch.ones(1, 1, H))
        # the server's own timers (same loop) run on its 30 s default; the step's is ours
        assert len([t for t in timers if t > now + 500]) == 1
    finally:
        monkeypatch.undo()
        await ch.close()
        server.close()
        await server.wait_closed()
