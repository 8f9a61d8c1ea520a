"""`hearthnet plan MODEL`: which node would host which layers, what each would fetch, whether
it fits, and the tok/s to expect — before any download (DESIGN.md decision 14, M26 §10).

MODEL is a store alias, a local ``.gguf`` / ``.safetensors`` file or folder, or an
``http(s)://`` URL of one such file, of which only the header is fetched (HTTP Range
requests, `RangeReader`): sizes come from headers alone (`models.sizes`). The nodes are the
running node's live view (``--config``: its ``/api/plan`` facts — budgets and speeds from
the capacity events, layers held, the measured hop cost) or the ones given with ``--node
NAME:BUDGET_GB[:SPEED]`` (the first is the orchestrator), so a household can plan before
anything runs. The arithmetic is `distributed_inference.placement.predict`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet.errors import BadRequest, ConnectionLost

MIB = 2**20
FIRST_READ = 1 << 20  # one request holds most headers (a 150k-token vocabulary: ~4 MB)
MAX_HEADER_READ = 256 << 20  # a GGUF whose header is bigger than this is not a model
URL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A ``--node NAME:BUDGET_GB[:SPEED]`` argument (SPEED: layer steps per second)."""

    name: str
    budget_bytes: int
    speed: float | None


def node_spec(text: str) -> NodeSpec:
    """argparse type of ``--node``: a bad one is a one-line usage error (exit 2)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME:BUDGET_GB or NAME:BUDGET_GB:SPEED (e.g. laptop:6:800)")
    try:
        budget = float(parts[1])
        speed = float(parts[2]) if len(parts) == 3 and parts[2] else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: BUDGET_GB and SPEED must be numbers") from None
    if not budget > 0 or (speed is not None and not speed > 0) or budget > 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r}: BUDGET_GB and SPEED must be > 0")
    return NodeSpec(parts[0], int(budget * 2**30), speed)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from hearthnet.distributed_inference.directory.formats import FORMATS

    p = sub.add_parser("plan", help="who would host which layers, what each fetches, "
                       "predicted tok/s — from the model's headers, before any download")
    p.add_argument("model", help="store alias, .gguf/.safetensors file or folder, or an "
                   "http(s):// URL of one (only its header is fetched)")
    p.add_argument("--config", help="ask this running node for the live nodes' facts")
    p.add_argument("--node", type=node_spec, action="append", default=[],
                   metavar="NAME:BUDGET_GB[:SPEED]",
                   help="a node to plan for (repeat; the first orchestrates); SPEED in "
                        "decoder-layer steps per second, measured on this machine if left out")
    p.add_argument("--weights", default="native", choices=FORMATS,
                   help="held format of the layers (default native: as stored)")
    p.add_argument("--hop-ms", type=float, default=None,
                   help="per-hop cost in ms (default: measured by the node, else bench "
                        "pipeline's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hearthnet.distributed_inference.placement import predict

    if not args.config and not args.node:
        raise BadRequest("give the nodes: --config FILE (a running node's view) or one "
                         "--node NAME:BUDGET_GB[:SPEED] per node")
    sizes, entry = read_sizes(args.model)
    costs = predict.layer_costs(sizes, args.weights)
    hop = predict.Sourced(args.hop_ms, "given (--hop-ms)") if args.hop_ms else None
    if args.config:
        nodes, measured_hop = _live_nodes(args.config, costs, sizes, entry)
        hop = hop or measured_hop
    else:
        nodes = _given_nodes(args.node, costs, entry, sizes.hidden_size)
    p = predict.plan(costs, nodes, hop)
    if args.json:
        print(json.dumps({"sizes": sizes.to_dict(), "plan": p.to_dict()}, indent=2))
    else:
        print(predict.describe(p))
    return 0


def read_sizes(model: str) -> tuple[Any, Any]:
    """(`ModelSizes`, the store entry or None) of MODEL: URL, local path or store alias."""
    from hearthnet.models import ModelStore
    from hearthnet.models.sizes import local_sizes, safetensors_sizes

    if model.startswith(("http://", "https://")):
        return remote_sizes(model), None
    if os.sep in model or model.endswith((".gguf", ".safetensors")) or Path(model).exists():
        return local_sizes(Path(model)), None
    entry = ModelStore().get(model)  # ModelNotFound lists what is there
    return safetensors_sizes(entry.path, source=entry.alias), entry


# ---- nodes ----

def _given_nodes(specs: list[NodeSpec], costs: Any, entry: Any, hidden: int) -> list[Any]:
    from hearthnet.distributed_inference.placement.predict import NodeFacts, Sourced

    here: Sourced | None = None
    head = None
    out = []
    for i, s in enumerate(specs):
        if s.speed is not None:
            speed = Sourced(s.speed, "given (--node)")
        else:
            here = here or measure_here(costs, entry, hidden)
            speed = here
            head = head or head_speed_here(costs, entry, hidden)
        out.append(NodeFacts(s.name, speed, s.budget_bytes, "given (--node)",
                             orchestrator=i == 0, head_speed=head if i == 0 else None,
                             head_held=i == 0 and entry is not None))
    return out


def measure_here(costs: Any, entry: Any, hidden: int) -> Any:
    """This machine's layer steps per second of the model: a real decoder layer's one-token
    step timed in the engine where the model is in the store, else the matrix-vector probe
    automatic hosts advertise (which leaves out attention, norms and per-layer overhead)."""
    from hearthnet.distributed_inference.placement.predict import Sourced

    if entry is not None and entry.held_layers:
        from hearthnet.distributed_inference.placement.planner import measure_layer_speed

        speed = measure_layer_speed(entry, costs.fmt, threads=1)
        return Sourced(speed, f"measured on this machine, 1 torch thread: a real "
                              f"decoder layer of "
                              f"{entry.alias} as {costs.fmt}, one-token steps")
    return Sourced(probe_head_speed(costs, hidden),
                   "measured on this machine: matrix-vector probe of a layer's weights (a "
                   "lower bound of a real layer's time: no attention, norms or overhead)")


def head_speed_here(costs: Any, entry: Any, hidden: int) -> float:
    """The head's step on this machine as layer steps per second of its matmul: its real
    step timed (embed, norm + lm_head, greedy pick) where the model is in the store, else
    the matrix-vector probe."""
    if entry is None:
        return probe_head_speed(costs, hidden)
    from hearthnet.bench.pipeline import head_step_ms

    ms = head_step_ms(entry, costs.head_fmt, threads=1)
    return float(costs.head_matmul_params / max(1, costs.params_per_layer) / (ms / 1000))


def probe_head_speed(costs: Any, hidden: int) -> float:
    """Matrix-vector layer steps per second here (`planner.measure_speed`): the lm_head's
    cost is one such product."""
    from hearthnet.distributed_inference.engine.quant import compute_dtype_of
    from hearthnet.distributed_inference.placement.planner import measure_speed

    return measure_speed(costs.params_per_layer, hidden, dtype=compute_dtype_of(costs.fmt))


def _live_nodes(config: str, costs: Any, sizes: Any, entry: Any) -> tuple[list[Any], Any]:
    """The running node's facts (``/api/plan``), as `NodeFacts` for this model."""
    from hearthnet.commands.remote import http_get_json
    from hearthnet.distributed_inference.placement import predict
    from hearthnet.node.admin import node_uri

    st = http_get_json(node_uri(config), "/status")
    if not st.get("api"):
        raise BadRequest("the node runs no API listener ([api] enabled = false), where "
                         "/api/plan is served; plan with --node instead")
    facts = http_get_json(str(st["api"]), "/api/plan")
    model_id = entry.model_id if entry is not None else sizes.source
    # loopback: this is the node's machine; probed as the node's own /api/plan does
    fallback = predict.Sourced(
        probe_head_speed(costs, sizes.hidden_size) * costs.params_per_layer,
        "measured here: matrix-vector probe of a layer (no speed of its own published; a "
        "lower bound of a real layer's time)")
    nodes = predict.node_facts(facts["nodes"], costs, model_id, fallback)
    h = facts.get("hop") or {}
    hop = predict.Sourced(float(h["ms"]), str(h["source"])) if h.get("ms") else None
    return nodes, hop


