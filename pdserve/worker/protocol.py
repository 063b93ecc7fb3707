"""The worker's HTTP control API: every request and response body, as typed models.

One definition shared by the worker (server) and the router (client), so the two cannot drift.
Bodies are JSON; streamed endpoints send one `TokenEvent` per line (NDJSON). Every model
forbids unknown fields, so a typo in a client is a 400 naming the field, not a silent default.

Endpoints (role in brackets):
    GET  /health                    WorkerHealth                       [all]
    POST /reserve   ReserveRequest  -> Reservation                     [decode, both]
    POST /prefill   PrefillRequest  -> PrefillResult                   [prefill, both]
    POST /decode    DecodeRequest   -> stream of TokenEvent            [decode, both]
    POST /generate  GenerateRequest -> stream of TokenEvent            [both]
    POST /release   ReleaseRequest  -> ReleaseResult                   [all]
    POST /kv_abort  KVAbortRequest  -> KVAbortResult                   [decode, both]
    POST /renew     RenewRequest    -> RenewResult                     [decode, both]
    POST /kv_events KVEventsRequest -> stream of KVEventBatch          [all]
    GET  /metrics                   Prometheus text                    [all]
    GET  /debug/requests/{id}       WorkerEvents                       [all]
Errors are `ErrorBody` with an HTTP status: 400 bad input, 404 unknown request, 409 wrong role
or state, 503 no capacity (with Retry-After).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.sampling_params import SamplingParams

Role = Literal["prefill", "decode", "both"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingModel(_Model):
    """Wire form of `SamplingParams` (validated again when converted)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    def to_params(self) -> SamplingParams:
        """The engine's params; raises SamplingParamsError naming a bad field."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplingModel:
        return cls(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
        )


class WorkerHealth(_Model):
    """What the router needs to place work on this worker."""

    worker_id: str
    role: Role
    pid: int
    # Fingerprint fields (see pdserve.model.fingerprint) and its digest.
    fingerprint: dict[str, str | int | float]
    fingerprint_digest: str
    # "host:port" of the KV transfer endpoint; None for a prefill-only worker.
    transfer_address: str | None
    max_model_len: int
    block_size: int
    num_blocks: int
    num_free_blocks: int
    # Blocks held for another party (prefill KV awaiting transfer, decode reservations).
    num_pinned_blocks: int
    num_running: int
    num_waiting: int
    num_active_leases: int
    # The worker's monotonic clock when the call arrived and as it answered, and its wall
    # clock: the router aligns the worker's timeline events with its own from them (NTP-style,
    # `observability.clock_sync`). None from workers that predate them.
    request_monotonic_ns: int | None = None
    monotonic_ns: int | None = None
    wall_time_s: float | None = None


class ReserveRequest(_Model):
    """Reserve a decode slot and blocks for a prompt whose KV will be transferred in."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingModel
    # The reservation (and its blocks) is freed if the KV is not committed within this time.
    lease_ttl_s: float = Field(default=30.0, gt=0)


class Reservation(_Model):
    """Where and how the prefill worker must send the KV."""

    request_id: str
    transfer_id: str  # hex, 16 bytes
    capability_token: str  # hex, secret of this transfer
    transfer_address: str  # host:port of the decode worker's KV endpoint
    # Leading prompt tokens the decode worker already has (prefix cache); not sent.
    num_cached_tokens: int
    lease_ttl_s: float


class PrefillRequest(_Model):
    """Prefill a prompt, return its first token, then push the KV to the reservation."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingModel
    # None: prefill only, nothing to transfer (the KV is released at once).
    reservation: Reservation | None = None
    lease_ttl_s: float = Field(default=30.0, gt=0)
    # Sends of the KV (first try included) before the prefill worker gives up on it.
    transfer_attempts: int = Field(default=4, ge=1, le=100)
    # The decode worker's control URL: told at once (POST /kv_abort) when the send is given
    # up, so its /decode fails now instead of when the reservation's lease ends.
    decode_url: str | None = None


class RenewRequest(_Model):
    """POST /renew: the router still wants this reservation (its prefill is running)."""

    request_id: str


class RenewResult(_Model):
    request_id: str
    # Seconds the reservation now lives without another renewal.
    lease_ttl_s: float


class KVAbortRequest(_Model):
    """POST /kv_abort: the prefill side gave up sending this reservation's KV."""

    request_id: str
    # The reservation's, proving the caller is the sender it was handed to.
    transfer_id: str
    capability_token: str
    reason: str


