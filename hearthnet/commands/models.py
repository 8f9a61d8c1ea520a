"""`hearthnet models import|pull|synth|list|verify` (and `serve|unserve|served`, see
`hearthnet.commands.served`).

The commands' own modules (the importer, the writer, the synthesiser: all torch) load when
a command runs, so `hearthnet --help` and `models list` answer without loading torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hearthnet.constants import DEFAULT_GGUF_DTYPE
from hearthnet.models.shapes import SHAPES

if TYPE_CHECKING:
    from hearthnet.models.store import ModelStore


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="the local model store")
    p.add_argument("--models-dir", default=None, help="model store folder (default: data dir)")
    msub = p.add_subparsers(dest="models_command", required=True)
    imp = msub.add_parser("import", help="import `smollm2` (bundled), a .gguf file (llama, "
                          "mistral, qwen2, qwen3, gemma2, gemma3, phi3) or a local HF folder "
                          "(kept at its own precision)")
    imp.add_argument("source")
    imp.add_argument("--alias", default=None)
    imp.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "gguf"],
                     default=DEFAULT_GGUF_DTYPE,
                     help="gguf (the default): keep a GGUF's own quantised blocks (a store "
                          "of the GGUF's size; Q4 blocks held exactly as int4); bf16, fp16, "
                          "fp32: de-quantise to that dtype")
    imp.set_defaults(func=_import)
    pl = msub.add_parser("pull", help="import a model by name from a local Ollama store "
                         "(qwen2.5:0.5b), the Hugging Face cache or LM Studio's folder "
                         "(org/name, org/name:file.gguf), a URL of a .gguf file, or the "
                         "Hugging Face hub (org/name; HF_ENDPOINT names a mirror); no NAME "
                         "or --list: what the local sources offer")
    pl.add_argument("name", nargs="?", default=None, metavar="NAME",
                    help="qwen2.5:0.5b, org/name, org/name:file.gguf or https://…/file.gguf")
    pl.add_argument("--alias", default=None, help="store alias (default: from NAME, "
                    "qwen2.5:0.5b -> qwen2.5-0.5b, org/Name -> name)")
    pl.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "gguf"],
                    default=DEFAULT_GGUF_DTYPE, help="for a GGUF, as `models import`")
    pl.add_argument("--list", action="store_true", help="list what the local sources offer")
    pl.set_defaults(func=_pull)
    syn = msub.add_parser("synth", help="write a real-shape model with random weights: "
                          + ", ".join(SHAPES))
    syn.add_argument("shape")
    syn.add_argument("--alias", default=None, help="store alias (default: SHAPE)")
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=_synth)
    ls = msub.add_parser("list", help="list imported models (with --config: and what each "
                         "node of the mesh holds)")
    ls.add_argument("--config", default=None,
                    help="a running node's TOML: also list what every member holds of each "
                         "model, from the node's view of the mesh")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    ver = msub.add_parser("verify", help="recompute a model's hashes")
    ver.add_argument("model")
    ver.set_defaults(func=_verify)
    rm = msub.add_parser("remove", help="delete a stored model (alias, model id or hash)")
    rm.add_argument("model")
    rm.set_defaults(func=_remove)
    from hearthnet.commands.served import register_served

    register_served(msub)  # serve / unserve / served: the community's list (DESIGN.md decision 14)


def _store(args: argparse.Namespace) -> ModelStore:
    from hearthnet.models.store import ModelStore

    return ModelStore(Path(args.models_dir) if args.models_dir else None)


def _import(args: argparse.Namespace) -> int:
    from hearthnet.models.importer import import_model
    from hearthnet.models.progress import progress_bar

    store = _store(args)
    e = store.find(args.alias or args.source)
    if e is None:
        total = _source_bytes(args.source, args.dtype)  # bad input: one line, before work
        with progress_bar(total, f"import {args.source}") as bar:
            e = import_model(store, args.source, alias=args.alias, dtype=args.dtype,
                             progress=bar.update)
    print(f"{e.alias}: {e.model_id} ({e.num_layers} layers) weights_sha256={e.weights_sha256} "
          f"at {e.path}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from hearthnet.models.pull import local_models, offers_lines, pull

    if args.list or not args.name:
        for line in offers_lines(local_models()):
            print(line)
        return 0
    e = pull(_store(args), args.name, alias=args.alias, dtype=args.dtype)
    print(f"{e.alias}: {e.model_id} ({e.num_layers} layers) weights_sha256={e.weights_sha256} "
          f"at {e.path}")
    return 0


def _source_bytes(source: str, dtype: str) -> int:
    from hearthnet.models.importer import (
        SMOLLM2_ALIAS,
        folder_bytes,
        gguf_plan_bytes,
        smollm2_gguf_path,
    )

    p = Path(source).expanduser()
    if source == SMOLLM2_ALIAS:
        return gguf_plan_bytes(smollm2_gguf_path(), dtype)
    if p.is_file() and p.suffix == ".gguf":
        return gguf_plan_bytes(p, dtype)
    return folder_bytes(p) if p.is_dir() else 0


def _synth(args: argparse.Namespace) -> int:
    from hearthnet.models.progress import progress_bar
    from hearthnet.models.synth import shape_config, synth_model, tensor_plan

    _, cfg = shape_config(args.shape)  # unknown shape: one-line error before any work
    total = sum(t.nbytes for t in tensor_plan(cfg))
    with progress_bar(total, f"synth {args.shape}") as bar:
        e = synth_model(_store(args), args.shape, alias=args.alias, seed=args.seed,
                        progress=bar.update)
    print(f"{e.alias}: {e.model_id} ({e.num_layers} layers, synthetic) "
          f"weights_sha256={e.weights_sha256} at {e.path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    entries = _store(args).entries()
    held: list[dict[str, Any]] | None = None
    if args.config is not None:  # the members' held events, as the running node folds them
        from hearthnet.commands.remote import http_get_json
        from hearthnet.node.admin import node_uri

        held = list(http_get_json(node_uri(args.config), "/status").get("held") or [])
    if args.json:
        mine = [e.to_json(tensors=False) for e in entries]
        print(json.dumps(mine if held is None else {"store": mine, "held": held}, indent=2))
        return 0
    if not entries:
        print("no models; import one with `hearthnet models import smollm2`")
    for e in entries:
        size = sum(int(f["size"]) for f in e.files.values()) / 2**20
        tag = " synthetic" if e.synthetic else ""
        if e.partial:  # fetched from members: only these layers (DESIGN.md decision 17)
            tag += " partial: layers " + ", ".join(f"{a}-{b}" for a, b in e.held_layers) + (
                " + head" if e.holds_head else "")
        print(f"{e.alias:<14} {e.model_id:<40} layers={e.num_layers:<3} {e.stored_as:<9} "
              f"{size:>8.0f} MB sha256={e.weights_sha256[:16]}…{tag}  {e.path}")
    if held is not None:
        print(render_held(held))
    return 0


def render_held(held: list[dict[str, Any]]) -> str:
    """What each member holds of each model (``/status`` ``held``), one line per holding."""
    if not held:
        return "\nheld in the mesh: no member has said it holds a model yet"
    lines = ["", "held in the mesh (members fetch missing layers from these):"]
    for h in sorted(held, key=lambda h: (str(h.get("model")), str(h.get("node")))):
        layers = ", ".join(f"{a}-{b}" for a, b in h.get("layers") or []) or "none"
        lines.append(f"  {h.get('model', '?'):<14} {h.get('node', '?'):<16} layers {layers}"
                     + (" + head" if h.get("head") else ""))
    return "\n".join(lines)


def _remove(args: argparse.Namespace) -> int:
    e = _store(args).remove(args.model)
    size = sum(int(f["size"]) for f in e.files.values()) / 2**20
    print(f"removed {e.alias} ({e.model_id}, {size:.0f} MB) from {e.path.parent}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    e = _store(args).verify(args.model)
    print(f"{e.alias}: ok (weights_sha256={e.weights_sha256})")
    return 0
