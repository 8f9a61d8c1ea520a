"""`SamplingParams`: how a call picks its tokens, checked at the door (M26 §6 `bad_request`).

No torch here: the command line and `HearthNetClient` build and check a call's sampling
without loading it. The sampler itself is `generation.Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hearthnet.distributed_inference.engine.grammar import Constraint
from hearthnet.errors import BadRequest

MAX_LOGPROBS = 20  # OpenAI's bound on chat ``top_logprobs``


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy (argmax)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # None: no log-probabilities (the default path computes none); k in 0..MAX_LOGPROBS:
    # each token's log-probability and its k likeliest alternatives (`generation.Sampler`)
    logprobs: int | None = None
    # None: free text; else what the answer must match, enforced by masking each logits row
    # with the grammar's allowed tokens (`generation.Sampler`, M26 §5.4)
    grammar: Constraint | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        if not 1 <= self.max_tokens <= 8192:
            raise BadRequest(f"max_tokens must be in 1..8192, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 10.0 or self.temperature != self.temperature:
            raise BadRequest(f"temperature must be in 0..10, got {self.temperature}")
        if self.top_k < 0:
            raise BadRequest(f"top_k must be ≥ 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop) or len(self.stop) > 16:
            raise BadRequest("stop must be at most 16 non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be in 0..{MAX_LOGPROBS} or null, got "
                             f"{self.logprobs}", param="logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


SPECULATE_MODES = ("lookup", "draft", "off")  # DESIGN.md decision 16


def check_speculate(mode: object) -> str:
    """A call's ``speculate`` (`SPECULATE_MODES`), or `BadRequest` naming them."""
    if mode not in SPECULATE_MODES:
        raise BadRequest(f"speculate must be one of {', '.join(SPECULATE_MODES)}, got "
                         f"{mode!r}"[:200], param="speculate")
    return str(mode)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(p: SamplingParams) -> None:
    """Type checks at the door (M26 §6): `top_k=1.5` or `seed="abc"` is `bad_request`
    before any work, never an exception from the sampler mid-answer."""
    for name in ("max_tokens", "top_k"):
        if not _is_int(getattr(p, name)):
            raise BadRequest(f"{name} must be an integer, got {getattr(p, name)!r}"[:200])
    for name in ("temperature", "top_p"):
        v = getattr(p, name)
        if not (_is_int(v) or isinstance(v, float)):
            raise BadRequest(f"{name} must be a number, got {v!r}"[:200])
    if p.seed is not None and not (_is_int(p.seed) and 0 <= p.seed < 2**63):
        raise BadRequest(f"seed must be an integer in 0..2**63-1 or null, got {p.seed!r}"[:200])
    if not isinstance(p.stop, tuple):
        raise BadRequest("stop must be a list of strings")
    if p.grammar is not None and not isinstance(p.grammar, Constraint):
        raise BadRequest("grammar must be a Constraint or null", param="grammar")
    if p.logprobs is not None and not _is_int(p.logprobs):
        raise BadRequest(f"logprobs must be an integer or null, got {p.logprobs!r}"[:200],
                         param="logprobs")
