"""A head is its alias, weights, tokenizer and chat template (M26 §5.3), not its weights alone.

One store holds a tiny Llama twice under one model id and the same weights: ``chatml`` with
SmolLM2's template and ``inst`` with an ``[INST]`` template (a model re-imported with another
template). Each alias must be prompted with its own template through the orchestrator, over
shards and on the local engine; a re-import under the same alias, or a template fixed in
place, is picked up by the next call and the replaced head is let go.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.models import ModelStore
from hearthnet.models.importer import import_folder
from hearthnet.observability import Metrics
from tests.helpers.inprocess import InProcessMesh
from tests.helpers.tiny_models import make_tiny_model

INST_TEMPLATE = ("{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                 "{% endfor %}")
MODEL_ID = "tiny/two-templates"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
N = 4


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, smollm2: Any) -> tuple[Path, Path]:
    """The same tiny model twice: SmolLM2's template, and `INST_TEMPLATE`."""
    root = tmp_path_factory.mktemp("two-templates")
    chatml = make_tiny_model("llama", root / "chatml", smollm2.path, layers=2, seed=11)
    inst = root / "inst"
    shutil.copytree(chatml, inst)
    (inst / "chat_template.jinja").write_text(INST_TEMPLATE)
    return chatml, inst


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, sources: tuple[Path, Path]) -> ModelStore:
    s = ModelStore(tmp_path_factory.mktemp("two-templates-store") / "models")
    for alias, src in zip(("chatml", "inst"), sources, strict=True):
        import_folder(s, src, alias=alias, model_id=MODEL_ID)
    return s


def _prompt(entry: Any) -> list[int]:
    return LayeredHead(entry, lm_head=False).chat_prompt_ids(MESSAGES)


def _orchestrator(store: ModelStore, pool: ThreadPoolExecutor, *, hosted: bool,
                  shards_of: str = "chatml") -> PipelineOrchestrator:
    mesh = InProcessMesh(store.get(shards_of))  # the shards serve every alias of the weights
    if hosted:
        mesh.add("node-b", 0, 1)
    return PipelineOrchestrator(models=store, router=mesh.router(), health=mesh.health,
                                metrics=Metrics(), connect=mesh.connect, executor=pool)


async def _done(orch: PipelineOrchestrator, model: str, *, fallback: bool = False
                ) -> dict[str, Any]:
    params = DistributedChatParams(sampling=SamplingParams(max_tokens=N), wire_dtype="fp32",
                                   fallback_to_local=fallback)
    frames = [f.to_wire() async for f in orch.chat(ChatRequest(model, MESSAGES), params)]
    assert frames[-1]["type"] == "done", frames[-1]
    return frames[-1]


def test_the_two_aliases_share_weights_and_model_id_but_not_the_head(store: ModelStore) -> None:
    a, b = store.get("chatml"), store.get("inst")
    assert (a.model_id, a.weights_sha256) == (b.model_id, b.weights_sha256)
    assert a.head_sha256() != b.head_sha256()
    assert len(_prompt(a)) != len(_prompt(b))


@pytest.mark.parametrize("hosted", [True, False], ids=["over-shards", "local-fallback"])
async def test_each_alias_is_prompted_with_its_own_template(store: ModelStore,
                                                            hosted: bool) -> None:
    """Whichever alias comes first, the other still gets its own prompt (it used to get the
    first one's head: a different prompt, a different answer, no error)."""
    want = {alias: len(_prompt(store.get(alias))) for alias in ("inst", "chatml")}
    with ThreadPoolExecutor(1) as pool:
        orch = _orchestrator(store, pool, hosted=hosted)
        for alias, n in want.items():
            done = await _done(orch, alias, fallback=not hosted)
            assert done["usage"]["prompt_tokens"] == n, alias
            assert (done["pipeline"] == ["local"]) is not hosted
        heads = {k[0]: p.head for k, p in orch._prepared.items()}
        assert heads["inst"] is not heads["chatml"]
        if not hosted:  # the local engines are per head too
            engines = {k[0]: e for k, e in orch._locals.items()}
            assert engines["inst"].head is heads["inst"]
            assert engines["chatml"].head is heads["chatml"]


async def test_a_reimported_or_fixed_template_is_picked_up_by_the_next_call(
        tmp_path: Path, sources: tuple[Path, Path]) -> None:
    chatml, inst = sources
    store = ModelStore(tmp_path / "models")
    first = import_folder(store, chatml, alias="m", model_id=MODEL_ID)
    before = len(_prompt(first))
    with ThreadPoolExecutor(1) as pool:
        orch = _orchestrator(store, pool, hosted=True, shards_of="m")
        assert (await _done(orch, "m"))["usage"]["prompt_tokens"] == before

        store.remove("m")  # `hearthnet models rm m`, then import the fixed model again
        again = import_folder(store, inst, alias="m", model_id=MODEL_ID)
        assert again.weights_sha256 == first.weights_sha256
        reimported = len(_prompt(again))
        assert reimported != before
        assert (await _done(orch, "m"))["usage"]["prompt_tokens"] == reimported
        assert list(orch._prepared) == [again.head_key()]  # the replaced head is let go

        (again.path / "chat_template.jinja").write_text(  # a template fixed in place
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")
        fixed = len(_prompt(store.get("m")))
        assert fixed not in (before, reimported)
        assert (await _done(orch, "m"))["usage"]["prompt_tokens"] == fixed
        assert len(orch._prepared) == 1
