"""int4 (and Q8_0) products in AVX-512 VNNI integer dot products (`int4-vnni`; M26 §5.7).

torch's own int4 kernel (`_weight_int4pack_mm_for_cpu`) either rounds scales, zeros,
activations and outputs to bf16 or runs a scalar fp32 loop; llama.cpp's Q4 kernels are
fast because they multiply the 4-bit values by int8 activations with integer
dot-product instructions. This kernel does that, with two int8 digits per activation so
that it stays faithful: an activation group of 32 with largest magnitude a is written as
``d·(hi + lo/254)``, d = a / 127 (relative error of a product ~2e-5, against ~3e-3 for
the bf16 path and ~5e-3 for one int8 digit), and every integer sum is exact. The weights
are the blocks' own 4-bit values with the blocks' own scales (fp16 for Q4_0/Q4_1, fp32
for Q4_K's d·sc), so nothing of the GGUF is rounded.

Layout (`pack`): rows in tiles of 16, each tile's groups of 32 inputs as 256 bytes — four
64-byte chunks, byte 4j + i of chunk c holding row j's input 8c + i in its low nibble and
8c + 4 + i in its high one — so one 512-bit VNNI instruction sums 4 products for each of
16 rows, and no horizontal sums are needed. Scales (and offsets, where a group has one)
are (tiles, groups, 16). A GGUF's Q8_0 blocks (a head's embeddings, a layer's Q8_0
matrices) use the same kernel with 8-bit values (`pack8`, torch.ops.hearthnet.q8_mm), so
they too are held as the file has them instead of re-quantised.

The source (csrc/q4_vnni.cpp) is compiled on first use by torch's C++ extension builder
(a C++ compiler and ninja are needed; ~12 s on 2 cores) into
``$XDG_CACHE_HOME/hearthnet/kernels/`` (``HEARTHNET_KERNEL_DIR`` overrides), keyed by the
source, torch and the compiler flags, so every later process loads the built library in
well under a second (and needs no compiler). Where the CPU lacks AVX-512 VNNI
or the build fails, `available` is false and says why; int4 then runs in torch's kernel.

Both products also have a path in AMX tiles, for CPUs with AMX-INT8 (Intel Sapphire
Rapids and later): one tile instruction sums a group's products for 16 outputs and every
digit row of up to 8 activation rows, with the same integer sums and the same fp32
operations, so its results are bit for bit the VNNI path's. It takes products of 2 rows
and more (8-bit values) or 6 and more (4-bit values, unpacked to bytes for each tile):
rounds of several chats, speculative passes, prompts; one chat's decode step stays in
VNNI registers, where it is as fast or faster. `HEARTHNET_AMX` (``auto``, the default: on
where the CPU and Linux allow it, unless a probe of 8 rows finds it more than
`AMX_MAX_RATIO` times slower; ``on``; ``off``) chooses, once per process, when the kernel
loads (`amx_state`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from hearthnet.errors import ConfigError
from hearthnet.observability import get_logger

log = get_logger("quant")

KERNEL = "int4-vnni"
INT8_KERNEL = "int8-vnni"  # the format int8 (per output channel) in this kernel's 8-bit path
TILE = 16  # output rows per tile
GROUP = 32  # inputs per group
KERNEL_DIR_ENV = "HEARTHNET_KERNEL_DIR"
_NAME = "hearthnet_q4_vnni"
_SOURCE = Path(__file__).parent / "csrc" / "q4_vnni.cpp"
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
          "-mf16c", "-mfma", "-fopenmp")  # -fopenmp: ATen's parallel_for pragmas; the
# symbols resolve to torch's own libgomp (already loaded), so torch.set_num_threads holds
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
AMX_ENV = "HEARTHNET_AMX"
AMX_SETTINGS = ("auto", "on", "off")
AMX_PROBE = (1024, 1024, 8)  # out × in × rows: a round of 8 chats' rows (M26 §5.3)
AMX_MAX_RATIO = 1.1  # auto keeps the AMX path unless the probe finds it clearly slower: its
# products are the same, so only speed decides (measured on a Sapphire Rapids-class VM:
# 8 rows of the 1.5B shape's int8 MLP matrix 1.77 against 2.29 ms from memory)
_lock = threading.RLock()  # `_choose_amx` packs its probe (which asks `available`)
_state: dict[str, str] = {}  # "ok" or "reason": set once per process
_amx: dict[str, str] = {}  # "state": what `amx_state` says


def kernel_dir() -> Path:
    """Where built kernels are kept (`HEARTHNET_KERNEL_DIR`, else the user's cache)."""
    if os.environ.get(KERNEL_DIR_ENV):
        return Path(os.environ[KERNEL_DIR_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "hearthnet" / "kernels"


def missing_cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The instruction sets the kernel needs that this CPU (`/proc/cpuinfo`) lacks."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return list(_CPU_FLAGS)
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return [f for f in _CPU_FLAGS if f not in have]


def _build_key() -> str:
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(" ".join((torch.__version__, *_FLAGS)).encode())
    return h.hexdigest()[:16]


def _load() -> None:
    missing = missing_cpu_flags()
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(missing)}")
    folder = kernel_dir() / f"q4_vnni-{_build_key()}"
    built = folder / f"{_NAME}.so"
    if built.exists():
        torch.ops.load_library(str(built))  # type: ignore[no-untyped-call]
    else:
        _build(folder)
    torch.library.register_fake("hearthnet::q4_mm")(_fake)
    torch.library.register_fake("hearthnet::q8_mm")(_fake)


def amx_setting(value: str | None = None) -> str:
    """`value`, else the environment's `HEARTHNET_AMX`, normalised (empty: ``auto``);
    `ConfigError` unless it is one of `AMX_SETTINGS`."""
    v = (os.environ.get(AMX_ENV, "") if value is None else value).strip().lower() or "auto"
    if v not in AMX_SETTINGS:
        raise ConfigError(f"{AMX_ENV}={v!r}: use one of {', '.join(AMX_SETTINGS)}",
                          key=AMX_ENV, reason="unknown AMX setting")
    return v


def _amx_probe_ms() -> dict[str, float]:
    """ms of an `AMX_PROBE` 8-bit product with the AMX path off and on, best of 10 each,
    alternated, on one thread (the 4-bit path differs only in unpacking each tile's
    values, which the row threshold in the kernel accounts for)."""
    n, k, m = AMX_PROBE
    g = torch.Generator().manual_seed(2)
    w, s = pack8_rows(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                      torch.rand(n, generator=g) * 1e-2 + 1e-3)
    x = torch.randn(m, k, generator=g)
    best = {"vnni": float("inf"), "amx": float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(10):
            for name in best:
                torch.ops.hearthnet.use_amx(name == "amx")
                t = time.perf_counter()
                mm8(x, w, s)
                best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return best


def _choose_amx(setting: str | None = None) -> None:
    """Turn the AMX path of the products on or off for this process (module docstring)
    and note why in `amx_state`."""
    setting = amx_setting(setting)
    permitted = setting != "off" and bool(torch.ops.hearthnet.use_amx(True))
    if setting == "off":
        state = f"off: {AMX_ENV}=off"
    elif not permitted:
        state = "off: the CPU or the kernel has no AMX-INT8 (or Linux does not allow its tiles)"
    elif setting == "on":
        state = f"on: {AMX_ENV}=on"
    else:
        ms = _amx_probe_ms()
        permitted = ms["amx"] <= AMX_MAX_RATIO * ms["vnni"]
        state = (f"{'on' if permitted else 'off'}: {AMX_PROBE[2]} rows × "
                 f"{AMX_PROBE[0]} × {AMX_PROBE[1]} in {ms['amx']:.3f} ms against "
                 f"{ms['vnni']:.3f} in VNNI")
    torch.ops.hearthnet.use_amx(permitted)
    _amx["state"] = state
    log.debug("amx", state=state)  # a CLI's stderr stays quiet; `amx_state` tells


def amx_state() -> str:
    """Whether products of several rows use AMX tiles in this process, and why ("" before
    the kernel is loaded)."""
    return _amx.get("state", "")


def _build(folder: Path) -> None:
    """Build and load the kernel in a folder of this process's own, then move it into
    place in one rename: processes that start together each build (no lock that a killed
    one could leave behind), and none ever loads a half-written library."""
    from torch.utils.cpp_extension import load

    folder.parent.mkdir(parents=True, exist_ok=True)
    own = Path(tempfile.mkdtemp(prefix=f"{folder.name}.build-", dir=folder.parent))
    try:
        load(name=_NAME, sources=[str(_SOURCE)], build_directory=str(own),
             extra_cflags=list(_FLAGS), is_python_module=False, verbose=False)
    except BaseException:
        shutil.rmtree(own, ignore_errors=True)
        raise
    try:
        os.rename(own, folder)
    except OSError:  # another process put its build there first: this one is loaded
        shutil.rmtree(own, ignore_errors=True)


def _fake(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
          o: torch.Tensor | None = None) -> torch.Tensor:
    """What either op returns, for torch.compile's tracing: (rows, tiles · 16) fp32."""
    return x.new_empty((x.shape[0], w.shape[0] * TILE))


def available() -> bool:
    """Whether the kernel is built and loaded in this process (built on first call)."""
    with _lock:
        if not _state:
            try:
                _load()
                _state["ok"] = "1"
            except Exception as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _state["reason"] = f"{KERNEL} unavailable: {reason[:300]}"
                log.info("int4_vnni_unavailable", reason=_state["reason"])
            else:
                try:
                    _choose_amx()
                except ConfigError as e:  # checked at a node's start (`kernel_settings`)
                    torch.ops.hearthnet.use_amx(False)
                    _amx["state"] = f"off: {e}"
        return "ok" in _state


def unavailable_reason() -> str:
    """Why `available` is false ("" when it is true or was not asked yet)."""
    return _state.get("reason", "")


def _require() -> None:
    """Load the kernel before weights are packed for it; `RuntimeError` saying why not."""
    if not available():
        raise RuntimeError(unavailable_reason())


def padded_rows(n: int) -> int:
    """`n` output rows rounded up to whole tiles of 16 (the rows a packed matrix holds)."""
    return -(-n // TILE) * TILE


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values `q` (n, k) in 0..15 with per-group `scale` and `offset` (n, k / 32; the
    weight is ``q·scale + offset``, or ``(q − 8)·scale`` without offsets) in the kernel's
    layout (module docstring); the scales keep their dtype (fp16 or fp32)."""
    _require()
    n, k = q.shape
    t = q.to(torch.uint8).reshape(n // TILE, TILE, k // GROUP, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
    w = (t[..., 0, :] | (t[..., 1, :] << 4)).reshape(n // TILE, k // GROUP, 256).contiguous()

    def tiles(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(n // TILE, TILE, k // GROUP).permute(0, 2, 1).contiguous()

    return w, tiles(scale), None if offset is None else tiles(offset)


def pack8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values `q` (n, k) with per-group `scale` (n, k / 32; weight ``q·scale``, a
    Q8_0 block's) in the kernel's 8-bit layout: each tile's group as 512 bytes, eight
    64-byte chunks, byte 4j + i of chunk c holding row j's input 4c + i as ``q + 128``
    (VNNI multiplies unsigned by signed bytes; the kernel takes 128 · Σ digits back)."""
    _require()
    n, k = q.shape
    u = (q.view(torch.uint8) ^ 0x80).reshape(n // TILE, TILE, k // GROUP, 8, 4)
    w = u.permute(0, 2, 3, 1, 4).reshape(n // TILE, k // GROUP, 512).contiguous()
    return w, scale.reshape(n // TILE, TILE, k // GROUP).permute(0, 2, 1).contiguous()


def pack8_rows(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values `q` (n, k) with one `scale` per row (n; int8 per output channel) in the
    kernel's 8-bit layout (`pack8`), the scales as fp32 (tiles, 1, 16): the kernel takes one
    scale per row for every group."""
    w, _ = pack8(q, torch.ones(q.shape[0], q.shape[1] // GROUP, dtype=torch.float16))
    return w, scale.float().reshape(-1, 1, TILE).contiguous()


def unpack8_rows(w: torch.Tensor, s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows `ids` (any shape) of a `pack8` (or `pack8_rows`) matrix: an embedding
    lookup."""
    t, j = ids // TILE, ids % TILE
    groups = w.shape[1]
    q = w.view(w.shape[0], groups, 8, TILE, 4)[t, :, :, j, :]  # (*ids, groups, 8, 4)
    values = (q ^ 0x80).view(torch.int8).float().reshape(*ids.shape, groups, GROUP)
    scales = s[t, :, j].float()  # (*ids, groups)
    out: torch.Tensor = (values * scales[..., None]).reshape(*ids.shape, groups * GROUP)
    return out


def mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, o: torch.Tensor | None
       ) -> torch.Tensor:
    """fp32 rows `x` (m, k) times the packed 4-bit weights: (m, n) fp32."""
    out: torch.Tensor = torch.ops.hearthnet.q4_mm(x, w, s, o)
    return out


def mm8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 rows `x` (m, k) times the packed 8-bit weights (`pack8`): (m, n) fp32."""
    out: torch.Tensor = torch.ops.hearthnet.q8_mm(x, w, s)
    return out
