"""`hearthnet models pull NAME`: a model by name, from where a household already keeps models.

NAME is looked up in this order, and the first source that has it wins:

1. a local Ollama store (`$OLLAMA_MODELS`, else ~/.ollama/models): `qwen2.5:0.5b` (tag
   `latest` when absent) names a manifest whose model layer is a GGUF blob, checked
   against its sha256 digest before it is imported;
2. the Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`, else
   ~/.cache/huggingface/hub): `org/name` is the snapshot `refs/main` names, a folder of
   safetensors + config.json, or its only GGUF (`org/name:file.gguf` picks one of several);
3. LM Studio's folder (~/.lmstudio/models, or the older ~/.cache/lm-studio/models):
   `publisher/repo` (its only GGUF) or `publisher/repo:file.gguf`;
4. a URL of a `.gguf` file, downloaded into the store's hidden staging folder with
   HTTP Range, so an interrupted download resumes where it stopped;
5. a Hugging Face repo id, downloaded with `huggingface_hub` (which honours `HF_ENDPOINT`
   and resumes its own partial files): the config, tokenizer and safetensors files, or one
   GGUF (`org/repo:file.gguf`, or the repo's only GGUF).

What is found is imported by the importer exactly as `models import PATH` imports it
(`import_gguf`, `import_folder`: same progress bar, same resumable staging), so a model
pulled by name has the `weights_sha256` of the same file imported by path. A name no
source has is a one-line `ModelNotFound` naming the nearest known name.

This is the one module of `models/` that reaches the network, and only to fetch a file the
user named (a URL, the hub); it knows nothing of the mesh.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from hearthnet.constants import DEFAULT_GGUF_DTYPE
from hearthnet.errors import BadRequest, ModelNotFound, ModelStoreError, WeightsMismatch
from hearthnet.models.progress import progress_bar
from hearthnet.models.store import IMPORTING, ModelEntry, ModelStore

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_LIBRARY = "library"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
# what `import_folder` copies (config, tokenizer, weights): nothing else is downloaded
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "*.jinja"]
DOWNLOADS = ".downloads" + IMPORTING  # hidden from `models list` like an import under way
_CHUNK = 1 << 20
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True, slots=True)
class Found:
    """A model one source offers, as `pull` imports it."""

    source: str  # ollama | hf-cache | lmstudio | url | hub
    name: str  # the name `pull` accepts for it
    path: Path  # a GGUF file, or a Hugging Face folder (config.json + *.safetensors)
    model_id: str
    gguf: bool
    sha256: str | None = None  # the digest the source names the file by (Ollama's blobs)


# -- where each source lives ------------------------------------------------------------------

def ollama_dir() -> Path:
    """Ollama's model store: `$OLLAMA_MODELS`, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, found as `huggingface_hub` finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "huggingface" / "hub"


def lmstudio_dirs() -> list[Path]:
    """LM Studio's model folders, current then older layout."""
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


# -- what each local source offers ------------------------------------------------------------

def ollama_models(root: Path | None = None) -> list[Found]:
    """Every Ollama manifest whose model layer's blob is present.

    Names are Ollama's own: `name:tag` in the library, `user/name:tag` elsewhere on the
    registry, `host/user/name:tag` on another registry.
    """
    root = root or ollama_dir()
    out = []
    for m in sorted((root / "manifests").glob("*/*/*/*")):
        host, ns, model, tag = m.relative_to(root / "manifests").parts
        if host == OLLAMA_REGISTRY:
            name = f"{model}:{tag}" if ns == OLLAMA_LIBRARY else f"{ns}/{model}:{tag}"
        else:
            name = f"{host}/{ns}/{model}:{tag}"
        try:
            layers = json.loads(m.read_text()).get("layers", [])
            digest = next(str(x["digest"]) for x in layers
                          if x.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, AttributeError, KeyError, StopIteration):
            continue  # not a model manifest (or unreadable): Ollama itself could not run it
        algo, _, hexdigest = digest.partition(":")
        blob = root / "blobs" / f"{algo}-{hexdigest}"
        if algo == "sha256" and blob.is_file():
            out.append(Found("ollama", name, blob, name, gguf=True, sha256=hexdigest))
    return out


