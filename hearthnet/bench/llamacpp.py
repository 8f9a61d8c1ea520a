"""llama.cpp as `hearthnet bench anchor`'s reference engine (DESIGN.md decision 15).

Owns everything that touches llama.cpp: which cmake options this CPU gets, where a build is
cached, building it once from the `llama-cpp-python` source distribution (which vendors
llama.cpp under ``vendor/llama.cpp``), running ``llama-bench`` and parsing its JSON,
running two ``rpc-server`` processes on 127.0.0.1, and writing a Q4_0 GGUF from a store
folder with llama.cpp's own converter and quantiser. Nothing here knows HearthNet's engine.

A build lives in ``<cache>/<version>-<hash of its cmake options>/`` outside the repository
(``<cache>`` is ``$XDG_CACHE_HOME/hearthnet/llama.cpp``, else ``~/.cache/hearthnet/llama.cpp``):
``src/`` (the vendored tree), ``build/``, ``build.log`` and ``build.json`` (the stamp
written last, so a half-built folder is never reused). Another CPU gets another hash, so a
cache copied between machines never runs instructions the CPU lacks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet.bench import median, pid_memory
from hearthnet.errors import BadRequest, HearthNetError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The source distribution built by default: pinned, so figures of two runs compare."""

PACKAGE = "llama-cpp-python"

CPU_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    # ggml's GGML_AVX512 compiles with -mavx512{f,cd,vl,dq,bw}: all five must be there
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
"""ggml's x86 cmake option → the /proc/cpuinfo flags it needs."""

NEVER_ON = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
"""Always off: a hypervisor may report AMX it does not let a guest run, and a build using
it (as `GGML_NATIVE=ON` does) dies with an illegal instruction on such a VM."""

BASE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_RPC=ON",
                "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                "-DGGML_CCACHE=OFF")
"""Every build: Release, instruction sets named explicitly (never `-march=native`), the RPC
backend for `rpc-server`, static binaries (a build folder is self-contained), no libcurl
(models are local files)."""

TOOLS = ("llama-bench", "llama-simple", "llama-quantize", "rpc-server")
"""The binaries a build provides (`rpc-server` is `ggml-rpc-server` in newer trees)."""