# ---- a remote file's header, by HTTP Range requests ----

Opener = Callable[..., Any]


class RangeReader:
    """Byte ranges of one remote file (RFC 9110 §14: ``Range: bytes=a-b``).

    A server that ignores Range answers 200 with the whole file: only the bytes asked for
    are read from it before the connection is closed.
    """

    def __init__(self, url: str, opener: Opener = urllib.request.urlopen,
                 timeout: float = URL_TIMEOUT_S) -> None:
        self.url, self.opener, self.timeout = url, opener, timeout
        self.size: int | None = None
        self.bytes_read = 0

    def read(self, start: int, length: int) -> bytes:
        req = urllib.request.Request(self.url, headers={
            "Range": f"bytes={start}-{start + length - 1}", "User-Agent": "hearthnet-plan"})
        try:
            with self.opener(req, timeout=self.timeout) as r:
                if r.status == 206:
                    total = r.headers.get("Content-Range", "").rpartition("/")[2]
                    self.size = int(total) if total.isdigit() else self.size
                    data: bytes = r.read(length)
                else:  # the whole file: skip to `start`, take `length`, hang up
                    self.size = int(r.headers.get("Content-Length") or 0) or self.size
                    data = r.read(start + length)[start:]
        except urllib.error.HTTPError as e:
            raise BadRequest(f"{self.url}: HTTP {e.code} {e.reason}") from e
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise ConnectionLost(f"{self.url}: cannot fetch it ({e})") from e
        self.bytes_read += len(data)
        return data


