"""The whole pdserve exception tree, in one place.

Every error pdserve raises on purpose is a subclass of `PdserveError`. Each class states whether
retrying the same operation (possibly elsewhere) can succeed: the router's failure policy reads
`retryable` and never parses messages. Messages name what a user needs to act: the file, the
field, the worker, the frame.

    PdserveError
    ├── ConfigError                     bad CLI flag, config value or sampling parameter
    │   ├── SamplingParamsError
    │   ├── GrammarError                a structured-output spec that cannot compile (names why)
    │   └── GrammarUnavailable          structured output asked, extra pdserve[grammar] absent
    ├── ModelError                      a model folder pdserve cannot load
    │   ├── ModelFileMissing            file absent (names the file)
    │   ├── ModelConfigError            config.json field missing or invalid (names the field)
    │   ├── UnsupportedArchitecture     architecture not in the supported list
    │   └── WeightShapeMismatch         tensor shape differs from config (names tensor, shapes)
    ├── FingerprintMismatch             two engines whose KV is not interchangeable (names fields)
    ├── WrongRole                       the endpoint is not served by this worker's role
    ├── AuthError                       the cluster credential is missing or wrong
    │   ├── Unauthenticated             no credential at all (HTTP 401)
    │   ├── Forbidden                   forged, expired or replayed credential (HTTP 403)
    │   └── StaleInstance               a call meant for an earlier life of this worker (HTTP 410;
    │                                   retryable: the router re-reads the worker and recovers)
    ├── DeadlineExceeded                the request's deadline passed while a worker waited
    ├── PeerCallError                   a worker's call to another worker failed (retryable)
    ├── Draining                        the worker drains (SIGTERM, /admin/drain): no new work
    │                                   (503, retryable elsewhere)
    ├── EngineError
    │   ├── NoFreeBlocks                no KV blocks for the request right now (retryable)
    │   ├── Overloaded                  the worker's admission queue is full (retryable, 503)
    │   ├── RequestNotFound             unknown request id
    │   ├── DuplicateRequest            request id already in the engine
    │   ├── PromptTooLong               prompt + max_tokens exceed the model or the KV cache
    │   ├── KVNotReady                  remote KV for a request is not complete and verified
    │   ├── KVValueMismatch             verified KV computes something else (the canary; retryable)
    │   └── CheckpointRefused           a decode checkpoint refused: no room, bad version,
    │                                   fingerprint, checksum or chain (names the reason)
    ├── LeaseError
    │   ├── LeaseExpired                the grant lapsed (retryable: ask for a new one)
    │   └── StaleLease                  a newer grant (higher epoch) supersedes this one
    ├── RouterError
    │   ├── IllegalRequestTransition    a request state change the table does not allow
    │   ├── InvalidRequest              a client request refused with 400 (names the param)
    │   ├── NoCapacity                  no worker can take the request now (503, retryable)
    │   ├── WorkerUnreachable           connection refused, reset or timed out (retryable)
    │   └── WorkerCallError             a worker answered non-2xx; carries its error body
    └── TransferError                   KV data plane
        ├── ProtocolError               a peer sent bytes that are not a valid frame or message
        │   ├── FrameTruncated
        │   ├── FrameTooLarge
        │   ├── BadMagic
        │   ├── UnsupportedVersion
        │   └── ChecksumMismatch        (retryable: the bytes were damaged in flight)
        ├── IllegalTransition           a session event not allowed in its current state
        │   └── StaleAttempt            a frame from an older attempt of the transfer (fenced)
        ├── TransferTimeout             a per-chunk or per-transfer deadline passed (retryable)
        ├── PeerClosed                  connection lost mid-transfer (retryable)
        ├── StreamBroken                this end closed, or left mid-write by a cancelled op
        ├── TransferRefused             the peer sent Nack (retryable per reason)
        ├── TransportUnavailable        the KV transport asked for cannot be used (names why)
        └── Unauthorized                wrong capability token: no data is sent
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""

    retryable: bool = False

    def client_message(self) -> str:
        """The text an API client is shown: the message, less what is internal to the cluster."""
        return str(self)


class PeerCallError(PdserveError):
    """A worker's control call to another worker (a checkpoint holder) failed; `status` is
    the HTTP status (0: unreachable) and `error_type` the peer's error class, if any."""

    retryable = True

    def __init__(self, url: str, status: int, error_type: str, detail: str) -> None:
        super().__init__(f"worker {url}: {error_type or 'unreachable'} ({status}): {detail}")
        self.url = url
        self.status = status
        self.error_type = error_type