class LlamaCppBuildFailed(HearthNetError):
    """Downloading, unpacking or building llama.cpp failed; the message names the log."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first CPU in `cpuinfo` (default: /proc/cpuinfo); empty if unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cmake_options(flags: frozenset[str] | set[str]) -> list[str]:
    """The cmake ``-D`` options for a CPU with `flags`: every ggml x86 option named, ON
    exactly where the CPU has what it needs, AMX always OFF."""
    out = list(BASE_OPTIONS)
    for option, needs in CPU_OPTIONS:
        out.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
    out += [f"-D{option}=OFF" for option in NEVER_ON]
    return out


def enabled_options(options: Sequence[str]) -> list[str]:
    """The instruction-set options switched on, for reports (``["AVX2", "AVX512", …]``)."""
    return [o[len("-DGGML_"):-len("=ON")] for o in options
            if o.endswith("=ON") and o[len("-DGGML_"):-len("=ON")] not in ("RPC",)
            and o.startswith("-DGGML_")]


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/hearthnet/llama.cpp``, else ``~/.cache/hearthnet/llama.cpp``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "hearthnet" / "llama.cpp"


def build_key(version: str, options: Sequence[str]) -> str:
    """``<version>-<12 hex of the options' hash>``: one folder per version and option set."""
    digest = hashlib.sha256("\n".join(options).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def build_dir(root: Path, version: str, options: Sequence[str]) -> Path:
    """Where the build of `version` with `options` lives under the cache `root`."""
    return root / build_key(version, options)


def check_cache_root(root: Path, repo: Path) -> None:
    """`BadRequest` if the cache `root` lies inside the repository `repo`: a multi-GB build
    tree there would be picked up by git, the linters and the tests' file walks."""
    r, p = root.expanduser().resolve(), repo.resolve()
    if r == p or p in r.parents:
        raise BadRequest(f"--cache-dir {root} is inside the repository {repo}; "
                         f"give a folder outside it (default {default_cache_root()})")


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """A finished build: its folder, the vendored source tree and its binaries."""

    folder: Path
    version: str
    options: tuple[str, ...]

    @property
    def src(self) -> Path:
        return self.folder / "src"

    @property
    def bin(self) -> Path:
        return self.folder / "build" / "bin"

    def tool(self, name: str) -> Path:
        """The binary of TOOLS' `name` (`rpc-server` under either of its names)."""
        names = ("rpc-server", "ggml-rpc-server") if name == "rpc-server" else (name,)
        for n in names:
            if (self.bin / n).is_file():
                return self.bin / n
        raise LlamaCppBuildFailed(f"the llama.cpp build in {self.folder} has no {name}; "
                                  f"delete the folder and run again to rebuild it")

    def describe(self) -> dict[str, Any]:
        return {"version": f"{PACKAGE} {self.version}", "folder": str(self.folder),
                "cmake_options": list(self.options),
                "instruction_sets": enabled_options(self.options),
                "build_seconds": _stamp(self.folder).get("build_seconds")}


def _stamp(folder: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((folder / "build.json").read_text()))
    except (OSError, ValueError):
        return {}


def cached(root: Path, version: str, options: Sequence[str]) -> LlamaCpp | None:
    """The finished build of `version` with `options` under `root`, or None."""
    folder = build_dir(root, version, options)
    stamp = _stamp(folder)
    if stamp.get("options") != list(options):
        return None
    built = LlamaCpp(folder, version, tuple(options))
    try:
        for t in TOOLS:
            built.tool(t)
    except LlamaCppBuildFailed:
        return None
    return built


def ensure_build(root: Path, version: str, options: Sequence[str], *, jobs: int | None = None,
                 say: Callable[[str], None] | None = None) -> LlamaCpp:
    """The cached build, else download the sdist, unpack llama.cpp and build it (about ten
    minutes on two cores).

    Raises:
        LlamaCppBuildFailed: naming the step and its log file.
    """
    found = cached(root, version, options)
    if found is not None:
        return found
    folder = build_dir(root, version, options)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    log.write_text(f"# llama.cpp {version}, {' '.join(options)}\n")
    note = say or _quiet
    sdist = _download(root / "sdist", version, log, note)
    note(f"unpacking {sdist.name} into {folder / 'src'}")
    _unpack(sdist, folder / "src", log)
    note(f"building llama.cpp {version} ({' '.join(enabled_options(options))}); log: {log}")
    t0 = time.monotonic()
    _run_logged(["cmake", "-S", str(folder / "src"), "-B", str(folder / "build"),
                 *(["-G", "Ninja"] if _have("ninja") else []), *options], log, "cmake configure")
    targets = [_rpc_target(folder / "src") if t == "rpc-server" else t for t in TOOLS]
    _run_logged(["cmake", "--build", str(folder / "build"), "--config", "Release",
                 "-j", str(jobs or os.cpu_count() or 2), "--target", *targets], log,
                "cmake build")
    stamp = {"version": version, "options": list(options),
             "build_seconds": round(time.monotonic() - t0, 1)}
    (folder / "build.json").write_text(json.dumps(stamp, indent=2) + "\n")
    built = cached(root, version, options)
    if built is None:
        raise LlamaCppBuildFailed(f"the llama.cpp build finished without all of "
                                  f"{', '.join(TOOLS)}; see {log}", log=str(log))
    return built


def _quiet(_message: str) -> None:
    pass


def _have(program: str) -> bool:
    import shutil

    return shutil.which(program) is not None


def _download(where: Path, version: str, log: Path, note: Callable[[str], None]) -> Path:
    name = f"llama_cpp_python-{version}.tar.gz"
    if (where / name).is_file():
        return where / name
    where.mkdir(parents=True, exist_ok=True)
    note(f"downloading the {PACKAGE} {version} source distribution into {where}")
    # pip's own client and index settings (a mirror, a proxy) apply, as for any install
    _run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                 "--no-deps", f"{PACKAGE}=={version}", "-d", str(where)], log, "pip download")
    if not (where / name).is_file():
        raise LlamaCppBuildFailed(f"pip download did not write {where / name}; see {log}",
                                  log=str(log))
    return where / name


def _unpack(sdist: Path, dest: Path, log: Path) -> None:
    """Extract ``<top>/vendor/llama.cpp/**`` of `sdist` into `dest` (prefix stripped)."""
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                _, _, rest = m.name.partition("/")
                if rest.startswith("vendor/llama.cpp/"):
                    m.name = rest[len("vendor/llama.cpp/"):]
                    members.append(m)
            if not members:
                raise LlamaCppBuildFailed(f"{sdist.name} vendors no llama.cpp "
                                          f"(no vendor/llama.cpp/); see {log}", log=str(log))
            tar.extractall(dest, members=members, filter="data")
    except (OSError, tarfile.TarError) as e:
        with log.open("a") as f:
            f.write(f"unpack failed: {e}\n")
        raise LlamaCppBuildFailed(f"cannot unpack {sdist}: {e}; see {log}",
                                  log=str(log)) from e


