"""The wire dtype of each stage of a call (M26 §5.3, §5.5).

A call's `wire_dtype` is `auto` (the default), `compact`, `fp16`, `bf16` or `fp32`. A
stage's stream carries one dtype both ways: its input (the output of layer `start - 1`, or
the embeddings) and its output (layer `end`).

`auto` is fp32 on every stage: the dtype the layers compute in on a CPU (and wider than a
GPU's bf16/fp16), so no hidden state is rounded between shards and a distributed answer is
the local engine's, token for token. A narrower wire is not "exact enough" by any test we
can run ahead of a call: fp16 or bf16 at a boundary rounds every value, and on a model with
large activations (Gemma-3) a bf16 wire changed the greedy answer at token 7 of a
1,006-token prompt. What exactness costs is bytes: 4 per value instead of 2, which on a
decode step is a few KB per hop (docs/benchmarks.md, "Wire dtypes").

`compact` halves those bytes and is lossy, so a call or the node's config must ask for it:
a stage gets fp16 when both of its boundaries' calibrated max |value| × `WIRE_MARGIN` fit
fp16's range, and the call's wide dtype (bf16 by default, or fp32; config
`activation_wide_dtype`) when not. A sender that sees finite values overflow anyway
reports `wire_overflow`; the orchestrator then widens that stage for the rest of the call
(`WirePlan.widen`) and redoes the step — no shard is blamed. A forced fp16 on a model whose
calibration does not fit is refused before any work (`WirePlan.check_forced`), and an
overflow under a forced dtype ends the call with `wire_overflow`: never a silent change of
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hearthnet.constants import CALL_WIRE_DTYPES, WIDE_WIRE_DTYPES
from hearthnet.distributed_inference.directory.formats import LOSSLESS_WIRE
from hearthnet.distributed_inference.orchestrator.sanity import FP16_MAX, WIRE_MARGIN, Calibration
from hearthnet.errors import BadRequest, WireOverflow


def check_wire_names(mode: str, wide: str) -> None:
    """`BadRequest` unless `mode` is a call wire dtype and `wide` a wide one."""
    if mode not in CALL_WIRE_DTYPES:
        raise BadRequest(f"wire_dtype must be one of {list(CALL_WIRE_DTYPES)}, not {mode!r}")
    if wide not in WIDE_WIRE_DTYPES:
        raise BadRequest(f"the wide wire dtype must be one of {list(WIDE_WIRE_DTYPES)}, "
                         f"not {wide!r}")


@dataclass
class WirePlan:
    """Which dtype each stage's stream uses in one call; widened stages are remembered."""

    mode: str
    wide: str
    calibration: Calibration
    widened: set[tuple[int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        check_wire_names(self.mode, self.wide)

    def for_stage(self, start: int, end: int) -> str:
        """The wire dtype of a stage over layers `[start, end]`."""
        if self.mode == "auto":
            return LOSSLESS_WIRE
        if self.mode != "compact":
            return self.mode
        cal = self.calibration
        if (start, end) in self.widened or not (cal.fp16_fits(start - 1)
                                                and cal.fp16_fits(end)):
            return self.wide
        return "fp16"

    def widen(self, start: int, end: int, cause: WireOverflow) -> str:
        """The dtype to redo a step with after `cause`; re-raises it when none is wider."""
        if self.mode != "compact" or self.for_stage(start, end) != "fp16":
            raise WireOverflow(f"{cause.message} (layers {start}-{end}; wire_dtype "
                               f"{self.mode} was asked for: use auto, compact, bf16 or "
                               f"fp32)",
                               layers=[start, end], wire_dtype=self.mode)
        self.widened.add((start, end))
        return self.for_stage(start, end)

    @property
    def lossless(self) -> bool:
        """Whether no stage rounds a hidden state (what the CLI and the API report)."""
        return self.mode in ("auto", LOSSLESS_WIRE)

    def check_forced(self, model: str) -> None:
        """`BadRequest` when a forced fp16 cannot carry the model's calibrated activations."""
        if self.mode != "fp16":
            return
        cal = self.calibration
        for b in range(-1, len(cal.absmax)):
            if not cal.fp16_fits(b):
                where = "the embeddings" if b < 0 else f"layer {b}"
                raise BadRequest(
                    f"wire_dtype fp16 cannot carry {model}'s activations: their calibrated "
                    f"max |value| after {where} is {cal.absmax_at(b):.0f}, × margin "
                    f"{WIRE_MARGIN:g} over fp16's {FP16_MAX:.0f}; use wire_dtype auto, bf16 "
                    f"or fp32", layer=b)