def hf_cache_models(root: Path | None = None) -> list[Found]:
    """Every cached model snapshot (the revision `refs/main` names, else the newest): a
    folder with config.json and safetensors as `org/name`, each GGUF as
    `org/name:file.gguf` and, when it is the only weights, as `org/name`."""
    root = root or hf_cache_dir()
    out = []
    for d in sorted(root.glob("models--*")):
        repo = "/".join(d.name.split("--")[1:])
        snap = _snapshot(d)
        if snap is None:
            continue
        folder = (snap / "config.json").is_file() and any(snap.glob("*.safetensors"))
        if folder:
            out.append(Found("hf-cache", repo, snap, repo, gguf=False))
        out += _ggufs("hf-cache", repo, sorted(snap.rglob("*.gguf")), bare=not folder, root=snap)
    return out


def _snapshot(repo_dir: Path) -> Path | None:
    ref = repo_dir / "refs" / "main"
    with contextlib.suppress(OSError):
        snap = repo_dir / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted(repo_dir.glob("snapshots/*"), key=lambda p: p.stat().st_mtime_ns)
    return snaps[-1] if snaps else None


def lmstudio_models(roots: list[Path] | None = None) -> list[Found]:
    """Every GGUF under LM Studio's `<publisher>/<repo>/` folders (vision projectors,
    `mmproj-*`, are no language model)."""
    out = []
    for root in roots if roots is not None else lmstudio_dirs():
        for d in sorted(p for p in root.glob("*/*") if p.is_dir()):
            files = sorted(f for f in d.glob("*.gguf") if not f.name.startswith("mmproj"))
            out += _ggufs("lmstudio", f"{d.parent.name}/{d.name}", files, bare=True, root=d)
    return out


def _ggufs(source: str, repo: str, files: list[Path], *, bare: bool, root: Path) -> list[Found]:
    """`repo:file.gguf` for each file, and `repo` itself when it holds only one."""
    out = [Found(source, f"{repo}:{f.relative_to(root).as_posix()}", f, repo, gguf=True)
           for f in files if f.is_file()]
    if bare and len(out) == 1:
        out.append(Found(source, repo, out[0].path, repo, gguf=True))
    return out


def local_models() -> dict[str, list[Found]]:
    """What each local source offers, in lookup order (`models pull --list`)."""
    return {"ollama": ollama_models(), "hf-cache": hf_cache_models(),
            "lmstudio": lmstudio_models()}


def find_local(name: str, offers: dict[str, list[Found]] | None = None) -> Found | None:
    """The first local source's model called `name` (case-insensitive, as the hub's ids;
    an Ollama name without a tag is its `latest`)."""
    offers = offers if offers is not None else local_models()
    wanted = {name.lower()}
    if ":" not in name:
        wanted.add(f"{name}:latest".lower())
    for found in offers.values():
        for f in found:
            if f.name.lower() in wanted:
                return f
    return None


# -- downloads --------------------------------------------------------------------------------