def _rpc_target(src: Path) -> str:
    """The cmake target of the RPC server: `ggml-rpc-server` in newer trees."""
    try:
        text = (src / "tools" / "rpc" / "CMakeLists.txt").read_text()
    except OSError:
        return "rpc-server"
    return "ggml-rpc-server" if "ggml-rpc-server" in text else "rpc-server"


def _run_logged(cmd: list[str], log: Path, step: str,
                env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False, env=env)
        except OSError as e:
            f.write(f"{e}\n")
            raise LlamaCppBuildFailed(f"llama.cpp {step} could not start ({e}); see {log}",
                                      log=str(log)) from e
    if r.returncode != 0:
        raise LlamaCppBuildFailed(f"llama.cpp {step} failed (exit {r.returncode}); "
                                  f"see {log}", log=str(log))


# ---------------------------------------------------------------------------------------
# llama-bench


def parse_llama_bench(text: str) -> dict[str, Any]:
    """Figures from ``llama-bench -o json`` output: prefill (the ``pp`` test: n_prompt > 0,
    n_gen = 0) and decode (``tg``: n_gen > 0, n_prompt = 0) tokens/s as the median of the
    repetitions, with the build, model and thread count the run reported.

    Raises:
        HearthNetError: the text holds no JSON list of tests.
    """
    start, end = text.find("["), text.rfind("]")
    try:
        tests = json.loads(text[start:end + 1]) if 0 <= start < end else None
    except ValueError:
        tests = None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise HearthNetError(f"llama-bench printed no JSON list of tests: {text[:200]!r}")
    out: dict[str, Any] = {}
    for t in tests:
        kind = "prefill" if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0 else \
            "decode" if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0 else None
        if kind is None:
            continue
        runs = [float(x) for x in t.get("samples_ts") or [t.get("avg_ts", 0.0)]]
        out[f"{kind}_tokens_per_s"] = round(median(runs), 2)
        out[f"{kind}_runs"] = [round(x, 2) for x in runs]
        out[f"{kind}_tokens"] = int(t["n_prompt"] if kind == "prefill" else t["n_gen"])
        for k in ("build_commit", "build_number", "model_type", "model_size", "n_threads",
                  "backends", "cpu_info"):
            if k in t:
                out[k] = t[k]
    if "decode_tokens_per_s" not in out and "prefill_tokens_per_s" not in out:
        raise HearthNetError("llama-bench's JSON has neither a pp nor a tg test")
    return out


def llama_bench_argv(tool: Path, gguf: Path, *, prompt_tokens: int, tokens: int,
                     threads: int, runs: int, rpc: Sequence[str] = ()) -> list[str]:
    """The llama-bench command: `prompt_tokens` prefill and `tokens` decode (0 skips
    either), median of `runs`, on `threads` threads; with `rpc`, every layer offloaded to
    those servers, split evenly between them."""
    argv = [str(tool), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(tokens),
            "-t", str(threads), "-r", str(runs), "-o", "json"]
    if rpc:
        argv += ["--rpc", ",".join(rpc), "-ngl", "99",
                 "-ts", "/".join("1" for _ in rpc)]
    return argv


def run_llama_bench(argv: list[str], log: Path, timeout: float = 1800.0) -> dict[str, Any]:
    """Run `argv` (from `llama_bench_argv`): its parsed figures plus its peak RSS in MiB.

    Raises:
        HearthNetError: llama-bench failed or printed no figures; names `log`.
    """
    out_file = log.with_suffix(".json")
    with out_file.open("w") as out, log.open("a") as err:
        err.write(f"\n$ {' '.join(argv)}\n")
        err.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=err)
        deadline = time.monotonic() + timeout
        peak = 0.0
        # VmHWM while it runs: wait4's ru_maxrss would carry this (torch-sized) process's
        # RSS over the fork and exec
        while proc.poll() is None:
            peak = max(peak, pid_memory(proc.pid).get("peak_rss_mb", 0.0))
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise HearthNetError(f"llama-bench ran over {timeout:.0f} s; see {log}")
            time.sleep(0.05)
    if proc.returncode != 0:
        raise HearthNetError(f"llama-bench failed (exit {proc.returncode}); see {log}")
    res = parse_llama_bench(out_file.read_text())
    res["peak_rss_mb"] = peak
    res["argv"] = argv
    return res


# ---------------------------------------------------------------------------------------
# rpc-server