class ConfigError(PdserveError, ValueError):
    """A configuration or CLI value is invalid; the message names the field and the value."""


class SamplingParamsError(ConfigError):
    """A sampling parameter is out of range."""


class GrammarError(SamplingParamsError):
    """A structured-output spec (JSON schema, regex, choice, grammar) the grammar library
    cannot compile; the message says what is wrong."""


class GrammarUnavailable(SamplingParamsError):
    """Structured output was asked for, but the optional grammar library is not installed."""


class ModelError(PdserveError):
    """A model folder cannot be loaded."""


class ModelFileMissing(ModelError, FileNotFoundError):
    """A required file is not in the model folder."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"model file missing: {path} ({what})")
        self.path = path


class ModelConfigError(ModelError):
    """A config field is missing or has an unsupported value."""

    def __init__(self, file: str, field: str, detail: str) -> None:
        super().__init__(f"{file}: field {field!r}: {detail}")
        self.file = file
        self.field = field


class UnsupportedArchitecture(ModelError):
    """The checkpoint's architecture is not one pdserve implements."""

    def __init__(self, file: str, architecture: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"{file}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )
        self.architecture = architecture


class WeightShapeMismatch(ModelError):
    """A tensor in the checkpoint has a shape that the config does not predict."""

    def __init__(
        self, file: str, tensor: str, expected: tuple[int, ...], actual: tuple[int, ...]
    ) -> None:
        super().__init__(
            f"{file}: tensor {tensor!r} has shape {list(actual)}, config implies {list(expected)}"
        )
        self.file = file
        self.tensor = tensor


class FingerprintMismatch(PdserveError):
    """Two engines' KV caches are not interchangeable; `fields` lists every differing field."""

    def __init__(self, fields: dict[str, tuple[object, object]], context: str = "") -> None:
        parts = ", ".join(f"{name}: {a!r} != {b!r}" for name, (a, b) in sorted(fields.items()))
        prefix = f"{context}: " if context else ""
        super().__init__(f"{prefix}fingerprint mismatch on {parts}")
        self.fields = fields


class WrongRole(PdserveError):
    """This worker's role does not serve the endpoint (e.g. /prefill on a decode worker)."""


class AuthError(PdserveError):
    """A call or connection did not prove it belongs to the cluster."""


class Unauthenticated(AuthError):
    """No cluster credential was presented (HTTP 401)."""


class Forbidden(AuthError):
    """The credential is forged, outside its time window or a replay (HTTP 403)."""


class StaleInstance(AuthError):
    """A call signed for an earlier instance of this worker (it restarted at the same address):
    whatever the caller relied on there died with that instance (HTTP 410)."""

    retryable = True


class DeadlineExceeded(PdserveError):
    """The request's deadline passed while a worker waited on its behalf."""


class Draining(PdserveError):
    """The worker is draining (SIGTERM or POST /admin/drain): it finishes what it holds and
    takes nothing new; another worker can (HTTP 503)."""

    retryable = True


class EngineError(PdserveError):
    """An engine-level request error."""


class NoFreeBlocks(EngineError):
    """Not enough free KV blocks for the request now; another worker or a retry may do."""

    retryable = True


class RequestNotFound(EngineError, KeyError):
    """No request with this id is in the engine."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "request not found"


class DuplicateRequest(EngineError):
    """A request with this id is already in the engine."""


class PromptTooLong(EngineError):
    """The prompt (plus max_tokens) does not fit the model's context or the KV cache."""


class KVNotReady(EngineError):
    """A request's remote KV has not been fully received and verified."""


class Overloaded(EngineError):
    """The worker's admission queue is full; another worker or a later retry may do."""

    retryable = True


class CheckpointRefused(EngineError):
    """A checkpoint holder refused a put or a read; `reason` is a bounded metric label
    ("full", "version", "fingerprint", "checksum", "chain", "missing")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVValueMismatch(EngineError):
    """Received KV passed its checksums but does not compute what the sender's did.

    The decode side recomputed the last prompt position from the received blocks and its
    output differs from the prefill side's digest: blocks mapped wrongly, a model difference
    the fingerprint missed, or KV damaged before its checksum was taken. Another prefill (or a
    local one) can still serve the request.
    """

    retryable = True


class ErrorBodyLike(Protocol):
    """What WorkerCallError needs of a worker's error body (`worker.protocol.ErrorBody`)."""

    @property
    def error(self) -> str: ...

    @property
    def type(self) -> str: ...

    @property
    def retryable(self) -> bool: ...


class RouterError(PdserveError):
    """An error raised by the router."""


class IllegalRequestTransition(RouterError):
    """A request's state machine was asked for a transition its table does not allow."""

    def __init__(self, request_id: str, current: str, target: str) -> None:
        super().__init__(f"request {request_id}: illegal transition {current} -> {target}")
        self.current = current
        self.target = target


class NoCapacity(RouterError):
    """No compatible worker can take the request now; the client should retry later."""

    retryable = True

    def __init__(self, detail: str, retry_after_s: int = 1, tried: Collection[str] = ()) -> None:
        suffix = f" (tried {sorted(tried)})" if tried else ""
        super().__init__(f"no capacity: {detail}{suffix}")
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.num_tried = len(tried)

    def client_message(self) -> str:
        # The workers tried are counted, not named: their addresses stay inside the cluster.
        suffix = f" ({self.num_tried} workers tried)" if self.num_tried else ""
        return f"no capacity: {self.detail}{suffix}"


class WorkerUnreachable(RouterError):
    """The worker did not answer: connection refused or reset, or the call timed out."""

    retryable = True

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(f"worker {url}: unreachable: {detail}")
        self.url = url
        self.detail = detail

    def client_message(self) -> str:
        # Worker addresses stay inside the cluster; the router's log and the request's
        # timeline (/debug/requests/{id}) name the worker for an operator.
        return f"a worker did not answer: {self.detail}"


class WorkerCallError(RouterError):
    """A worker answered a call with a non-2xx status and an `ErrorBody`."""

    def __init__(self, url: str, status: int, body: ErrorBodyLike) -> None:
        super().__init__(f"worker {url}: HTTP {status}: {body.type}: {body.error}")
        self.url = url
        self.status = status
        self.body = body
        # 503 (no capacity) is worth trying elsewhere whatever the body says.
        self.retryable = body.retryable or status == 503

    def client_message(self) -> str:
        return f"a worker answered HTTP {self.status}: {self.body.type}: {self.body.error}"


class InvalidRequest(RouterError):
    """A client request the router refuses (HTTP 400): names the OpenAI `param` at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class LeaseError(PdserveError):
    """A lease-fenced operation was refused."""


class LeaseExpired(LeaseError):
    """The lease lapsed; its blocks may already be reused."""

    retryable = True


class StaleLease(LeaseError):
    """The grant's epoch is older than the current one."""


class TransferError(PdserveError):
    """An error on the KV data plane."""


class ProtocolError(TransferError):
    """Bytes from the peer are not a valid frame or message."""


class FrameTruncated(ProtocolError):
    """The stream ended inside a frame."""


class FrameTooLarge(ProtocolError):
    """A length field exceeds its bound."""


class BadMagic(ProtocolError):
    """The frame does not start with the pdserve magic."""


class UnsupportedVersion(ProtocolError):
    """The peer speaks a protocol version this build does not."""


class ChecksumMismatch(ProtocolError):
    """A checksum over a header, payload or whole transfer did not match."""

    retryable = True


class IllegalTransition(TransferError):
    """A session received an event that its current state does not allow."""


class StaleAttempt(IllegalTransition):
    """A frame belongs to an older attempt than the session's current one; it is ignored."""


class TransferTimeout(TransferError):
    """A deadline passed while waiting on the peer."""

    retryable = True


class PeerClosed(TransferError):
    """The connection closed in the middle of a transfer."""

    retryable = True


class StreamBroken(TransferError):
    """This end of a byte stream is closed, or a cancelled send/receive left it mid-message."""

    # The attempt on this stream is lost; a new attempt on a new stream may succeed.
    retryable = True


class TransferRefused(TransferError):
    """The peer refused the transfer (Nack); `reason` says why."""

    def __init__(self, reason: str, retryable: bool) -> None:
        super().__init__(f"transfer refused by peer: {reason}")
        self.reason = reason
        self.retryable = retryable


class LinkUnsupported(TransferError):
    """The checkpoint holder does not serve replication links (an older build): its puts go
    through a transfer session each instead."""


class TransportUnavailable(TransferError):
    """A KV transport asked for explicitly cannot be used between these two workers."""


class Unauthorized(TransferError):
    """The peer did not present the transfer's capability token."""
