"""`hearthnet models import|list|verify`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hearthnet.models.importer import import_model
from hearthnet.models.store import ModelStore


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="the local model store")
    p.add_argument("--models-dir", default=None, help="model store folder (default: data dir)")
    msub = p.add_subparsers(dest="models_command", required=True)
    imp = msub.add_parser("import", help="import `smollm2` (bundled) or a local HF folder")
    imp.add_argument("source")
    imp.add_argument("--alias", default=None)
    imp.set_defaults(func=_import)
    ls = msub.add_parser("list", help="list imported models")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    ver = msub.add_parser("verify", help="recompute a model's hashes")
    ver.add_argument("model")
    ver.set_defaults(func=_verify)


def _store(args: argparse.Namespace) -> ModelStore:
    return ModelStore(Path(args.models_dir) if args.models_dir else None)


def _import(args: argparse.Namespace) -> int:
    e = import_model(_store(args), args.source, alias=args.alias)
    print(f"{e.alias}: {e.model_id} ({e.num_layers} layers) weights_sha256={e.weights_sha256} "
          f"at {e.path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    entries = _store(args).entries()
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return 0
    if not entries:
        print("no models; import one with `hearthnet models import smollm2`")
    for e in entries:
        print(f"{e.alias:<12} {e.model_id:<40} layers={e.num_layers:<3} "
              f"sha256={e.weights_sha256[:16]}…  {e.path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    e = _store(args).verify(args.model)
    print(f"{e.alias}: ok (weights_sha256={e.weights_sha256})")
    return 0