def free_port() -> int:
    """A port on 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def rpc_servers(tool: Path, count: int, threads: int, log_dir: Path,
                timeout: float = 60.0) -> Iterator[list[tuple[str, int]]]:
    """`count` rpc-server processes on 127.0.0.1 (never another interface: the RPC
    protocol has no authentication), each with `threads` threads. Yields their
    ``(host:port, pid)``; stops them on exit."""
    procs: list[tuple[subprocess.Popen[bytes], int]] = []
    try:
        for i in range(count):
            port = free_port()
            with (log_dir / f"rpc-server-{i}.log").open("a") as log:
                procs.append((subprocess.Popen(
                    [str(tool), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True), port))
        for i, (p, port) in enumerate(procs):
            _wait_listening(p, port, timeout, log_dir / f"rpc-server-{i}.log")
        yield [(f"127.0.0.1:{port}", p.pid) for p, port in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.terminate()
        for p, _ in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_listening(proc: subprocess.Popen[bytes], port: int, timeout: float, log: Path
                    ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HearthNetError(f"rpc-server on port {port} exited ({proc.returncode}); "
                                 f"see {log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.2)
    raise HearthNetError(f"rpc-server on port {port} did not listen within {timeout:.0f} s; "
                         f"see {log}")


def server_memory(pids: Sequence[int]) -> list[float]:
    """Peak RSS in MiB of each live process in `pids`."""
    return [pid_memory(p).get("peak_rss_mb", 0.0) for p in pids]


# ---------------------------------------------------------------------------------------
# Writing a Q4_0 GGUF from a Hugging Face folder


def write_q4_0(built: LlamaCpp, folder: Path, out: Path, log: Path, threads: int = 2,
               pre_tokenizer: str = "smollm") -> Path:
    """`folder` (config.json, safetensors, tokenizer) → an f16 GGUF by the vendored
    ``convert_hf_to_gguf.py`` → `out` in Q4_0 by ``llama-quantize``. The f16 file is
    deleted afterwards; `out` appears only when complete.

    `pre_tokenizer` is the GGUF's ``tokenizer.ggml.pre`` where the converter does not
    recognise the tokenizer by its hash (a synthetic model carries SmolLM2's tokenizer,
    whose hash differs between transformers versions; llama-bench never tokenises text).

    Raises:
        LlamaCppBuildFailed: a step failed; names `log`.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(out.stem + ".f16.gguf.partial")
    part = out.with_name(out.name + ".partial")
    try:
        shim = _converter_shim(log.parent)
        _run_logged([sys.executable, str(shim / "convert.py"), str(built.src), pre_tokenizer,
                     str(folder), "--outfile", str(f16), "--outtype", "f16"], log,
                    "convert_hf_to_gguf", env=_converter_env(shim))
        _run_logged([str(built.tool("llama-quantize")), str(f16), str(part), "Q4_0",
                     str(threads)], log, "llama-quantize")
    finally:
        f16.unlink(missing_ok=True)
    part.replace(out)
    return out


_SENTENCEPIECE_STANDIN = '''"""A stand-in for sentencepiece, for convert_hf_to_gguf.py."""


class SentencePieceProcessor:
    def __init__(self, *args, **kwargs):
        raise FileNotFoundError("sentencepiece is not installed")
'''

_CONVERT = '''"""convert_hf_to_gguf.py with a fallback pre-tokenizer: SRC PRE ARGS..."""
import runpy
import sys

src, pre = sys.argv[1], sys.argv[2]
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[3:]]
sys.path[:0] = [src, src + "/gguf-py"]  # the vendored gguf, as the script itself does
from conversion import base

_recognised = base.TextModel.get_vocab_base_pre


def _pre(self, tokenizer):
    try:
        return _recognised(self, tokenizer)
    except NotImplementedError:
        return pre


base.TextModel.get_vocab_base_pre = _pre
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _converter_shim(scratch: Path) -> Path:
    """A folder with ``convert.py`` (the converter with `write_q4_0`'s fallback
    pre-tokenizer) and, where sentencepiece is not installed, a stand-in for it: the
    converter's Qwen2 path imports sentencepiece before it looks for a ``tokenizer.model``
    and falls back to the BPE vocabulary (what synthetic models carry) only on
    FileNotFoundError, which the stand-in raises."""
    import importlib.util

    shim = scratch / "converter-shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "convert.py").write_text(_CONVERT)
    if importlib.util.find_spec("sentencepiece") is None:
        (shim / "sentencepiece.py").write_text(_SENTENCEPIECE_STANDIN)
    return shim


def _converter_env(shim: Path) -> dict[str, str]:
    """The converter's environment: `shim` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH", "")]))
    return env
