"""The frames a chat streams to its caller (M26 §4.3 ``StreamFrame``): defined here, once.

Each frame type is a small frozen dataclass; `StreamFrame` is their union::

    token_delta       TokenDelta        one more piece of the answer
    shard_status      ShardStatus       a stage is ``ok`` (at construction) or ``degraded``
    shard_failover    ShardFailover     a failed stage was replaced and replayed (M26 §5.4)
    wire_widened      WireWidened       a stage's wire dtype was widened (no one blamed)
    pipeline_aborted  PipelineAborted   the pipeline gave up; the answer may go on locally
    done              Done              the answer is complete (always the last frame)
    error             ErrorFrame        the call failed (always the last frame)

The orchestrator builds them (`distributed_inference/orchestrator/frames.py` builds the two
that need a generation's state), the node sends `to_wire()` maps over its bus and prints
them in ``hearthnet chat --json``, and the HTTP API, `hearthnet.client` and the CLI read
maps back with `from_wire`. The wire map's keys are the spec's: a field named differently
in Python (``from``) says its key in its metadata; an optional field is left out of the
map while it holds its default.

A map from a peer is checked before it is used: a missing key, a value of the wrong type
or an unknown ``type`` is a `PeerDataError` naming the frame and the key, never a
`KeyError` (h11's remote-error rule). Keys a newer node adds are ignored. A caller that
may talk to a newer node reads with `read_frame`, which keeps a frame of a type it does
not know as an `OtherFrame` instead of failing the call.

Ground floor: the standard library and `hearthnet.errors` only, so host apps and the CLI
commands that only talk to a node read frames without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeAlias

from hearthnet.errors import CallerError, HearthNetError, PeerDataError, error_from_code

__all__ = ["FRAME_TYPES", "Done", "ErrorFrame", "OtherFrame", "PipelineAborted",
           "ShardFailover", "ShardStatus", "StreamFrame", "TokenDelta", "WireWidened",
           "from_wire", "is_incident", "read_frame"]

# ---- reading one value of a peer's map: returns it as held, or raises TypeError ----

_Read = Callable[[object], Any]


def _str(v: object) -> str:
    if isinstance(v, str):
        return v
    raise TypeError("a string")


def _int(v: object) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise TypeError("an integer")


def _num(v: object) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise TypeError("a number")


def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    raise TypeError("true or false")


def _strs(v: object) -> tuple[str, ...]:
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return tuple(v)
    raise TypeError("a list of strings")


def _layers(v: object) -> tuple[int, int]:
    if isinstance(v, (list, tuple)) and len(v) == 2:
        return _int(v[0]), _int(v[1])
    raise TypeError("a [start, end] pair of integers")


def _map(v: object) -> dict[str, Any]:
    if isinstance(v, Mapping) and all(isinstance(k, str) for k in v):
        return dict(v)
    raise TypeError("a map with string keys")


def _counts(v: object) -> dict[str, int]:
    m = _map(v)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in m.values()):
        return m
    raise TypeError("a map of integers")


def _logprob(v: object) -> float:
    x = _num(v)
    if math.isfinite(x) and x <= 0.0:
        return x
    raise TypeError("a log-probability (a finite number ≤ 0)")


_MAX_TOKEN_BYTES = 256  # far above any vocabulary's longest token
_MAX_TOP = 20  # `SamplingParams.logprobs`'s bound


def _bytes(v: object) -> bytes:
    if isinstance(v, (list, tuple)) and len(v) <= _MAX_TOKEN_BYTES and all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 255 for b in v):
        return bytes(v)
    raise TypeError(f"a list of at most {_MAX_TOKEN_BYTES} byte values")


def _top(v: object) -> tuple[tuple[int, float, bytes], ...]:
    if isinstance(v, (list, tuple)) and len(v) <= _MAX_TOP and all(
            isinstance(e, (list, tuple)) and len(e) == 3 for e in v):
        return tuple((_int(e[0]), _logprob(e[1]), _bytes(e[2])) for e in v)
    raise TypeError(f"a list of at most {_MAX_TOP} [token_id, logprob, bytes] entries")


def _nullable(read: _Read) -> _Read:
    """A value that is always on the wire but may be null (``continuing``)."""
    return lambda v: None if v is None else read(v)


def _wire(read: _Read, key: str | None = None) -> dict[str, Any]:
    """A frame field's metadata: how to read its value, and its wire key when that is not
    its name. A field with a default is optional: left out of the map while it holds it."""
    return {"read": read, "key": key}


# ---- the frames ----

class _Wire:
    """The wire form shared by every frame type (no state: each subclass has slots)."""

    __slots__ = ()
    TYPE: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        """The frame as the bus and ``--json`` carry it: a map of plain values."""
        out: dict[str, Any] = {"type": self.TYPE}
        for f in fields(self):  # type: ignore[arg-type]  # every subclass is a dataclass
            v = getattr(self, f.name)
            if f.default is not MISSING and v == f.default:
                continue
            out[f.metadata["key"] or f.name] = _plain(v)
        return out

    @classmethod
    def _from_map(cls, raw: Mapping[str, Any]) -> Any:
        values: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            key = f.metadata["key"] or f.name
            if key not in raw:
                if f.default is not MISSING:
                    continue
                raise PeerDataError(f"a {cls.TYPE} frame without its {key!r}: the node "
                                    "that sent it is of another version or broken",
                                    frame=cls.TYPE, key=key)
            try:
                values[f.name] = f.metadata["read"](raw[key])
            except TypeError as e:
                raise PeerDataError(f"a {cls.TYPE} frame whose {key!r} is not {e}: "
                                    f"{type(raw[key]).__name__}", frame=cls.TYPE,
                                    key=key) from None
        return cls(**values)


def _plain(v: Any) -> Any:
    """Tuples go as lists, bytes as lists of byte values and maps as copies: what msgpack
    and JSON give back (and JSON has no bytes)."""
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, bytes):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    return v


@dataclass(frozen=True, slots=True)
class TokenDelta(_Wire):
    """One more piece of the answer: `text` may be empty (a token that ends mid-character).

    With a call's ``sampling.logprobs`` set: `logprob` (the token's log-probability under
    the model, before sampling transforms), `token_bytes` (the bytes the token stands for,
    wire key ``bytes``) and `top_logprobs` (the likeliest tokens, likeliest first, as
    ``[token_id, logprob, bytes]``); all three left out otherwise.
    """

    TYPE: ClassVar[str] = "token_delta"
    text: str = field(metadata=_wire(_str))
    token_id: int = field(metadata=_wire(_int))
    index: int = field(metadata=_wire(_int))
    logprob: float | None = field(default=None, metadata=_wire(_logprob))
    token_bytes: bytes | None = field(default=None, metadata=_wire(_bytes, "bytes"))
    top_logprobs: tuple[tuple[int, float, bytes], ...] | None = field(
        default=None, metadata=_wire(_top))


@dataclass(frozen=True, slots=True)
class ShardStatus(_Wire):
    """A stage of the pipeline: ``ok`` at construction (with its layers, wire dtype and
    how its weights are held — a compact format is never silent), or ``degraded`` when it
    failed (with the error's code and message; M26 §5.4)."""

    TYPE: ClassVar[str] = "shard_status"
    shard_id: str = field(metadata=_wire(_str))
    status: str = field(metadata=_wire(_str))
    layers: tuple[int, int] | None = field(default=None, metadata=_wire(_layers))
    wire_dtype: str | None = field(default=None, metadata=_wire(_str))
    code: str | None = field(default=None, metadata=_wire(_str))
    message: str | None = field(default=None, metadata=_wire(_str))
    weights_format: str | None = field(default=None, metadata=_wire(_str))
    kernel: str | None = field(default=None, metadata=_wire(_str))

    @classmethod
    def ok(cls, shard_id: str, layers: tuple[int, int], wire_dtype: str,
           weights_format: str | None = None, kernel: str | None = None) -> ShardStatus:
        return cls(shard_id, "ok", layers=layers, wire_dtype=wire_dtype,
                   weights_format=weights_format, kernel=kernel or None)

    @classmethod
    def degraded(cls, shard_id: str, cause: HearthNetError) -> ShardStatus:
        return cls(shard_id, "degraded", code=cause.code, message=cause.message)


@dataclass(frozen=True, slots=True)
class ShardFailover(_Wire):
    """Stage `failed` was replaced by `replacement` and its positions replayed (M26 §5.4)."""

    TYPE: ClassVar[str] = "shard_failover"
    failed: str = field(metadata=_wire(_str))
    replacement: tuple[str, ...] = field(metadata=_wire(_strs))
    pipeline: tuple[str, ...] = field(metadata=_wire(_strs))
    replayed_positions: int = field(metadata=_wire(_int))
    ms: float = field(metadata=_wire(_num))


@dataclass(frozen=True, slots=True)
class WireWidened(_Wire):
    """A stage's activations overflowed its wire dtype: it was reopened with a wider one
    and the step redone; no shard is blamed (M26 §5.3)."""

    TYPE: ClassVar[str] = "wire_widened"
    shard_id: str = field(metadata=_wire(_str))
    layers: tuple[int, int] = field(metadata=_wire(_layers))
    step: int = field(metadata=_wire(_int))
    from_dtype: str = field(metadata=_wire(_str, "from"))
    to_dtype: str = field(metadata=_wire(_str, "to"))


@dataclass(frozen=True, slots=True)
class PipelineAborted(_Wire):
    """The pipeline gave up; ``continuing == "local"`` when the answer goes on locally,
    None when an `ErrorFrame` follows (M26 §5.4)."""

    TYPE: ClassVar[str] = "pipeline_aborted"
    reason: str = field(metadata=_wire(_str))
    continuing: str | None = field(metadata=_wire(_nullable(_str)))
    tokens_so_far: int = field(metadata=_wire(_int))


@dataclass(frozen=True, slots=True)
class Done(_Wire):
    """The answer is complete.

    `usage` holds ``prompt_tokens`` and ``completion_tokens``; `timings` at least
    ``first_token_ms``, ``tokens_per_second`` and ``total_ms`` (plus construction, failover
    and per-shard figures after a pipeline); `pipeline` the shard ids that served the end
    of the call (``["local"]`` after a fallback). `failovers` is counted by the pipeline
    path; `fallback` is true when the local engine finished the answer; `speculative` says
    how many proposed tokens the answer's passes verified and accepted.
    """

    TYPE: ClassVar[str] = "done"
    finish_reason: str | None = field(metadata=_wire(_nullable(_str)))
    usage: dict[str, int] = field(metadata=_wire(_counts))
    timings: dict[str, Any] = field(metadata=_wire(_map))
    pipeline: tuple[str, ...] = field(metadata=_wire(_strs))
    formats: dict[str, Any] | None = field(default=None, metadata=_wire(_map))
    failovers: int | None = field(default=None, metadata=_wire(_int))
    fallback: bool = field(default=False, metadata=_wire(_bool))
    # proposals verified (DESIGN.md decision 16): mode, passes, proposed, accepted,
    # tokens_per_pass; None when the call did not speculate
    speculative: dict[str, Any] | None = field(default=None, metadata=_wire(_map))

    @property
    def text_tokens(self) -> int:
        """The answer's length in tokens (``usage.completion_tokens``)."""
        return int(self.usage.get("completion_tokens", 0))


@dataclass(frozen=True, slots=True)
class ErrorFrame(_Wire):
    """The call failed with a `hearthnet.errors` code (spec §6); `exception()` rebuilds it.

    `tokens_so_far` is set by a caller whose node went away mid-answer.
    """

    TYPE: ClassVar[str] = "error"
    code: str = field(metadata=_wire(_str))
    message: str = field(metadata=_wire(_str))
    details: dict[str, Any] | None = field(default=None, metadata=_wire(_map))
    tokens_so_far: int | None = field(default=None, metadata=_wire(_int))

    @classmethod
    def of(cls, err: HearthNetError, *, tokens_so_far: int | None = None) -> ErrorFrame:
        """The frame of `err`: its code and message (its details stay in this node's log),
        and for a caller's mistake the request field it names (``param``: a field's name,
        never a value), so the HTTP API's 400 names it as OpenAI's does."""
        param = err.details.get("param") if isinstance(err, CallerError) else None
        return cls(err.code, err.message, details={"param": param} if isinstance(param, str)
                   else None, tokens_so_far=tokens_so_far)

    def exception(self) -> HearthNetError:
        """The matching `hearthnet.errors` class, to raise at the caller."""
        return error_from_code(self.code, self.message, self.details)


StreamFrame: TypeAlias = (TokenDelta | ShardStatus | ShardFailover | WireWidened
                          | PipelineAborted | Done | ErrorFrame)

_BY_TYPE: dict[str, type[_Wire]] = {c.TYPE: c for c in (
    TokenDelta, ShardStatus, ShardFailover, WireWidened, PipelineAborted, Done, ErrorFrame)}
FRAME_TYPES = frozenset(_BY_TYPE)
"""The ``type`` of every frame this version sends."""


@dataclass(frozen=True, slots=True)
class OtherFrame:
    """A frame of a type this version does not know (a newer node's): kept, not dropped."""

    type: str
    raw: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return dict(self.raw)


def from_wire(raw: object) -> StreamFrame:
    """The typed frame of one wire map.

    Raises:
        PeerDataError: `raw` is not a map, lacks a key, holds a value of the wrong type or
            names a type this version does not know.
    """
    if not isinstance(raw, Mapping):
        raise PeerDataError(f"a chat frame is a map, not {type(raw).__name__}")
    kind = raw.get("type")
    cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise PeerDataError(f"a chat frame of unknown type {kind!r}; this version knows "
                            f"{sorted(FRAME_TYPES)}", frame=str(kind), key="type")
    frame: StreamFrame = cls._from_map(raw)
    return frame


def read_frame(raw: object) -> StreamFrame | OtherFrame:
    """As `from_wire`, but a well-formed map of an unknown type is an `OtherFrame`: a
    caller of a newer node goes on past the diagnostics it does not know."""
    if isinstance(raw, Mapping) and isinstance(raw.get("type"), str) \
            and raw["type"] not in FRAME_TYPES:
        return OtherFrame(raw["type"], dict(raw))
    return from_wire(raw)


def is_incident(frame: StreamFrame | OtherFrame) -> bool:
    """A failover, an abort or a degraded stage: what the status page lists and the API's
    ``hearthnet.events`` carry (routine frames and the ending are not)."""
    return isinstance(frame, (ShardFailover, PipelineAborted)) or (
        isinstance(frame, ShardStatus) and frame.status != "ok")
