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
    POST /kv_events KVEventsRequest -> stream of KVEventBatch          [all]   (`worker_observe.py`)
    POST /checkpoint/{put,renew,release,lookup,send}  (`checkpoint_protocol.py`) [decode, both]
    GET  /metrics                   Prometheus text                    [all]
    GET  /debug/requests/{id}       WorkerEvents                       [all]   (`worker_observe.py`)
    GET/POST/DELETE /admin/faults   FaultState    (tests only)         [all]   (`worker_observe.py`)
Errors are `ErrorBody` with an HTTP status: 400 bad input, 401 no cluster credential, 403 a
forged, stale or replayed credential (or a capability token that does not match), 404 unknown
request, 409 wrong role or state, 503 no capacity (with Retry-After), 504 the request's deadline
passed while the worker waited.

Every endpoint but GET /health and GET /metrics needs the cluster credential: an
`X-Pdserve-Auth` header signed with the cluster secret (`pdserve.auth.signing`); those two are
read-only and left open for load-balancer probes and Prometheus scrapes, which cannot sign.

Deadlines: `deadline_s` on the calls that make a worker wait on the router's behalf is the time
the router will still wait for this request, in seconds from when the call was sent; the worker
gives up (and frees what the request holds) once it has passed, so a router that died or froze
cannot leave work running on a worker forever.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.protocol.checkpoint_policy import CheckpointPolicy
from pdserve.protocol.logprobs import TokenLogprobs
from pdserve.protocol.sampling import SamplingParams

Role = Literal["prefill", "decode", "both"]
Transport = Literal["nixl", "shm", "tcp"]
# Reservation format; a prefill worker refuses one it does not know (named field).
RESERVATION_VERSION = 2
# Upper bounds of durations on the wire. A lease is renewed by its holder's liveness, so none
# needs to be long; one of 1e300 s from a buggy or hostile caller would never expire and pin
# its KV for good. Waits (deadlines, KV timeouts) get a day.
MAX_LEASE_TTL_S = 3600.0
MAX_WAIT_S = 86400.0


def body_limit_bytes(max_model_len: int) -> int:
    """The largest request body the router and the workers read, from the model's length.

    64 bytes per position covers a full-length prompt however it is written (token ids, text,
    chat JSON with escapes) and 4 MiB the rest (tools, schemas, grammars); a fixed 1 MiB
    (aiohttp's default) refused prompts of ~150k tokens that the model could take.
    """
    return 4 * 1024 * 1024 + 64 * max_model_len


class WireModel(BaseModel):
    """Every wire model's base: unknown fields, NaN and infinities refused (400 naming them)."""

    # NaN and infinities are not JSON: a duration of Infinity would reach a lease or a
    # deadline that cannot take it, so they are refused with the field named (400).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LogprobModel(WireModel):
    """Wire form of `TokenLogprobs`: one position's logprob and top alternatives.

    JSON floats round-trip exactly (a float32 value is a float64 without loss, and the
    encoder writes the shortest repr that reads back the same), so a logprob reaches the
    router bit for bit."""

    token_id: int
    logprob: float
    # The most likely tokens and their logprobs, most likely first.
    top_token_ids: list[int] = Field(default_factory=list)
    top_logprobs: list[float] = Field(default_factory=list)

    @classmethod
    def of(cls, lp: TokenLogprobs) -> LogprobModel:
        """The wire form of the engine's value."""
        return cls(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )


class StepTotalsModel(WireModel):
    """Cumulative engine step figures (`pdserve.engine.step_stats.StepTotals`): steps and
    seconds per kind (decode-only, prefill-only, mixed), tokens per phase, and the busy
    seconds attributed to each phase. The router differences two polls to size a P:D split."""

    num_steps: int
    num_decode_steps: int
    num_prefill_steps: int
    num_mixed_steps: int
    decode_steps_s: float
    prefill_steps_s: float
    mixed_steps_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    prefill_busy_s: float
    decode_busy_s: float


class WorkerHealth(WireModel):
    """What the router needs to place work on this worker."""

    worker_id: str
    # Drawn at each process start: a worker restarted at the same address has a new one, and
    # calls signed for the old one are refused (StaleInstance). Empty: not told (tests' fakes).
    instance_id: str = ""
    # True once the worker drains (SIGTERM, POST /admin/drain): it finishes what it holds and
    # takes no new request; the router chooses it for nothing new.
    draining: bool = False
    role: Role
    pid: int
    # Fingerprint fields (see pdserve.model.fingerprint) and its digest.
    fingerprint: dict[str, str | int | float]
    fingerprint_digest: str
    # "host:port" of the KV transfer endpoint (TCP); None for a prefill-only worker.
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
    # KV transports this worker serves (decode side) or can send over (prefill side), each
    # with the endpoint it listens on ("" on the sending side).
    kv_endpoints: list[KVEndpoint] = Field(default_factory=list)
    # What this worker sees wrong with itself (e.g. a KV peer far below its transport's rate).
    problems: list[str] = Field(default_factory=list)
    # The worker's monotonic clock when the call arrived and as it answered, and its wall
    # clock: the router aligns the worker's timeline events with its own from them (NTP-style,
    # `observability.clock_sync`). None from workers that predate them.
    request_monotonic_ns: int | None = None
    monotonic_ns: int | None = None
    wall_time_s: float | None = None
    # Engine steps since start (None from workers that predate it).
    steps: StepTotalsModel | None = None


