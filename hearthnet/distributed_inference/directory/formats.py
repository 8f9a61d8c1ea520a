"""Weight format names and the routing policy over them (DESIGN.md decision 10), torch-free.

Formats: `native` (the stored dtype), `fp32`, `bf16`, `fp16`, `int8`, `int4`; what each
means for the held tensors is `engine/quant.py`. `int4` is group-wise int4 quantised at
load, or — on a store that kept a GGUF's blocks — the Q4_0/Q4_1/Q4_K blocks held exactly
(DESIGN.md decision 15); the two never meet in one pipeline, since the stores' weights
hashes differ. An advertisement names its shard's held
format (never `native`: that is resolved at load).

Routing (M26 §5.3, refined): a call's `weights` param is a minimum precision — a format
name (accept shards at least that precise; default `int8`) or `exact` (only the
orchestrator's own format). Precision order: fp32 > bf16 = fp16 > int8 > int4.
"""

from __future__ import annotations

from hearthnet.errors import BadRequest

FORMATS = ("native", "fp32", "bf16", "fp16", "int8", "int4")
HELD_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")
QUANTISED = ("int8", "int4")
HEAD_FORMATS = ("fp32", "bf16", "fp16", "int8")
KERNELS = ("onednn", "fbgemm", "int8pack", "int4pack-bf16", "int4pack-fp32")
"""What a quantised format's products run in on its host (`quant.kernel_of`): int8 in
oneDNN (VNNI/AMX CPUs) or fbgemm (AVX2), both exact integer GEMMs on split activations, or
torch's `_weight_int8pack_mm` (bf16 activations); int4 in `_weight_int4pack_mm_for_cpu`,
with bf16 scales, zeros and activations (`int4pack-bf16`) or, for GGUF blocks held exactly
where the host chose the exact path, fp32 ones (`int4pack-fp32`).
Float formats run in the plain dtype's GEMM and name none. The kernel is advertised with
the format: on a mixed mesh int8 numerics differ slightly between kernels, and int4's
two paths round differently."""
_PRECISION = {"fp32": 3, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0}
DEFAULT_MIN_FORMAT = "int8"  # a call's default `weights`: at least as precise as int8
EXACT = "exact"
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
    """Validate a call's `weights` param (None → the default minimum)."""
    if value is None:
        return DEFAULT_MIN_FORMAT
    if value == EXACT or (isinstance(value, str) and value in HELD_FORMATS):
        return str(value)
    raise BadRequest(f"weights must be {EXACT!r} or a minimum format "
                     f"({', '.join(HELD_FORMATS)}); got {value!r}")


def accepts(policy: str, fmt: str, own: str) -> bool:
    """Whether a call with `weights=policy` may use a shard holding `fmt`.

    `own` is the orchestrator's own (head / local engine) format, for `exact`.
    """
    if policy == EXACT:
        return fmt == own
    return _PRECISION.get(fmt, -1) >= _PRECISION[policy]


def accepted_formats(policy: str, own: str) -> list[str]:
    """The held formats a policy accepts (for messages)."""
    return [f for f in HELD_FORMATS if accepts(policy, f, own)]


def head_format(weights: str) -> str:
    """The head's format that goes with a layers format: the same, int8 for int4 (a head
    holds no int4)."""
    return weights if weights in HEAD_FORMATS or weights == "native" else "int8"
