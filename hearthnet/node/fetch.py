"""Weights from the mesh (DESIGN.md decision 17): a node fetches exactly the tensors of the
layers it is to host from the members that hold them.

Three parts, all over the node's authenticated capability bus (`mesh.bus`):

- **What members hold**: each node appends a ``experimental.model.held`` event per stored
  model (full or partial: the layer ranges and whether it has the head, its endpoint);
  `HeldModels` folds them from the event log, as the shard directory folds advertisements.
- **Serving** (`WeightsService`): ``hearthnet.weights.manifest`` answers a model's
  manifest (its `tensors` table of per-tensor hashes, config facts and the head files'
  hashes); ``hearthnet.weights.read`` answers one byte range (at most `MAX_READ_BYTES`) of
  one tensor or one head file of a model this node holds, checked before any read. Both
  are member-only: the daemon refuses an unauthenticated caller (`AuthError`) before the
  handler runs, and a non-member never gets past the listener's mutual TLS.
- **Fetching** (`WeightsFetcher`): given a model and what to fetch (layer ranges, the
  head), it takes the manifest from a holder, splits the tensors among every holder at
  once (`FetchPlan`: each holder's worker takes the next tensor that holder has), writes
  them at their place in one safetensors file of a staging folder, checks each tensor's
  sha256 before marking it done (``fetch.json``: a restart fetches only the missing ones),
  hands a dead holder's tensors to the others, and reports a holder whose bytes do not
  match (a warning naming it, ``hearthnet_weights_fetch_mismatches_total``) and asks it no
  more for this model. When every tensor is checked the file joins the model folder (a
  partial model, `models.store`) in one rename and one atomic manifest write.

The manifest's `tensors` table comes from the holders: it is as trusted as the members are
(up to three holders are asked and must give the same table, or the fetch stops; a full
store computes its table only from files that still hash to `weights_sha256`);
`weights_sha256` itself can be checked only by a node that holds every tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from hearthnet.errors import (
    BadRequest,
    HearthNetError,
    ModelNotFound,
    ModelStoreError,
    PeerDataError,
    ShardUnavailable,
    WeightsMismatch,
)
from hearthnet.mesh.bus import raise_for_error
from hearthnet.mesh.eventlog import EVENT_TYPES, Event, EventType
from hearthnet.models.hashing import GGML_METADATA, file_sha256, tensor_prefix
from hearthnet.models.store import (
    HEAD_FILES,
    IMPORTING,
    ModelEntry,
    ModelStore,
    decoder_prefix,
    layer_of,
    merge_ranges,
    select_tensors,
)
from hearthnet.observability import get_logger

log = get_logger("fetch")

MANIFEST_CAPABILITY = "hearthnet.weights.manifest"
READ_CAPABILITY = "hearthnet.weights.read"
WEIGHTS_CAPABILITIES = (MANIFEST_CAPABILITY, READ_CAPABILITY)
MAX_READ_BYTES = 4 << 20  # one read call's bytes (docs/protocol.md §weights)
FRAME_BYTES = 768 << 10  # one reply frame's data: under the bus's 1 MiB message limit
MAX_NAME = 512
MAX_RANGES = 256  # ranges in one read call (a layer's small tensors go together)
MANIFEST_QUORUM = 3  # holders whose tables are compared before a fetch
WORKERS_PER_HOLDER = 2  # calls in flight to one holder: a link's latency is overlapped
STALE_STAGING_S = 7 * 86400.0  # an unfinished fetch untouched this long is given up
STATE = "fetch.json"
DATA = "data.safetensors.partial"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# M26 §5.1: what each member holds of each model, superseded per (origin, model)
HELD = EVENT_TYPES.register(EventType(
    "experimental.model.held", lambda p: f"model.held:{p['weights_sha256']}",
    max_payload_bytes=4096, max_per_origin=256))

Call = Callable[[str, str, dict[str, Any]], AsyncIterator[dict[str, Any]]]
"""`call(node_id, capability, args)`: a bus call to a member (the daemon's, over mTLS)."""


# ---- what members hold ----

def held_payload(entry: ModelEntry, endpoint: str) -> dict[str, Any]:
    """The ``experimental.model.held`` payload of a stored model."""
    return {"model_id": entry.model_id, "alias": entry.alias,
            "weights_sha256": entry.weights_sha256, "num_layers": entry.num_layers,
            **entry.holdings(), "endpoint": endpoint}


@dataclass(frozen=True)
class Holding:
    """One member's holding of one model, from its newest held event."""

    node_id: str
    endpoint: str
    model_id: str
    alias: str
    weights_sha256: str
    num_layers: int
    layers: tuple[tuple[int, int], ...]
    head: bool

    def names(self, name: str) -> bool:
        return name in (self.model_id, self.alias, self.weights_sha256)

    def has(self, layer: int | None) -> bool:
        """Whether it holds decoder layer `layer` (None: the head)."""
        if layer is None:
            return self.head
        return any(lo <= layer <= hi for lo, hi in self.layers)


class HeldModels:
    """The read model of held events: who holds which layers of which model."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], Holding] = {}

    def rebuild(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.apply(ev)

    def apply(self, ev: Event) -> None:
        if ev.type != HELD:
            return
        p = ev.payload
        try:
            h = Holding(ev.origin, str(p["endpoint"]), str(p["model_id"]), str(p["alias"]),
                        str(p["weights_sha256"]), int(p["num_layers"]),
                        tuple((int(a), int(b)) for a, b in p.get("layers") or []),
                        bool(p.get("head")))
        except (KeyError, TypeError, ValueError):
            log.warning("held_event_malformed", origin=ev.origin)
            return
        if not h.endpoint.startswith(("ws://", "wss://")) or not _HEX64.match(h.weights_sha256):
            log.warning("held_event_malformed", origin=ev.origin)
            return
        if h.layers or h.head:
            self._held[(ev.origin, h.weights_sha256)] = h
        else:
            self._held.pop((ev.origin, h.weights_sha256), None)

    def all(self) -> list[Holding]:
        """Every member's holdings, by model then node."""
        return sorted(self._held.values(), key=lambda h: (h.alias, h.node_id))

    def holders(self, model: str, exclude: str = "") -> list[Holding]:
        """Every member's holding of `model` (alias, id or weights hash), but `exclude`'s."""
        return sorted((h for h in self._held.values() if h.names(model) and h.node_id != exclude),
                      key=lambda h: h.node_id)


# ---- serving ----

class WeightsService:
    """The two member-only capabilities that serve a stored model's bytes."""

    def __init__(self, store: ModelStore) -> None:
        self.store = store

    def _entry(self, args: Mapping[str, Any]) -> ModelEntry:
        sha = args.get("model")
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise BadRequest("weights calls name the model by its weights_sha256 "
                             "(64 lowercase hex digits)")
        for e in self.store.entries():
            if e.weights_sha256 == sha:
                return e
        raise ModelNotFound(f"this node holds no model with weights_sha256 {sha[:12]}…",
                            model=sha)

    async def manifest(self, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The model's manifest: config facts, `tensors` table, head files' hashes."""
        entry = self._entry(args)
        entry = await asyncio.to_thread(self.store.ensure_tensors, entry)
        files = {}
        for name in HEAD_FILES:
            f = entry.path / name
            if f.is_file():
                files[name] = {"sha256": await asyncio.to_thread(file_sha256, f),
                               "size": f.stat().st_size}
        data = entry.to_json()
        for k in ("path", "files", "holds"):
            data.pop(k, None)
        yield {"type": "manifest", "manifest": data, "files": files,
               "holds": entry.holdings()}

    def locate(self, entry: ModelEntry, rng: object) -> tuple[Path, int, int]:
        """(file, absolute offset, bytes) of one requested range; every limit checked
        before any read (DESIGN.md decision 5)."""
        if not isinstance(rng, dict):
            raise BadRequest("a range is a map {tensor or file, offset, length}")
        offset, length = rng.get("offset"), rng.get("length")
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 \
                or not 0 < length <= MAX_READ_BYTES:
            raise BadRequest(f"offset must be >= 0 and length 1..{MAX_READ_BYTES}")
        tensor, fname = rng.get("tensor"), rng.get("file")
        if isinstance(tensor, str) and len(tensor) <= MAX_NAME and fname is None:
            loc = entry.tensor_locations().get(tensor)
            if loc is None:
                raise ModelNotFound(f"this node holds no tensor {tensor[:128]!r} of "
                                    f"{entry.alias}", model=entry.alias)
            path, start, size = entry.path / loc[0], loc[1], loc[2]
        elif isinstance(fname, str) and fname in HEAD_FILES and tensor is None:
            path = entry.path / fname
            if not path.is_file():
                raise ModelNotFound(f"{entry.alias} has no file {fname!r} here")
            start, size = 0, path.stat().st_size
        else:
            raise BadRequest(f"name one `tensor` (a name up to {MAX_NAME} characters) or one "
                             f"`file` of {list(HEAD_FILES)}")
        if offset + length > size:
            raise BadRequest(f"range {offset}+{length} is past the end ({size} bytes)")
        return path, start + offset, length

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        """The bytes (run in a worker thread; a test wraps it to slow or alter a serve)."""
        with path.open("rb") as f:
            data = os.pread(f.fileno(), length, offset)
        if len(data) != length:
            raise WeightsMismatch(f"{path}: truncated weights file", file=str(path))
        return data

    async def read(self, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Byte ranges of tensors or head files (`MAX_RANGES`, `MAX_READ_BYTES` in all),
        in frames of at most `FRAME_BYTES`: ``{type: bytes, range, offset, data}``."""
        entry = self._entry(args)
        ranges = args.get("ranges")
        if not isinstance(ranges, list) or not 0 < len(ranges) <= MAX_RANGES:
            raise BadRequest(f"`ranges` is a list of 1..{MAX_RANGES} ranges")
        where = [self.locate(entry, r) for r in ranges]
        if sum(n for _, _, n in where) > MAX_READ_BYTES:
            raise BadRequest(f"a read asks for at most {MAX_READ_BYTES} bytes in all")
        await asyncio.to_thread(entry.check_files)  # a changed file is never served
        for i, (path, offset, length) in enumerate(where):
            data = await asyncio.to_thread(self.read_range, path, offset, length)
            first = int(ranges[i]["offset"])
            for k in range(0, len(data), FRAME_BYTES):
                yield {"type": "bytes", "range": i, "offset": first + k,
                       "data": data[k:k + FRAME_BYTES]}


# ---- planning (pure) ----

class FetchPlan:
    """Which tensor each holder fetches next: a shared queue that each holder's workers
    take from (only tensors that holder has), so several holders fetch at once and a
    fast one takes more. A holder that died or served bad bytes is dropped and what it
    had in hand goes back to the queue for the others."""

    def __init__(self, todo: Sequence[str], has: Mapping[str, Callable[[str], bool]]) -> None:
        self.todo = list(todo)  # in order: big and small tensors as the table lists them
        self.has = dict(has)  # holder -> whether it holds a tensor
        self.taken: dict[str, str] = {}  # tensor -> holder fetching it
        self.done: set[str] = set()
        self.dropped: dict[str, str] = {}  # holder -> why

    def take(self, holder: str, sizes: Mapping[str, int] | None = None,
             budget: int = MAX_READ_BYTES) -> list[str]:
        """The next tensors for `holder` (empty when none is left for it): the first one
        it has, then — with `sizes` — the following ones it has while they fit in
        `budget` bytes together (one read call)."""
        out: list[str] = []
        if holder in self.dropped:
            return out
        total = 0
        for name in self.todo:
            if name in self.taken or not self.has[holder](name):
                continue
            n = sizes[name] if sizes else 0
            if out and (sizes is None or total + n > budget or len(out) >= MAX_RANGES):
                break
            self.taken[name] = holder
            out.append(name)
            total += n
            if sizes is None:
                break
        return out

    def finish(self, name: str) -> None:
        """`name` is checked and kept (a second finish of it, by a holder that had it in
        hand when the first was dropped, changes nothing)."""
        self.taken.pop(name, None)
        if name in self.todo:
            self.todo.remove(name)
        self.done.add(name)

    def drop(self, holder: str, why: str) -> list[str]:
        """Stop asking `holder`; its tensors in hand go back; returns them."""
        self.dropped[holder] = why
        back = [n for n, h in self.taken.items() if h == holder]
        for n in back:
            del self.taken[n]
        return back

    def give_back(self, name: str, holder: str) -> None:
        """`holder` did not finish `name`: it goes back to the queue (unless another
        holder has it in hand by now)."""
        if self.taken.get(name) == holder:
            del self.taken[name]

    def orphans(self) -> list[str]:
        """Tensors left that no remaining holder has."""
        live = [h for h in self.has if h not in self.dropped]
        return [n for n in self.todo if not any(self.has[h](n) for h in live)]


def staging_key(sha: str, names: Sequence[str]) -> str:
    """What a staging folder is filled for: a restart with the same request resumes."""
    return hashlib.sha256((sha + "\0" + "\0".join(names)).encode()).hexdigest()[:16]


def safetensors_header(table: Mapping[str, Mapping[str, Any]], names: Sequence[str]
                       ) -> tuple[bytes, dict[str, int]]:
    """The header of a safetensors file holding `names` (ascending) as the table describes
    them, and each tensor's absolute data offset in the file."""
    meta: dict[str, str] = {"format": "pt"}
    ggml = {}
    header: dict[str, Any] = {}
    off = 0
    rel: dict[str, int] = {}
    for n in names:
        rec = table[n]
        st_dtype, _, ggml_type = str(rec["dtype"]).partition(":")
        if ggml_type:
            ggml[n] = {"type": ggml_type, "shape": list(rec.get("logical_shape") or [])}
        header[n] = {"dtype": st_dtype, "shape": list(rec["shape"]),
                     "data_offsets": [off, off + int(rec["bytes"])]}
        rel[n] = off
        off += int(rec["bytes"])
    if ggml:
        meta[GGML_METADATA] = json.dumps(ggml, separators=(",", ":"))
    raw = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, {n: len(head) + o for n, o in rel.items()}


# ---- progress ----

@dataclass
class FetchStatus:
    """One fetch, as `/api/status` shows it (``fetches``)."""

    model: str
    layers: list[int] | None
    head: bool
    bytes_total: int = 0
    bytes_done: int = 0
    sources: list[str] = field(default_factory=list)
    state: str = "fetching"  # fetching | verifying | done | failed
    detail: str = ""
    started: float = field(default_factory=time.monotonic)
    _logged_tenth: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "layers": self.layers, "head": self.head,
                "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                "sources": list(self.sources), "state": self.state, "detail": self.detail}

    def add(self, n: int) -> None:
        self.bytes_done += n
        tenth = self.bytes_done * 10 // max(1, self.bytes_total)
        if tenth > self._logged_tenth and tenth < 10:
            self._logged_tenth = tenth
            log.info("weights_fetch_progress", model=self.model, layers=self.layers,
                     head=self.head, bytes_done=self.bytes_done, bytes_total=self.bytes_total,
                     percent=tenth * 10, mb_per_s=self.rate())

    def rate(self) -> float:
        return round(self.bytes_done / max(1e-6, time.monotonic() - self.started) / 1e6, 2)


class _BadBytes(Exception):
    """A holder's bytes did not match the tensor's hash."""


# ---- fetching ----

def remove_stale_staging(root: Path, now: float, max_age_s: float = STALE_STAGING_S
                         ) -> list[str]:
    """Remove the staging folders of fetches untouched for `max_age_s` (a fetch for a
    placement that never came back: its bytes would fill the disk unseen, since `models
    list` hides folders being written); the names removed. A fetch asked for again within
    the age resumes from its folder instead (`_fill`)."""
    gone = []
    for d in root.glob(f"*.fetch-*{IMPORTING}"):
        try:
            touched = max([d.stat().st_mtime,
                           *(f.stat().st_mtime for f in d.iterdir() if f.is_file())])
        except OSError:
            continue  # removed meanwhile
        if now - touched > max_age_s:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    return gone


class WeightsFetcher:
    """Fetches parts of models from members into this node's store (module docstring)."""

    def __init__(self, store: ModelStore, held: HeldModels, call: Call, *, node_id: str,
                 registry: CollectorRegistry | None = None,
                 on_stored: Callable[[ModelEntry], None] | None = None,
                 batch_bytes: int = MAX_READ_BYTES, settle_s: float = 1.0) -> None:
        """`batch_bytes`: the most bytes of small tensors one read call asks for;
        `settle_s`: how long to listen for more holders once one is known."""
        self.settle_s = settle_s
        self.rate: float | None = None  # bytes/s of the last fetch (automatic hosting plans)
        self.store, self.held, self.call, self.node_id = store, held, call, node_id
        self.batch_bytes = min(batch_bytes, MAX_READ_BYTES)
        self.on_stored = on_stored
        self.fetches: list[FetchStatus] = []
        self.bad: dict[str, set[str]] = {}  # weights_sha256 -> holders never asked again
        self._lock = asyncio.Lock()  # one fetch writes the store at a time
        self.mismatches = Counter("hearthnet_weights_fetch_mismatches_total",
                                  "Tensors a member served whose bytes did not match the "
                                  "model's tensors table", ["peer"], registry=registry)
        self.fetched = Counter("hearthnet_weights_fetched_bytes_total",
                               "Weights bytes fetched from members", ["peer"],
                               registry=registry)

    def status(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.fetches]

    def needs(self, model: str, lo: int, hi: int, head: bool) -> bool:
        """Whether hosting `[lo, hi]` of `model` (and the head) needs a fetch."""
        e = self.store.find(model)
        return e is None or bool(e.missing_layers(lo, hi)) or (head and not e.holds_head)

    async def fetch(self, model: str, layers: Sequence[tuple[int, int]], head: bool,
                    *, wait_s: float = 60.0) -> ModelEntry:
        """Fetch `layers` (inclusive ranges) and the head of `model` (alias, id or weights
        hash) into the store; returns the model's entry. Waits up to `wait_s` for a member
        that holds it to be known.

        Raises:
            ShardUnavailable: no member holds what is needed (or every one failed).
            BadRequest: a range outside the model.
        """
        st = FetchStatus(model, [layers[0][0], layers[-1][1]] if layers else None, head)
        # an earlier try of the same fetch (failed, retried) is replaced by this one
        self.fetches = [f for f in self.fetches[-19:]
                        if (f.layers, f.head) != (st.layers, head)
                        or f.state in ("fetching", "verifying")]
        self.fetches.append(st)
        try:
            async with self._lock:
                try:
                    entry = await self._fetch(st, model, merge_ranges(layers), head, wait_s)
                except OSError as e:  # the store's disk: full, read-only, removed
                    raise ModelStoreError(f"cannot write the fetched weights into "
                                          f"{self.store.root}: {e.strerror or e}") from e
        except HearthNetError as e:
            st.state, st.detail = "failed", e.message[:300]
            log.warning("weights_fetch_failed", model=model, code=e.code, message=e.message)
            raise
        st.state = "done"
        return entry

    async def _holders(self, model: str, wait_s: float) -> list[Holding]:
        """The members holding `model`: once one is known, `settle_s` more for the event
        log's catch-up to name the others (a fetch is split among all of them)."""
        deadline = time.monotonic() + wait_s
        while not self.held.holders(model, exclude=self.node_id):
            if time.monotonic() >= deadline:
                return []
            await asyncio.sleep(0.2)
        await asyncio.sleep(self.settle_s)
        return self.held.holders(model, exclude=self.node_id)

    async def _fetch(self, st: FetchStatus, model: str, layers: list[tuple[int, int]],
                     head: bool, wait_s: float) -> ModelEntry:
        holders = await self._holders(model, wait_s)
        if not holders:
            raise ShardUnavailable(f"no member holds model {model!r} to fetch it from",
                                   model=model)
        sha = holders[0].weights_sha256
        holders = [h for h in holders if h.weights_sha256 == sha
                   and h.node_id not in self.bad.get(sha, set())]
        manifest, files = await self._manifest(sha, holders)
        n = int(manifest["num_layers"])
        for lo, hi in layers:
            if not 0 <= lo <= hi < n:
                raise BadRequest(f"layers [{lo}, {hi}] are outside {model}'s 0..{n - 1}")
        local = self.store.find(sha)
        if local is not None and not local.partial:
            return local
        table: dict[str, dict[str, Any]] = manifest["tensors"]
        have = set(local.tensor_locations()) if local is not None else set()
        names = [x for x in select_tensors(table, layers, head) if x not in have]
        st.bytes_total = sum(int(table[x]["bytes"]) for x in names)
        st.model = str(manifest["alias"])
        log.info("weights_fetch_started", model=st.model, layers=st.layers, head=head,
                 tensors=len(names), bytes_total=st.bytes_total,
                 holders=[h.node_id for h in holders])
        stage = self.store.root / f"{manifest['alias']}.fetch-{staging_key(sha, names)}{IMPORTING}"
        stage.mkdir(parents=True, exist_ok=True)
        if names:
            await self._fill(st, stage, sha, table, names, holders)
        # a shard reads the config; a head the tokenizer and templates too (HEAD_FILES)
        want = {n: r for n, r in files.items()
                if (head or n == "config.json") and n in HEAD_FILES
                and (local is None or not (local.path / n).is_file())}
        await self._head_files(stage, sha, want, holders)
        st.state = "verifying"
        if st.bytes_done:
            self.rate = st.bytes_done / max(1e-6, time.monotonic() - st.started)
        entry = await asyncio.to_thread(self._publish, stage, manifest, local, names, layers,
                                        head)
        # every layer and the head: checked as a whole against weights_sha256 too
        entry = await asyncio.to_thread(self.store.complete, entry)
        log.info("weights_fetch_done", model=st.model, layers=st.layers, head=head,
                 bytes=st.bytes_done, mb_per_s=st.rate(), sources=st.sources)
        if self.on_stored is not None:
            self.on_stored(entry)
        return entry

    async def _manifest(self, sha: str, holders: Sequence[Holding]
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The manifest of the first holder that answers; every other holder that answers
        (up to `MANIFEST_QUORUM` in all) must give the same `tensors` table, or the fetch
        stops naming both (the table is what every byte is checked against)."""
        got: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        for h in holders:
            if len(got) >= MANIFEST_QUORUM:
                break
            try:
                frames = [f async for f in self.call(h.node_id, MANIFEST_CAPABILITY,
                                                     {"model": sha})]
                for f in frames:
                    raise_for_error(f)
                m = frames[0]["manifest"]
                if not isinstance(m, dict) or m.get("weights_sha256") != sha \
                        or not isinstance(m.get("tensors"), dict):
                    raise PeerDataError(f"{h.node_id} sent a manifest of another model")
                got.append((h.node_id, m, dict(frames[0].get("files") or {})))
            except (HearthNetError, KeyError, IndexError, TypeError) as e:
                log.warning("weights_manifest_failed", peer=h.node_id,
                            error=getattr(e, "message", type(e).__name__))
        if not got:
            raise ShardUnavailable(f"no holder of {sha[:12]}… answered with its manifest")
        first, manifest, files = got[0]
        for other, m, _ in got[1:]:
            if m["tensors"] != manifest["tensors"]:
                raise PeerDataError(f"{first} and {other} give different tensors tables for "
                                    f"{sha[:12]}…; remove the wrong copy (`hearthnet models "
                                    f"verify`) and fetch again", peers=[first, other])
        return manifest, files

    async def _fill(self, st: FetchStatus, stage: Path, sha: str,
                    table: Mapping[str, Mapping[str, Any]], names: list[str],
                    holders: list[Holding]) -> None:
        """Fetch `names` into the staging file, resuming what an earlier run checked."""
        head, offsets = safetensors_header(table, names)
        data, state_file = stage / DATA, stage / STATE
        done: set[str] = set()
        if data.is_file() and state_file.is_file():
            with contextlib.suppress(ValueError, OSError):
                saved = json.loads(state_file.read_text())
                with data.open("rb") as f:
                    if f.read(len(head)) == head:
                        done = set(saved.get("done", [])) & set(names)
        if not done:
            with data.open("wb") as out:
                out.write(head)
                out.truncate(len(head) + sum(int(table[n]["bytes"]) for n in names))
        if done:  # checked again from the disk: a power cut may have lost a write
            done = await asyncio.to_thread(_still_good, data, table, offsets, done)
        st.bytes_done = sum(int(table[n]["bytes"]) for n in done)
        if done:
            log.info("weights_fetch_resumed", model=st.model, tensors_done=len(done),
                     bytes_done=st.bytes_done)
        todo = [n for n in names if n not in done]
        sizes = {n: int(table[n]["bytes"]) for n in names}
        plan = FetchPlan(todo, {h.node_id: _holds_fn(h, list(table)) for h in holders})
        by_id = {h.node_id: h for h in holders}
        fd = os.open(data, os.O_RDWR)
        try:
            async def worker(holder: str) -> None:
                while batch := plan.take(holder, sizes, self.batch_bytes):
                    try:
                        good, bad = await self._batch(fd, sha, holder, batch, table,
                                                      offsets, st)
                    except HearthNetError as e:
                        for name in batch:
                            plan.give_back(name, holder)
                        plan.drop(holder, e.code)
                        log.warning("weights_fetch_holder_lost", peer=holder, code=e.code,
                                    message=e.message[:200])
                        return
                    for name in good:
                        plan.finish(name)
                        done.add(name)
                    if good:
                        if holder not in st.sources:
                            st.sources.append(holder)
                        self.fetched.labels(holder).inc(sum(sizes[n] for n in good))
                        _save_state(state_file, done)  # a few KB, in the loop: one writer
                    if bad:
                        for name in bad:
                            plan.give_back(name, holder)
                        plan.drop(holder, "bad bytes")
                        self.bad.setdefault(sha, set()).add(holder)
                        return

            await asyncio.gather(*(worker(h) for h in by_id
                                   for _ in range(WORKERS_PER_HOLDER)))
            await asyncio.to_thread(os.fsync, fd)  # on disk before it joins the model
        finally:
            os.close(fd)
        if plan.todo:
            why = ", ".join(f"{h}: {w}" for h, w in plan.dropped.items()) or "none held them"
            raise ShardUnavailable(f"{len(plan.todo)} tensors of {st.model} could not be "
                                   f"fetched ({why}); run again to resume",
                                   model=st.model, missing=len(plan.todo))

    async def _batch(self, fd: int, sha: str, holder: str, batch: list[str],
                     table: Mapping[str, Mapping[str, Any]], offsets: Mapping[str, int],
                     st: FetchStatus) -> tuple[list[str], list[str]]:
        """Fetch `batch` from `holder` (one call, or a big tensor in `MAX_READ_BYTES`
        ranges), writing each tensor at its offset; returns (tensors whose sha256 matched,
        tensors whose bytes did not). A call that fails raises; what it had fetched of the
        batch is fetched again elsewhere from the beginning."""
        hashes = {n: hashlib.sha256(tensor_prefix(n, str(table[n]["dtype"]), table[n]["shape"]))
                  for n in batch}
        got = dict.fromkeys(batch, 0)
        try:
            if len(batch) == 1:  # possibly bigger than one read: ranges in turn
                name = batch[0]
                size = int(table[name]["bytes"])
                while got[name] < size:
                    n = min(MAX_READ_BYTES, size - got[name])
                    await self._read(fd, sha, holder, [(name, got[name], n)], offsets,
                                     hashes, got, st)
            else:
                await self._read(fd, sha, holder,
                                 [(n, 0, int(table[n]["bytes"])) for n in batch],
                                 offsets, hashes, got, st)
        except BaseException:
            st.add(-sum(got.values()))  # a batch cut off starts again elsewhere
            raise
        good = [n for n in batch if hashes[n].hexdigest() == table[n]["sha256"]]
        bad = [n for n in batch if n not in good]
        for name in bad:
            st.add(-got[name])
            self.mismatches.labels(holder).inc()
            log.warning("weights_fetch_mismatch", peer=holder, tensor=name, model=sha[:12],
                        action="not asked again for this model")
        return good, bad

    async def _read(self, fd: int, sha: str, holder: str,
                    ranges: list[tuple[str, int, int]], offsets: Mapping[str, int],
                    hashes: Mapping[str, Any], got: dict[str, int], st: FetchStatus) -> None:
        """One read call: each range's bytes in order, written and hashed as they come."""
        ends = [off + n for _, off, n in ranges]
        args = {"model": sha, "ranges": [{"tensor": name, "offset": off, "length": n}
                                         for name, off, n in ranges]}
        async for f in self.call(holder, READ_CAPABILITY, args):
            raise_for_error(f)
            i, chunk = f.get("range"), f.get("data")
            if f.get("type") != "bytes" or not isinstance(i, int) or not 0 <= i < len(ranges) \
                    or not isinstance(chunk, bytes):
                raise PeerDataError(f"{holder} sent a malformed weights frame")
            name = ranges[i][0]
            if f.get("offset") != got[name] or got[name] + len(chunk) > ends[i]:
                raise PeerDataError(f"{holder} sent bytes out of order")
            await asyncio.to_thread(os.pwrite, fd, chunk, offsets[name] + got[name])
            hashes[name].update(chunk)
            got[name] += len(chunk)
            st.add(len(chunk))
        if any(got[name] != ends[i] for i, (name, _, _) in enumerate(ranges)):
            raise PeerDataError(f"{holder} sent fewer bytes than asked")

    async def _head_files(self, stage: Path, sha: str, files: Mapping[str, Any],
                          holders: Sequence[Holding]) -> None:
        """The config and tokenizer files (checked against the manifest's hashes)."""
        for name, rec in files.items():
            if name not in HEAD_FILES:
                continue
            size, want = int(rec["size"]), str(rec["sha256"])
            target = stage / name
            if target.is_file() and file_sha256(target) == want:
                continue
            for h in holders:
                if h.node_id in self.bad.get(sha, set()):
                    continue
                try:
                    buf = bytearray()
                    while len(buf) < size:
                        async for f in self.call(h.node_id, READ_CAPABILITY, {
                                "model": sha, "ranges": [{
                                    "file": name, "offset": len(buf),
                                    "length": min(MAX_READ_BYTES, size - len(buf))}]}):
                            raise_for_error(f)
                            buf += f["data"]
                    if hashlib.sha256(buf).hexdigest() != want:
                        raise PeerDataError(f"{h.node_id} sent {name} with another hash")
                    target.write_bytes(bytes(buf))
                    self.fetched.labels(h.node_id).inc(len(buf))
                    break
                except (HearthNetError, KeyError, TypeError) as e:
                    log.warning("weights_fetch_file_failed", peer=h.node_id, file=name,
                                error=getattr(e, "message", type(e).__name__))
            else:
                raise ShardUnavailable(f"no holder served {name} of {sha[:12]}…")

    def _publish(self, stage: Path, manifest: Mapping[str, Any], local: ModelEntry | None,
                 names: list[str], layers: list[tuple[int, int]], head: bool) -> ModelEntry:
        """Move the checked file into the model folder and write its manifest (atomic)."""
        span = "-".join(f"{lo}_{hi}" for lo, hi in layers) or "none"
        fname = f"fetched-{span}{'-head' if head else ''}.safetensors"
        if local is not None:
            folder = local.path
            held = {"layers": [*local.held_layers, *layers],
                    "head": local.holds_head or head}
            if names:
                (stage / DATA).replace(folder / fname)
            for f in HEAD_FILES:
                if (stage / f).is_file():
                    (stage / f).replace(folder / f)
            entry = self.store.write_partial(folder, manifest, held)
            shutil.rmtree(stage, ignore_errors=True)
            return entry
        if names:
            (stage / DATA).replace(stage / fname)
        (stage / STATE).unlink(missing_ok=True)
        self.store.write_partial(stage, manifest, {"layers": layers, "head": head})
        alias = str(manifest["alias"])
        taken = self.store.find(alias)
        if taken is not None and taken.weights_sha256 != manifest["weights_sha256"]:
            alias = f"{alias}-{str(manifest['weights_sha256'])[:8]}"
        folder = self.store.root / alias
        stage.rename(folder)
        return ModelEntry.load(folder)


def _holds_fn(h: Holding, names: Sequence[str]) -> Callable[[str], bool]:
    """Whether holder `h` has a tensor (of the model's `names`), by its layer."""
    prefix = decoder_prefix(names)
    return lambda n: h.has(layer_of(n, prefix))


def _still_good(data: Path, table: Mapping[str, Mapping[str, Any]],
                offsets: Mapping[str, int], done: set[str]) -> set[str]:
    """The tensors of `done` whose bytes in the staging file still match their hash."""
    good = set()
    with data.open("rb") as f:
        for name in done:
            rec = table[name]
            h = hashlib.sha256(tensor_prefix(name, str(rec["dtype"]), rec["shape"]))
            f.seek(offsets[name])
            left = int(rec["bytes"])
            while left > 0 and (chunk := f.read(min(left, 8 << 20))):
                h.update(chunk)
                left -= len(chunk)
            if h.hexdigest() == rec["sha256"]:
                good.add(name)
    return good


def _save_state(path: Path, done: set[str]) -> None:
    """The checked tensors, written atomically (a restart resumes after them). Not
    fsynced: a killed process loses nothing the kernel holds; a power cut may cost a
    re-fetch (the tensor is checked again before use either way)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"done": sorted(done)}))
    tmp.replace(path)
