"""Weight format names and the routing policy over them (DESIGN.md decision 10), torch-free.

Formats: `native` (the stored dtype), `fp32`, `bf16`, `fp16`, `int8`, `int4`; what each
means for the held tensors is `engine/quant.py`. `int4` is group-wise int4 quantised at
load, or — on a store that kept a GGUF's blocks — the Q4_0/Q4_1/Q4_K blocks held exactly
(DESIGN.md decision 15); the two never meet in one pipeline, since the stores' weights
hashes differ. An advertisement names its shard's held
format (never `native`: that is resolved at load).

Routing (M26 §5.3, refined): a call's `weights` param is `lossless` (the default: only
formats that keep every stored value, `lossless_formats`), a minimum precision — a format
name (accept shards at least that precise) — or `exact` (only the orchestrator's own
format). Precision order: fp32 > bf16 = fp16 > int8 > int4. A compact format changes
answers (int8 diverged from exact within 8–12 tokens on SmolLM2, int4 re-quantised at
load at the first), so it is used only when a call or the node's config asks for it, and
every call's `done` says which formats served it and whether all were lossless
(`call_formats`).
"""

from __future__ import annotations

from typing import Any

from hearthnet.errors import BadRequest

FORMATS = ("native", "fp32", "bf16", "fp16", "int8", "int4")
HELD_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")
QUANTISED = ("int8", "int4")
HEAD_FORMATS = ("fp32", "bf16", "fp16", "int8")
KERNELS = ("onednn", "fbgemm", "int8pack", "int8-vnni", "int4pack-bf16", "int4pack-fp32",
           "int4-vnni")
"""What a quantised format's products run in on its host (`quant.kernel_of`): int8 in
oneDNN (VNNI/AMX CPUs) or fbgemm (AVX2), both exact integer GEMMs on split activations, in
HearthNet's own VNNI kernel on two int8 digits of each group of 32 activations
(`int8-vnni`, AVX-512 VNNI CPUs where it is measured faster), or torch's
`_weight_int8pack_mm` (bf16 activations); int4 in `_weight_int4pack_mm_for_cpu`,
with bf16 scales, zeros and activations (`int4pack-bf16`) or, for GGUF blocks held exactly
where the host chose the exact path, fp32 ones (`int4pack-fp32`), or, for GGUF blocks on
AVX-512 VNNI CPUs, in HearthNet's own integer kernel on two int8 digits of each
activation (`int4-vnni`, `engine/q4vnni.py`).
Float formats run in the plain dtype's GEMM and name none. The kernel is advertised with
the format: on a mixed mesh int8 numerics differ slightly between kernels, and int4's
two paths round differently."""
_PRECISION = {"fp32": 3, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0}
EXACT = "exact"
LOSSLESS = "lossless"
DEFAULT_POLICY = LOSSLESS  # a call's default `weights`
POLICIES = (LOSSLESS, EXACT, *HELD_FORMATS)
LOSSLESS_WIRE = "fp32"  # the wire dtype that rounds no hidden state (orchestrator/wire.py)
STORED = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
          "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def check_format(name: object) -> str:
    """`name` if it is a known format; `BadRequest` naming the known ones otherwise."""
    if not isinstance(name, str) or name not in FORMATS:
        raise BadRequest(f"unknown weight format {name!r}; use one of {', '.join(FORMATS)}")
    return name


def resolve_format(name: str, stored_dtype: str) -> str:
    """The held format: `native` becomes the stored dtype's (fp32|bf16|fp16)."""
    check_format(name)
    if name != "native":
        return name
    try:
        return STORED[stored_dtype]
    except KeyError:
        raise BadRequest(f"weights stored as {stored_dtype!r} have no native format; "
                         f"choose fp32, bf16 or int8") from None


def check_policy(value: object) -> str:
    """Validate a call's `weights` param (None → the default, `lossless`)."""
    if value is None:
        return DEFAULT_POLICY
    if isinstance(value, str) and value in POLICIES:
        return value
    raise BadRequest(f"weights must be {LOSSLESS!r}, {EXACT!r} or a minimum format "
                     f"({', '.join(HELD_FORMATS)}); got {value!r}")