def download_url(url: str, folder: Path) -> Path:
    """Download the GGUF at `url` into `folder`, resuming a partial file from an earlier
    run with an HTTP Range request (and `If-Range`, so a file changed on the server since
    is fetched again whole). Returns the complete file.

    Raises:
        BadRequest: the URL does not name a `.gguf` file.
        ModelNotFound: the server answers 404.
        ModelStoreError: the download failed or was cut short; the bytes received are
            kept and the same command resumes from them.
    """
    fname = Path(urllib.parse.urlsplit(url).path).name
    if not fname.endswith(".gguf"):
        raise BadRequest(f"{url}: a URL must name a .gguf file (a folder or a page is not "
                         f"imported); for a Hugging Face repo give its id, `org/name`")
    key = hashlib.sha256(url.encode()).hexdigest()[:12]
    dest = folder / f"{key}-{fname}"
    if dest.is_file():
        return dest  # downloaded whole by an earlier run whose import did not finish
    folder.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".partial")
    validator_file = dest.with_name(dest.name + ".validator")
    have = part.stat().st_size if part.is_file() else 0
    req = urllib.request.Request(url)
    if have:
        req.add_header("Range", f"bytes={have}-")
        with contextlib.suppress(OSError):
            req.add_header("If-Range", validator_file.read_text())
    try:
        resp = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have and _complete_range(e.headers.get("Content-Range"), have):
            part.replace(dest)  # the partial file was whole: only its rename was missing
            return dest
        if e.code == 404:
            raise ModelNotFound(f"{url}: the server has no such file (HTTP 404)") from e
        raise ModelStoreError(f"{url}: download refused (HTTP {e.code} {e.reason})") from e
    except (urllib.error.URLError, OSError, HTTPException) as e:
        raise ModelStoreError(f"{url}: cannot download ({_reason(e)})") from e
    with resp:
        if resp.status != 206:
            have = 0  # no range (or the file changed): from the start
        elif not str(resp.headers.get("Content-Range", "")).startswith(f"bytes {have}-"):
            part.unlink()  # another range than asked for: never append it
            raise ModelStoreError(f"{url}: the server answered another byte range than "
                                  f"asked; run the same command again to download it whole")
        total = have + int(resp.headers.get("Content-Length") or 0)
        etag = resp.headers.get("ETag")
        # If-Range takes a strong validator only: a weak ETag falls back to the date
        validator = etag if etag and not etag.startswith("W/") else resp.headers.get(
            "Last-Modified")
        if validator:
            validator_file.write_text(validator)
        with progress_bar(total, f"download {fname}") as bar, \
                part.open("ab" if have else "wb") as out:
            bar.update(have)
            try:
                while chunk := resp.read(_CHUNK):
                    out.write(chunk)
                    have += len(chunk)
                    bar.update(len(chunk))
            except (OSError, HTTPException) as e:
                raise _interrupted(url, have, total, e) from e
    if total and have < total:
        raise _interrupted(url, have, total, None)
    part.replace(dest)
    validator_file.unlink(missing_ok=True)
    return dest


def _complete_range(content_range: str | None, have: int) -> bool:
    """Whether a 416's `Content-Range: bytes */N` says the file is `have` bytes long."""
    return bool(content_range) and content_range == f"bytes */{have}"


def _interrupted(url: str, have: int, total: int, cause: BaseException | None) -> ModelStoreError:
    why = f" ({_reason(cause)})" if cause else ""
    return ModelStoreError(f"{url}: download interrupted after {have / 2**20:.1f} of "
                           f"{total / 2**20:.1f} MB{why}; run the same command again to "
                           f"resume")


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