class KVAbortResult(_Model):
    request_id: str
    # False: no such pending reservation (already verified, released or expired).
    cancelled: bool


class PrefillResult(_Model):
    """The first generated token; the KV transfer continues in the background."""

    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    # Monotonic-clock nanoseconds on the worker, for the request timeline.
    prefill_start_ns: int
    prefill_end_ns: int


class DecodeRequest(_Model):
    """Decode a reserved request once its KV is verified, streaming from the second token."""

    request_id: str
    first_token_id: int
    # Give up (and free the reservation) if the KV is not verified by then.
    kv_timeout_s: float = Field(default=30.0, gt=0)


class GenerateRequest(_Model):
    """A whole request on one worker (colocated)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingModel
    # Tokens already sent to the client by a worker that died: generation resumes after them
    # (migration). The stream carries only the tokens that follow.
    output_token_ids: list[int] = Field(default_factory=list)


class TokenEvent(_Model):
    """One line of a token stream."""

    token_ids: list[int]
    finished: bool = False
    # "stop" or "length" once finished; "error" with `error` set if the worker failed it.
    finish_reason: str | None = None
    error: str | None = None


class ReleaseRequest(_Model):
    request_id: str


class ReleaseResult(_Model):
    request_id: str
    num_freed_blocks: int


class WorkerEventModel(_Model):
    """One timeline event of a worker (see `observability.timeline_log.TimelineEvent`)."""

    request_id: str
    event: str
    # The worker's monotonic clock, nanoseconds; wall clock, seconds since the epoch.
    monotonic_ns: int
    wall_time_s: float
    detail: str = ""


class WorkerEvents(_Model):
    """GET /debug/requests/{id}: the worker's events for a router request id (suffixes
    `.rN`, `.mN` included), with its clocks read as it answered."""

    worker_id: str
    role: Role
    # The worker's monotonic clock when the call arrived and as it answered (a clock echo).
    request_monotonic_ns: int
    monotonic_ns: int
    wall_time_s: float
    events: list[WorkerEventModel]


class KVEventsRequest(_Model):
    """POST /kv_events: follow this worker's prefix cache (blocks stored and evicted)."""

    # Resume after this event of this epoch. None, another epoch (the worker restarted) or an
    # event the worker no longer has (a gap): the stream starts with a snapshot instead.
    after_seq: int | None = Field(default=None, ge=0)
    epoch: str | None = None


KVEventBatchKind = Literal["snapshot", "stored", "evicted", "cleared", "heartbeat"]


class KVEventBatch(_Model):
    """One line of a KV event stream (see `engine.kv_events`).

    `snapshot`: every hash cached now, as of event `seq` (replace what you had); `stored`,
    `evicted`, `cleared`: event number `seq`, to apply only right after `seq - 1`;
    `heartbeat`: nothing happened, the newest event is still `seq` (sent after a second of
    silence, so a silent stream means a silent worker).
    """

    epoch: str
    seq: int
    kind: KVEventBatchKind
    # Chained block hashes (unsigned 64-bit).
    block_hashes: list[int] = Field(default_factory=list)


class ErrorBody(_Model):
    """Every non-2xx response."""

    error: str
    # Exception class from pdserve.errors, e.g. "PromptTooLong".
    type: str
    retryable: bool = False
    worker_id: str | None = None


class FaultPlanBody(_Model):
    """POST /admin/faults: the fault plan that replaces the current one (tests only)."""

    # `pdserve.faults` rules, `SITE:ACTION[:key=value,...]`, applied in order.
    rules: list[str]
    seed: int = 0


class InjectedFaultModel(_Model):
    """One fault that fired: its site, the 0-based hit index there, and the action."""

    site: str
    hit: int
    action: str


class FaultState(_Model):
    """GET /admin/faults: the plan and what it injected since it was set."""

    rules: list[str]
    seed: int
    injected: list[InjectedFaultModel]
    # Hits counted per site since the plan was set.
    hits: dict[str, int]