def lossless_formats(stored_dtype: str, q4_blocks: bool = False) -> frozenset[str]:
    """The held formats that keep every stored weight as it is.

    fp32 holds every stored float dtype and every GGUF block type exactly (blocks
    de-quantise exactly to fp32); a stored float dtype is lossless in itself; int4 is
    lossless on a store whose every layer weight is a GGUF Q4_0/Q4_1/Q4_K block
    (`q4_blocks`: those blocks are held as they are, DESIGN.md decision 15 — the fast
    kernel's bf16 activations round, as `bench quality` measures). int8, and int4
    quantised at load, round every weight.
    """
    out = {"fp32"}
    if stored_dtype in STORED:
        out.add(STORED[stored_dtype])
    if q4_blocks:
        out.add("int4")
    return frozenset(out)


def lossless_of(entry: Any) -> frozenset[str]:
    """`lossless_formats` of a store entry (a `models.store.ModelEntry`)."""
    return lossless_formats(entry.dtype, entry.q4_blocks)


def accepts(policy: str, fmt: str, own: str,
            lossless: frozenset[str] = frozenset({"fp32"})) -> bool:
    """Whether a call with `weights=policy` may use a shard holding `fmt`.

    `own` is the orchestrator's own (head / local engine) format, for `exact`; `lossless`
    the model's `lossless_formats`, for `lossless`.
    """
    if policy == EXACT:
        return fmt == own
    if policy == LOSSLESS:
        return fmt in lossless
    return _PRECISION.get(fmt, -1) >= _PRECISION[policy]


def accepted_formats(policy: str, own: str,
                     lossless: frozenset[str] = frozenset({"fp32"})) -> list[str]:
    """The held formats a policy accepts (for routing and messages)."""
    return [f for f in HELD_FORMATS if accepts(policy, f, own, lossless)]


def formats_for(policy: str, own_weights: str, entry: Any) -> frozenset[str]:
    """The held formats a call of `entry` (a `ModelEntry`) with `policy` accepts, from an
    orchestrator holding `own_weights` (`native`: the entry's stored dtype, for `exact`)."""
    own = resolve_format(own_weights, entry.dtype)
    return frozenset(accepted_formats(policy, own, lossless_of(entry)))


def call_formats(head: str, stages: list[str], wires: list[str], policy: str | None,
                 lossless: frozenset[str]) -> dict[str, object]:
    """The `formats` of a call's `done` frame: what served it and whether anything in it
    rounded a stored weight or a hidden state (`lossless`), so a compact answer is never
    mistaken for an exact one. `wires` is empty and `policy` None for the local engine
    (no wire, no shards to choose)."""
    out: dict[str, object] = {"head": head, "stages": list(stages), "wire": list(wires)}
    if policy is not None:
        out["policy"] = policy
    out["lossless"] = head in lossless and all(f in lossless for f in stages) \
        and all(w == LOSSLESS_WIRE for w in wires)
    return out


def policy_for(weights: str) -> str:
    """The call policy of a node whose shards a tool set to hold `weights` (the demo, the
    benchmarks): that format as the minimum — asked for, so a compact one may serve — or
    `lossless` for `native` (the stored dtype keeps every weight)."""
    return weights if weights in HELD_FORMATS else LOSSLESS


def default_held(compute: str, q4_blocks: bool) -> str:
    """How a host holds a model's layers when no `weights` is configured: a GGUF's Q4
    blocks as they are (`int4`: lossless, the GGUF's own size in memory and the fastest CPU
    kernel — DESIGN.md decision 15), else the host's compute dtype."""
    return "int4" if q4_blocks else compute


def head_format(weights: str) -> str:
    """The head's format that goes with a layers format: the same, int8 for int4 (a head
    holds no int4)."""
    return weights if weights in HEAD_FORMATS or weights == "native" else "int8"