class PromptRequest(WireModel):
    """What every request that runs a prompt carries: its id, the prompt and the sampling."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


class ReserveRequest(PromptRequest):
    """Reserve a decode slot and blocks for a prompt whose KV will be transferred in."""

    # The reservation (and its blocks) is freed when no KV byte arrives (and no renewal comes)
    # for this long: liveness, not total duration, decides.
    lease_ttl_s: float = Field(default=30.0, gt=0, le=MAX_LEASE_TTL_S)


class KVEndpoint(WireModel):
    """One way to reach a decode worker's KV receiver."""

    transport: Transport
    # "host:port" of its (control) connection.
    address: str
    # Which machine (and boot) serves it: shared memory is used only when both ends have the
    # same host id. None: unknown, never same-host.
    host_id: str | None = None


class Reservation(WireModel):
    """Where and how the prefill worker must send the KV."""

    # Format of this model; a prefill worker refuses a version it does not speak.
    version: int = RESERVATION_VERSION
    request_id: str
    transfer_id: str  # hex, 16 bytes
    capability_token: str  # hex, secret of this transfer
    # Every transport the decode side serves, best first; the prefill side uses the best one
    # it also has (see `worker/transports.py`).
    endpoints: list[KVEndpoint] = Field(min_length=1)
    # Fencing token of the reservation's lease: the sender puts it in its Begin (a u64 on the
    # KV wire), and a Begin naming another epoch is refused.
    lease_epoch: int = Field(ge=0, lt=1 << 64)
    # Leading prompt tokens the decode worker already has (prefix cache); not sent.
    num_cached_tokens: int
    lease_ttl_s: float
    # The decode process's instance (hex) the reservation lives in: the prefill side's KV
    # Hello names it, and a process restarted at the address refuses it (STALE_INSTANCE).
    instance_id: str = Field(default="", max_length=32, pattern="^[0-9a-f]*$")


class SignedReservation(WireModel):
    """A reservation as the router vouches for it: the prefill worker sends KV only to a
    reservation whose signature (cluster secret, "reservation" key) it verifies."""

    reservation: Reservation
    # The decode worker's control URL (told when the send is given up), covered by the MAC.
    decode_url: str | None = None
    # Wall-clock seconds after which the prefill worker refuses it.
    expires_at_s: float
    signature: str


# A pair probe moves at most this much throwaway KV (enough for a rate, little for a worker).
MAX_PROBE_BYTES = 1 << 30


class ProbeExpectRequest(WireModel):
    """POST /kv_probe/expect (decode side): take `num_bytes` of throwaway KV, landing in
    scratch memory rather than engine blocks; the reservation lapses after `ttl_s`."""

    num_bytes: int = Field(ge=1, le=MAX_PROBE_BYTES)
    ttl_s: float = Field(default=10.0, gt=0, le=MAX_LEASE_TTL_S)


class ProbeSendRequest(WireModel):
    """POST /kv_probe/send (prefill side): send `num_bytes` of throwaway KV to the probe
    reservation (signed by the router, as any), over the transport a handoff would use."""

    reservation: SignedReservation
    num_bytes: int = Field(ge=1, le=MAX_PROBE_BYTES)


class ProbeResult(WireModel):
    """One timed probe transfer: acknowledged bytes over the transport a handoff would take
    (and the better one it could not, with why)."""

    transport: Transport
    num_bytes: int
    # From the first frame on an open stream to the Commit's acknowledgement.
    seconds: float
    # Opening that stream (or finding it open and idle): a first NIXL handshake is seconds.
    connect_seconds: float = 0.0
    downgraded_from: Transport | None = None
    downgrade_reason: str | None = None


class PrefillRequest(PromptRequest):
    """Prefill a prompt, return its first token, then push the KV to the reservation."""

    # None: prefill only, nothing to transfer (the KV is released at once). Its `decode_url`
    # is told at once (POST /kv_abort) when the send is given up, so its /decode fails now
    # instead of when the reservation's lease ends.
    reservation: SignedReservation | None = None
    lease_ttl_s: float = Field(default=30.0, gt=0, le=MAX_LEASE_TTL_S)
    # Sends of the KV (first try included) before the prefill worker gives up on it.
    transfer_attempts: int = Field(default=4, ge=1, le=100)
    # Seconds the router still waits for this request (see the module docstring).
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_WAIT_S)


class RenewRequest(WireModel):
    """POST /renew: the router still wants this reservation (its prefill is running)."""

    request_id: str


class RenewResult(WireModel):
    request_id: str
    # Seconds the reservation now lives without another renewal.
    lease_ttl_s: float