def hub_download(name: str, folder: Path) -> Found | None:
    """Download `org/repo` (its config, tokenizer and safetensors) or one GGUF of it
    (`org/repo:file.gguf`, or the repo's only GGUF) with `huggingface_hub` into
    `folder`. `HF_ENDPOINT` names the hub (read now, so a test or a mirror set after
    start-up is honoured). Returns None when the hub has no such repo.

    Raises:
        ModelNotFound: the repo has no file of that name, or several GGUFs and no safetensors.
        ModelStoreError: the hub cannot be reached or refuses.
    """
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    repo, _, filename = name.partition(":")
    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = endpoint or "the Hugging Face hub"
    target = folder / repo.replace("/", "--")
    try:
        # one request, no retries: an unreachable hub is said at once (its listing call
        # retries for 23 s); the same route `snapshot_download` asks first
        info = HfApi(endpoint=endpoint).model_info(repo)
    except RepositoryNotFoundError:
        return None  # also a private or gated repo: to the user, not there
    except Exception as e:  # huggingface_hub's HTTP client's errors are no OSError
        raise ModelStoreError(f"{repo}: cannot reach {where} ({type(e).__name__}: {e}); "
                              f"check the network (HF_ENDPOINT names a mirror)") from e
    files = [s.rfilename for s in info.siblings or []]
    whole = not filename and "config.json" in files and any(
        f.endswith(".safetensors") for f in files)
    if not filename and not whole:
        ggufs = [f for f in files if f.endswith(".gguf")
                 and not Path(f).name.startswith("mmproj")]
        if len(ggufs) != 1:
            some = ", ".join(f"{repo}:{f}" for f in ggufs[:6]) or "none"
            raise ModelNotFound(f"{repo} on {where} has no safetensors model and "
                                f"{len(ggufs)} GGUF files; name one: {some}")
        filename = ggufs[0]
    elif filename and filename not in files:
        raise ModelNotFound(f"{repo} on {where} has no file {filename!r}")
    try:
        if whole:
            path = snapshot_download(repo, local_dir=target, allow_patterns=HUB_PATTERNS,
                                     endpoint=endpoint, revision=info.sha)
            return Found("hub", repo, Path(str(path)), repo, gguf=False)
        path = hf_hub_download(repo, filename, local_dir=target, endpoint=endpoint,
                               revision=info.sha)
        return Found("hub", f"{repo}:{filename}", Path(str(path)), repo, gguf=True)
    except Exception as e:  # as above; huggingface_hub keeps what it received
        raise ModelStoreError(f"{repo}: download from {where} failed ({type(e).__name__}: "
                              f"{e}); run the same command again to resume") from e


# -- the command ------------------------------------------------------------------------------

def default_alias(name: str) -> str:
    """The store alias a pulled NAME gets: its last part, lower case, with `:` and `/` as
    `-` (`qwen2.5:0.5b` -> `qwen2.5-0.5b`, `org/Name` -> `name`, `org/r:F.gguf` -> `f`)."""
    if "://" in name:
        return Path(urllib.parse.urlsplit(name).path).stem.lower()
    repo, _, filename = name.partition(":")
    if filename.endswith(".gguf"):
        return Path(filename).stem.lower()
    last = repo.rsplit("/", 1)[-1]
    tag = f"-{filename}" if filename and filename != "latest" else ""
    return f"{last}{tag}".lower().replace("/", "-").replace(":", "-")


def pull(store: ModelStore, name: str, *, alias: str | None = None,
         dtype: str = DEFAULT_GGUF_DTYPE) -> ModelEntry:
    """Import the model called `name` (see the module docstring for where it is looked up);
    returns at once when the alias is already in the store.

    Raises:
        ModelNotFound: no source has `name`; the message names the nearest known name.
        WeightsMismatch: an Ollama blob's bytes differ from its digest.
        ModelStoreError: a download failed (the same command resumes it).
    """
    alias = alias or default_alias(name)
    existing = store.find(alias)
    if existing is not None:
        return existing
    offers = local_models()
    downloads = store.root / DOWNLOADS
    found = find_local(name, offers)
    several = local_files_of(name, offers)
    if found is None and several:  # a local repo with several GGUFs: not the hub's
        raise ModelNotFound(f"{name} holds several GGUF files; name one: "
                            + ", ".join(several[:6]), model=name)
    if found is None and "://" in name:
        if not name.startswith(("http://", "https://")):
            raise BadRequest(f"{name}: only http:// and https:// URLs are downloaded")
        path = download_url(name, downloads / "url")
        found = Found("url", name, path, Path(urllib.parse.urlsplit(name).path).stem,
                      gguf=True)
    elif found is None and _HUB_ID.match(name.partition(":")[0]):
        try:
            found = hub_download(name, downloads / "hub")
        except ModelStoreError as e:  # a typo is as likely as a network down: say both
            raise ModelStoreError(e.message + did_you_mean(name, store, offers)) from e
    if found is None:
        raise ModelNotFound(not_found_message(name, store, offers), model=name)
    entry = import_found(store, found, alias=alias, dtype=dtype)
    if found.source in ("url", "hub"):  # the store holds it now: the download is spent
        if found.gguf:
            found.path.unlink(missing_ok=True)
        if found.source == "hub":
            shutil.rmtree(downloads / "hub" / found.model_id.replace("/", "--"),
                          ignore_errors=True)
    return entry


