"""Heads are prepared ahead of calls only for the models a node serves or can orchestrate
(M26 §5.6: a head is the embeddings and lm_head, GBs for a 7B); any other stored model's
head is loaded by the first call that asks for it."""

from __future__ import annotations

import json
import time

from hearthnet.mesh.launcher import LocalMesh, NodeSpec


def _head_loads(mesh: LocalMesh, node_id: str) -> set[str]:
    """The models whose head `node_id` has finished preparing (its log's head_load_done)."""
    out = set()
    for line in mesh.log_text(node_id).splitlines():
        if line.startswith("{") and '"head_load_done"' in line:
            out.add(json.loads(line)["model"])
    return out


def test_a_node_prepares_heads_only_of_models_it_can_run(smollm2, family_models, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "m").mkdir()
    (models / "smollm2").symlink_to(smollm2.path)
    (models / "llama").symlink_to(family_models[1]["llama"].path)  # stored, hosted nowhere
    # node-b keeps the daemon's default (a local mesh turns it off for layer hosts)
    b = NodeSpec("node-b", [(0, 29)], extra_di={"prepare_heads_at_start": True})
    with LocalMesh([NodeSpec("node-a"), b], root=tmp_path / "m",
                   model="smollm2", models=models) as mesh:
        deadline = time.monotonic() + 120
        while "smollm2" not in _head_loads(mesh, "node-a"):  # it sees smollm2 covered
            assert time.monotonic() < deadline, mesh.log_text("node-a")[-2000:]
            time.sleep(0.2)
        assert _head_loads(mesh, "node-a") == {"smollm2"}  # not the uncovered tiny llama
        assert _head_loads(mesh, "node-b") == {"smollm2"}  # it serves smollm2's layers
        st = mesh.status("node-a")
        assert {m["alias"]: m["fully_covered"] for m in st["models"]} == {
            "smollm2": True, "llama": False}