class KVAbortRequest(WireModel):
    """POST /kv_abort: the prefill side gave up sending this reservation's KV."""

    request_id: str
    # The reservation's, proving the caller is the sender it was handed to.
    transfer_id: str
    capability_token: str
    reason: str


class KVAbortResult(WireModel):
    request_id: str
    # False: no such pending reservation (already verified, released or expired).
    cancelled: bool


class PrefillResult(WireModel):
    """The first generated token; the KV transfer continues in the background."""

    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    # The first token's logprobs, when the sampling asked for them.
    first_logprobs: LogprobModel | None = None
    # Prompt tokens 1.. when the sampling asked for prompt logprobs.
    prompt_logprobs: list[LogprobModel] | None = None
    # Monotonic-clock nanoseconds on the worker, for the request timeline.
    prefill_start_ns: int
    prefill_end_ns: int


class CheckpointPlan(WireModel):
    """Replicate this request's KV to `holder_url` under `policy` ("prompt", "every-N")
    (`pdserve/checkpoint/`; the holder's endpoints are in `checkpoint_protocol.py`)."""

    holder_url: str
    policy: str
    lease_ttl_s: float = Field(default=30.0, gt=0, le=MAX_LEASE_TTL_S)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        CheckpointPolicy.parse(value, "checkpoint.policy")  # ConfigError is a ValueError: 400
        return value


class CheckpointSource(WireModel):
    """Where a resumed request's KV may be found: its checkpoint holder, and workers whose
    prefix caches may hold leading blocks of it (nearest cache first: the longest wins)."""

    holder_url: str | None = None
    cache_urls: list[str] = Field(default_factory=list, max_length=8)


class DecodeRequest(WireModel):
    """Decode a reserved request once its KV is verified, streaming from the second token."""

    request_id: str
    first_token_id: int
    # Give up (and free the reservation) if the KV is not verified by then; the reservation's
    # lease ends it sooner if the transfer stops making progress.
    kv_timeout_s: float = Field(default=30.0, gt=0, le=MAX_WAIT_S)
    # Seconds the router still waits for this request, its tokens included.
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_WAIT_S)
    # Replicate the request's KV while it decodes (None: no checkpoints).
    checkpoint: CheckpointPlan | None = None


class GenerateRequest(PromptRequest):
    """A whole request on one worker (colocated)."""

    # Tokens already sent to the client by a worker that died: generation resumes after them
    # (migration). The stream carries only the tokens that follow.
    output_token_ids: list[int] = Field(default_factory=list)
    # Seconds the router still waits for this request.
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_WAIT_S)
    # Replicate the request's KV while it decodes (None: no checkpoints).
    checkpoint: CheckpointPlan | None = None
    # A resume: pull the longest checkpointed prefix of prompt + output from there first and
    # recompute only the rest (recompute everything if that fails).
    checkpoint_from: CheckpointSource | None = None


class HandoffInfo(WireModel):
    """How a request's KV reached the decode worker (on the first line of /decode)."""

    # "" when nothing travelled (the whole prompt was cached on the decode worker).
    transport: str
    num_bytes: int
    # From the sender's Begin to its verified Commit.
    seconds: float
    # Far below the transport's expected rate (the router's breaker counts it as a failure).
    slow: bool
    # The value check before the first token: "exact", "tolerance", "off" (disabled), or
    # "none" (nothing travelled).
    canary: str


class StepInfo(WireModel):
    """The engine step that produced a streamed token: how long it ran and what shared it.

    `decode` says this request's token came from a decode slice; `num_prefill_tokens` > 0
    then means it waited for prefill work in the same batch (interference)."""

    # Per worker, increasing: the same step reported to several streams has one index.
    index: int
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    decode: bool


class TokenEvent(WireModel):
    """One line of a token stream."""

    token_ids: list[int]
    finished: bool = False
    # "stop" or "length" once finished; "error" with `error` set if the worker failed it.
    finish_reason: str | None = None
    error: str | None = None
    # The error's class (pdserve.errors) when `error` is set, so the router acts on a type,
    # not on words: e.g. "KVValueMismatch", "KVNotReady", "DeadlineExceeded".
    error_type: str | None = None
    # /decode's first line: how the KV came.
    handoff: HandoffInfo | None = None
    # One per token in `token_ids` when the sampling asked for logprobs.
    logprobs: list[LogprobModel] | None = None
    # On the first event of a request prefilled by this worker that asked for them.
    prompt_logprobs: list[LogprobModel] | None = None
    # On the first event with tokens: prompt tokens this worker's prefix cache supplied.
    num_cached_tokens: int | None = None
    # The step that produced `token_ids` (None on lines not made by a step).
    step: StepInfo | None = None


class ReleaseRequest(WireModel):
    request_id: str


class ReleaseResult(WireModel):
    request_id: str
    num_freed_blocks: int


class ErrorBody(WireModel):
    """Every non-2xx response."""

    error: str
    # Exception class from pdserve.errors, e.g. "PromptTooLong".
    type: str
    retryable: bool = False
    worker_id: str | None = None


WorkerHealth.model_rebuild()