def import_found(store: ModelStore, found: Found, *, alias: str,
                 dtype: str = DEFAULT_GGUF_DTYPE) -> ModelEntry:
    """Import what a source offers with the importer (its progress bar and resume)."""
    # the importer (torch) loads only here: `--list` and a wrong name answer at once, as
    # `models list` does
    from hearthnet.models.importer import (
        folder_bytes,
        gguf_plan_bytes,
        import_folder,
        import_gguf,
    )

    source = f"{found.source}:{found.name}"
    if not found.gguf:
        with progress_bar(folder_bytes(found.path), f"import {found.name}") as bar:
            return import_folder(store, found.path, alias=alias, model_id=found.model_id,
                                 progress=bar.update, source=source)
    # the real file, so a symlinked blob (the HF cache's layout) is stat'ed and planned as
    # the file it is
    path = found.path.resolve()
    if found.sha256 is not None:
        check_sha256(path, found.sha256, found.name)
    with progress_bar(gguf_plan_bytes(path, dtype), f"import {found.name}") as bar:
        return import_gguf(store, path, alias=alias, model_id=found.model_id, dtype=dtype,
                           progress=bar.update, source=source)


def check_sha256(path: Path, expected: str, name: str) -> None:
    """Hash `path` (with a bar: a 5 GB blob takes a while) and compare it with the digest
    the source named it by, before any import work."""
    h = hashlib.sha256()
    with progress_bar(path.stat().st_size, f"verify {name}") as bar, path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    if h.hexdigest() != expected:
        raise WeightsMismatch(f"{path}: its sha256 is not the digest its manifest names "
                              f"({name}); the blob is damaged: `ollama pull` it again",
                              file=str(path))


def local_files_of(name: str, offers: dict[str, list[Found]]) -> list[str]:
    """The `name:file.gguf` names local sources offer for a repo called `name`."""
    prefix = name.lower() + ":"
    return [f.name for found in offers.values() for f in found
            if f.name.lower().startswith(prefix) and f.name.endswith(".gguf")]


def known_names(store: ModelStore, offers: dict[str, list[Found]]) -> list[str]:
    """Every name `pull` would find locally, and the store's aliases and model ids."""
    names = {f.name for found in offers.values() for f in found}
    for e in store.entries():
        names.update((e.alias, e.model_id))
    return sorted(names)


def not_found_message(name: str, store: ModelStore, offers: dict[str, list[Found]]) -> str:
    """One line: that no source has `name`, and the nearest name that one has."""
    hint = did_you_mean(name, store, offers) or (
        "; `hearthnet models pull --list` shows what the local sources offer")
    return (f"no model {name!r} in Ollama ({ollama_dir()}), the Hugging Face cache "
            f"({hf_cache_dir()}), LM Studio or the hub{hint}")


def did_you_mean(name: str, store: ModelStore, offers: dict[str, list[Found]]) -> str:
    """`; did you mean 'X'?` with the known name nearest `name` (difflib), or ''."""
    lower = {n.lower(): n for n in known_names(store, offers)}
    near = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.5)
    return f"; did you mean {lower[near[0]]!r}?" if near else ""


def offers_lines(offers: dict[str, list[Found]]) -> Iterator[str]:
    """`models pull --list`: what each local source offers, one model a line."""
    where = {"ollama": str(ollama_dir()), "hf-cache": str(hf_cache_dir()),
             "lmstudio": " or ".join(str(d) for d in lmstudio_dirs())}
    for source, found in offers.items():
        yield f"{source} ({where[source]}):"
        if not found:
            yield "  (none)"
        for f in found:
            size = f.path.stat().st_size if f.gguf else sum(
                w.stat().st_size for w in f.path.glob("*.safetensors"))
            kind = "gguf" if f.gguf else "safetensors"
            yield f"  {f.name:<48} {kind:<11} {size / 2**20:>8.0f} MB"