def remote_sizes(url: str, opener: Opener = urllib.request.urlopen,
                 first_read: int = FIRST_READ) -> Any:
    """`ModelSizes` of a remote ``.safetensors`` or ``.gguf`` file from its header alone;
    `first_read`: the bytes asked for first (more follow where the header is longer)."""
    path = urllib.parse.urlparse(url).path
    reader = RangeReader(url, opener)
    if path.endswith(".safetensors"):
        return _remote_safetensors(reader, url, opener, first_read)
    if path.endswith(".gguf"):
        return _remote_gguf(reader, url, first_read)
    raise BadRequest(f"{url}: not a model file URL; give one ending in .gguf or .safetensors")


def _remote_safetensors(reader: RangeReader, url: str, opener: Opener, first_read: int
                        ) -> Any:
    from hearthnet.models.sizes import safetensors_header_length, safetensors_sizes_from_bytes

    prefix = reader.read(0, max(8, first_read))
    end = safetensors_header_length(prefix)
    if end > len(prefix):
        prefix += reader.read(len(prefix), end - len(prefix))
    return safetensors_sizes_from_bytes(prefix, url, _sibling_config(url, opener))


def _sibling_config(url: str, opener: Opener) -> dict[str, Any] | None:
    """The ``config.json`` beside a remote safetensors file, when there is one (a Hugging
    Face repo's): it names the layer count; without it the tensor names do."""
    base = url.rsplit("/", 1)[0] + "/config.json"
    try:
        with opener(urllib.request.Request(base), timeout=URL_TIMEOUT_S) as r:
            data = json.loads(r.read(1 << 20))
    except (urllib.error.URLError, OSError, ValueError, TimeoutError):
        return None
    return data if isinstance(data, dict) else None


def _remote_gguf(reader: RangeReader, url: str, first_read: int) -> Any:
    """Fetch a growing prefix into a sparse file of the remote's size, until gguf-py's
    parse ends inside the prefix (its key-values and tensor infos are all there)."""
    from hearthnet.models.sizes import GGUF_MAGIC, gguf_header_end, gguf_reader, gguf_sizes_of

    prefix = reader.read(0, max(4, first_read))
    if prefix[:4] != GGUF_MAGIC:
        raise BadRequest(f"{url}: not a GGUF file (no GGUF magic)")
    size = reader.size or len(prefix)
    with tempfile.TemporaryDirectory(prefix="hearthnet-plan-") as tmp:
        f = Path(tmp) / "header.gguf"
        while True:
            with f.open("wb") as out:
                out.write(prefix)
                out.truncate(size)  # a hole: the tensor data is never fetched
            try:
                r = gguf_reader(f)
                if gguf_header_end(r) <= len(prefix):
                    return gguf_sizes_of(r, url)
                del r
            except BadRequest:
                if len(prefix) >= size:
                    raise
            if len(prefix) >= min(size, MAX_HEADER_READ):
                raise BadRequest(f"{url}: no complete GGUF header within "
                                 f"{len(prefix) // MIB} MiB")
            prefix += reader.read(len(prefix), min(size, 4 * len(prefix)) - len(prefix))
