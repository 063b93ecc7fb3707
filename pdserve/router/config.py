"""`RouterConfig`: everything the router process needs, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pdserve.auth.keys import ADMIN_KEY_FILE, API_KEY_FILE, METRICS_KEY_FILE, BearerKey
from pdserve.auth.secret import (
    SECRET_FILE,
    ClusterKeys,
    ClusterSecret,
    require_secret,
)
from pdserve.auth.tls import TLSConfig
from pdserve.errors import ConfigError
from pdserve.faults import parse_rules
from pdserve.membership.uri import DISCOVERY, parse_discovery
from pdserve.protocol.checkpoint_policy import CheckpointPolicy
from pdserve.protocol.worker_api import MAX_LEASE_TTL_S, MAX_WAIT_S
from pdserve.router.access import AccessKeys
from pdserve.router.mode.auto_mode import AutoConfig
from pdserve.router.mode.interference import SLOConfig
from pdserve.settings import Flag, flag, repeated, setting
from pdserve.tools.formats import FORMATS

# The path a request takes; fixed when it begins.
Mode = Literal["disagg", "colocated"]
MODES: tuple[Mode, ...] = ("disagg", "colocated")
# What the router is set to: a mode, or "auto" (it picks colocated or a split itself).
ModeSetting = Literal["disagg", "colocated", "auto"]
MODE_SETTINGS: tuple[ModeSetting, ...] = ("disagg", "colocated", "auto")


def parse_mode(value: str) -> Mode:
    """`value` as a Mode; ConfigError naming it otherwise."""
    for mode in MODES:
        if value == mode:
            return mode
    raise ConfigError(f"mode: {value!r} is not one of {', '.join(MODES)}")


def parse_mode_setting(value: str) -> ModeSetting:
    """`value` as a ModeSetting (a mode or "auto"); ConfigError naming it otherwise."""
    for mode in MODE_SETTINGS:
        if value == mode:
            return mode
    raise ConfigError(f"mode: {value!r} is not one of {', '.join(MODE_SETTINGS)}")


# Recovery steps after a failed KV handoff, in the order the router may try them:
#   retry_transfer  the prefill worker resends from its held snapshot (backoff + jitter)
#   reprefill       a fresh reservation and prefill on another prefill worker
#   local_prefill   the decode side recomputes the prompt itself (no transfer)
RECOVERY_STEPS = ("retry_transfer", "reprefill", "local_prefill")

# The --help group of the settings `pdserve up` takes too and forwards to the router it starts
# (`router/flags.py` selects them by it), declared once for every such field.
SERVING = "serving (OpenAI API)"
SERVING_FLAG = Flag(group=SERVING)
SERVING_SWITCH = Flag(action="store_true", group=SERVING)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """The KV-path circuit breaker: when it trips, new requests run colocated."""

    enabled: bool = setting(
        True, name="no-breaker", turns_off=True, help="never switch mode automatically"
    )
    # Outcomes (KV handoffs) remembered, and the least needed before the breaker may trip.
    window: int = setting(20)
    min_samples: int = setting(5)
    # Trip when failures / outcomes in the window reach this.
    failure_rate: float = setting(0.5)
    # Seconds open before one disaggregated probe request is let through (half-open).
    cooldown_s: float = setting(10.0)

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ConfigError(
                f"breaker: need window >= 1 and 1 <= min_samples <= window,"
                f" got window={self.window} min_samples={self.min_samples}"
            )
        if not 0.0 < self.failure_rate <= 1.0:
            raise ConfigError(f"breaker-failure-rate: must be in (0, 1], got {self.failure_rate}")
        if self.cooldown_s <= 0:
            raise ConfigError(f"breaker-cooldown-s: must be > 0, got {self.cooldown_s}")


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    """What the router does when a handoff fails, in order, each step budgeted."""

    steps: tuple[str, ...] = setting(
        RECOVERY_STEPS,
        name="recovery",
        type=str,
        to_field=lambda text: parse_recovery(text),
        to_flag=",".join,
        help=f"ordered steps from {','.join(RECOVERY_STEPS)}, or 'none'",
    )
    # Sends per transfer (first try included) when retry_transfer is on; 1 otherwise.
    transfer_attempts: int = setting(4)
    # Extra prefills on other prefill workers (reprefill).
    max_reprefills: int = setting(1)
    # Other decode workers a stream may move to after the decode side died mid-stream.
    max_migrations: int = setting(2)
    # When every decode worker refuses a reservation: wait up to this long for one (0: 503
    # at once), with at most `max_queued` requests waiting at a time.
    queue_timeout_s: float = setting(5.0)
    max_queued: int = setting(64)
    # Decode checkpoints (`pdserve/protocol/checkpoint_policy.py`): off, prompt or every-N; a holder
    # drops a request's copy this long after its writer stopped renewing.
    checkpoint: str = setting(
        "off",
        help="decode checkpoints: off, prompt or every-N (replicate a decoding request's KV"
        " every N filled blocks to another decode worker, so a migration resumes from it)",
    )
    checkpoint_lease_ttl_s: float = setting(
        10.0,
        help="a holder drops a request's checkpoint this long after its decode worker stops"
        " renewing",
    )

    def __post_init__(self) -> None:
        CheckpointPolicy.parse(self.checkpoint)
        if not 0 < self.checkpoint_lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ConfigError(
                f"checkpoint-lease-ttl-s: must be in (0, {MAX_LEASE_TTL_S:g}],"
                f" got {self.checkpoint_lease_ttl_s}"
            )
        unknown = [s for s in self.steps if s not in RECOVERY_STEPS]
        if unknown or len(set(self.steps)) != len(self.steps):
            raise ConfigError(
                f"recovery: {','.join(self.steps)!r} must be distinct steps from"
                f" {', '.join(RECOVERY_STEPS)}"
            )
        for name in ("transfer_attempts",):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_reprefills", "max_migrations", "max_queued"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.queue_timeout_s < 0:
            raise ConfigError(f"queue-timeout-s: must be >= 0, got {self.queue_timeout_s}")

    @property
    def send_attempts(self) -> int:
        """Sends the prefill worker may make for one transfer."""
        return self.transfer_attempts if "retry_transfer" in self.steps else 1


Routing = Literal["affinity", "load", "round_robin"]
ROUTINGS: tuple[Routing, ...] = ("affinity", "load", "round_robin")


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    """Where requests go: prefix and session affinity weighed against load.

    A candidate's cost is `prefix_weight * blocks it must compute + load_weight * requests on
    it`; the cheapest wins (see `pdserve.router.placement.affinity`).
    """

    # "affinity": cost above plus sticky sessions; "load": least loaded only (prefix ignored);
    # "round_robin": rotate over candidates (a baseline for benchmarks).
    routing: Routing = setting("affinity", choices=ROUTINGS)
    # Cost of one prompt block the worker does not hold in its prefix cache.
    prefix_weight: float = setting(1.0, help="cost of one prompt block the worker does not hold")
    # Cost of one request already on the worker (running + waiting + router in-flight): by
    # default one more concurrent request weighs as much as 4 uncached blocks.
    load_weight: float = setting(4.0, help="cost of one request already on the worker")
    # A conversation whose decode worker already holds all but at most this many prompt
    # tokens is continued there with a local prefill of the suffix: no prefill worker, no KV
    # transfer (the idea of vLLM's kv_recompute_threshold). 0 turns it off.
    local_prefill_threshold: int = setting(
        256,
        help="uncached prompt tokens a decode worker holding the rest prefills itself (0: never)",
    )
    # Sticky sessions remembered (least recently used forgotten first).
    max_sessions: int = setting(10_000)
    # Rollouts (`router/placement/revisions.py`): the share of new requests the newest ready
    # revision gets while an older one is ready too; 1 sends them all to the newest.
    canary_weight: float = setting(
        1.0, help="share of new requests for the newest model revision while an older serves"
    )

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing: {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.prefix_weight < 0 or self.load_weight < 0:
            raise ConfigError(
                f"affinity weights must be >= 0, got prefix {self.prefix_weight}"
                f" load {self.load_weight}"
            )
        if self.local_prefill_threshold < 0:
            raise ConfigError(
                f"local-prefill-threshold: must be >= 0, got {self.local_prefill_threshold}"
            )
        if self.max_sessions < 1:
            raise ConfigError(f"max-sessions: must be >= 1, got {self.max_sessions}")
        if not 0.0 <= self.canary_weight <= 1.0:
            raise ConfigError(f"canary-weight: must be in [0, 1], got {self.canary_weight}")


def model_folder(value: str | None) -> Path:
    """The --model folder; none given: the tiny built-in model's."""
    if value is not None:
        return Path(value)
    from pdserve.model.tiny import default_model_path

    return default_model_path()


def parse_recovery(value: str) -> tuple[str, ...]:
    """ "retry_transfer,reprefill" as a tuple of steps ("" or "none": no recovery)."""
    if value.strip() in ("", "none"):
        return ()
    return tuple(part.strip() for part in value.split(","))


@dataclass(frozen=True, slots=True)
class RouterConfig(ClusterKeys):
    """The router's settings; validated at construction."""

    # Folder with the tokenizer and config.json; its name is the served model name.
    model: Path = field(
        metadata=flag(
            type=str, to_field=model_folder, help="model folder (default: the tiny built-in)"
        )
    )
    # Worker base URLs, e.g. "http://127.0.0.1:8101".
    workers: tuple[str, ...] = field(
        metadata=flag(
            name="worker", action="append", to_field=tuple, help="worker base URL (repeatable)"
        )
    )
    # "auto": start colocated and let `router/mode/auto_controller.py` split and rejoin the pool.
    mode: ModeSetting = setting(
        "disagg",
        choices=MODE_SETTINGS,
        help="auto: start colocated, split `both` workers into prefill and decode roles when"
        " prefill breaks the TPOT SLO, rejoin them when the load falls or the breaker opens",
    )
    host: str = setting("127.0.0.1")
    # 0 picks a free port (reported through ready_file).
    port: int = setting(0)
    ready_file: Path | None = setting(None, type=Path)
    # Whole request, from received to the last token.
    request_timeout_s: float = setting(600.0, SERVING_FLAG, help="per-request deadline")
    health_poll_interval_s: float = 1.0
    # A worker whose health polls have failed this long has its open streams and calls cut, so
    # they fail over now (a paused or hung worker never closes them). 0: never.
    health_deadline_s: float = setting(
        3.0, help="cut a worker's open streams once its health polls failed this long (0: never)"
    )
    # Recent requests whose timelines GET /debug/requests/{id} keeps (oldest evicted first).
    timeline_ring: int = setting(
        1000, help="recent requests whose timelines /debug/requests/{id} keeps"
    )
    # How long a decode reservation (and the prefill KV) waits for its transfer.
    lease_ttl_s: float = setting(30.0, SERVING_FLAG, help="decode reservation / prefill KV lease")
    # Throwaway KV sent over each new prefill/decode pair to attest its rate
    # (`router/workers/pair_probes.py`); 0: no probes.
    kv_probe_mib: int = setting(
        32,
        help="MiB of throwaway KV timed over each new prefill/decode pair (0: no probes);"
        " slow pairs are reported and steered around",
    )
    # Certificates for its API and its calls to workers (`auth/tls.py`).
    tls: TLSConfig = field(default_factory=TLSConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    # Where workers register ("etcd://HOST:PORT[/PREFIX]"); None: the static `workers` list.
    discovery: str | None = setting(
        None,
        DISCOVERY,
        help="find workers registered in etcd instead of --worker URLs",
    )
    # Fault-injection rules at the router's sites (`pdserve.faults` syntax), tests only.
    faults: tuple[str, ...] = repeated(
        "fault",
        metavar="SPEC",
        help="tests only: inject SITE:ACTION[:key=value,...] at a router site (repeatable)",
    )
    fault_seed: int = setting(0, help="seed of the fault plan's draws")
    # The cluster credential it signs every worker call and reservation with; None only with
    # `insecure_no_auth` (for workers started with --insecure-no-auth).
    cluster_secret: ClusterSecret | None = setting(
        None,
        SECRET_FILE,
        group="security",
        help="the cluster secret (else $PDSERVE_CLUSTER_SECRET): signs every worker call",
    )
    insecure_no_auth: bool = setting(
        False,
        action="store_true",
        group="security",
        help="talk to workers started with --insecure-no-auth (no credential)",
    )
    # The planes' keys (`router/access.py`), from files or the environment, never argv.
    api_key: BearerKey | None = setting(
        None, API_KEY_FILE, help="/v1 needs this key (else $PDSERVE_API_KEY; none: open)"
    )
    admin_key: BearerKey | None = setting(
        None,
        ADMIN_KEY_FILE,
        help="/admin and /debug need this key (else $PDSERVE_ADMIN_KEY; none: loopback only)",
    )
    metrics_key: BearerKey | None = setting(
        None, METRICS_KEY_FILE, help="/metrics needs this key (else $PDSERVE_METRICS_KEY)"
    )
    # Names clients may pass as `model` (the first is listed first); () -> the folder's name.
    served_model_names: tuple[str, ...] = setting(
        (),
        SERVING_FLAG,
        name="served-model-name",
        nargs="+",
        type=str,
        metavar="NAME",
        to_field=lambda names: tuple(names or ()),
        to_flag=lambda names: None,
        help="names clients pass as `model` (default: the model folder's name)",
    )
    # Cap on prompt + output tokens; None -> the model's max_position_embeddings.
    max_model_len: int | None = setting(
        None,
        SERVING_FLAG,
        type=int,
        help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
    )
    # A Jinja chat template (the text, or a file holding it) replacing the tokenizer's.
    chat_template: str | None = setting(
        None,
        SERVING_FLAG,
        type=str,
        help="a Jinja chat template, or a file holding one, replacing the tokenizer's",
    )
    # Drop unknown top-level request fields (logged) instead of answering 400.
    allow_unknown_fields: bool = setting(
        False,
        SERVING_SWITCH,
        help="drop (and log) unknown request fields instead of answering 400",
    )
    # Logprob tokens written `token_id:N` unless a request says otherwise, as vLLM's
    # `--return-tokens-as-token-ids` (the request field `return_tokens_as_token_ids` wins).
    return_tokens_as_token_ids: bool = setting(
        False,
        SERVING_SWITCH,
        help="write logprob tokens as token_id:N unless a request sets"
        " return_tokens_as_token_ids false, as vLLM",
    )
    # Serve GET /tokenizer_info (the tokenizer's configuration and chat template), off by
    # default as in vLLM (`--enable-tokenizer-info-endpoint`): it exposes the template.
    enable_tokenizer_info_endpoint: bool = setting(
        False,
        SERVING_SWITCH,
        help="serve GET /tokenizer_info (the tokenizer's config and chat template), as vLLM",
    )
    # Where unsent sampling fields get their defaults: "auto", the model's
    # generation_config.json (as vLLM's default); "vllm", the API's own defaults.
    generation_config: str = setting(
        "auto",
        SERVING_FLAG,
        choices=("auto", "vllm"),
        help="auto: unsent temperature, top_p, top_k, min_p, repetition_penalty and the"
        " max_new_tokens cap come from the model's generation_config.json (as vLLM); vllm:"
        " the API's defaults",
    )
    # How tool calls look in the model's output: read from `tool_choice: auto` answers, and
    # written by the grammar that forces `required` and named choices.
    tool_call_parser: str = setting(
        "hermes",
        SERVING_FLAG,
        choices=tuple(FORMATS),
        help="the model's tool-call format: hermes (<tool_call> tags) or llama3_json",
    )
    # Keep /v1/responses answers (the newest `responses_store_size`) for previous_response_id
    # and GET /v1/responses/{id}; off: stateless, as vLLM is by default.
    enable_store: bool = setting(
        False,
        SERVING_SWITCH,
        help="store /v1/responses answers in memory for previous_response_id",
    )
    responses_store_size: int = setting(
        1000, SERVING_FLAG, help="responses kept with --enable-store"
    )
    # The latency targets the router measures attainment against (and auto mode keeps).
    slo: SLOConfig = field(default_factory=SLOConfig)
    # Thresholds and hysteresis of the automatic mode; its window is also the live window.
    auto: AutoConfig = field(default_factory=AutoConfig)

    def __post_init__(self) -> None:
        parse_rules(self.faults)  # a bad rule fails at start, named
        if self.discovery is not None:
            parse_discovery(self.discovery)
            if self.workers:
                raise ConfigError("worker: give --worker URLs or --discovery, not both")
        elif not self.workers:
            raise ConfigError("worker: at least one --worker URL (or --discovery) is needed")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"worker: {url!r} is not an http(s) URL")
        parse_mode_setting(self.mode)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in 0..65535, got {self.port}")
        if not 0 < self.request_timeout_s <= MAX_WAIT_S:
            raise ConfigError(
                f"request-timeout-s: must be in (0, {MAX_WAIT_S:g}], got {self.request_timeout_s}"
            )
        if self.timeline_ring < 1:
            raise ConfigError(f"timeline-ring: must be >= 1, got {self.timeline_ring}")
        if self.responses_store_size < 1:
            raise ConfigError(
                f"responses-store-size: must be >= 1, got {self.responses_store_size}"
            )
        if self.health_deadline_s < 0:
            raise ConfigError(f"health-deadline-s: must be >= 0, got {self.health_deadline_s}")
        if self.health_poll_interval_s <= 0:
            raise ConfigError("health_poll_interval_s must be > 0")
        if not 0 < self.lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ConfigError(
                f"lease-ttl-s: must be in (0, {MAX_LEASE_TTL_S:g}], got {self.lease_ttl_s}"
            )
        require_secret(
            self.cluster_secret,
            self.insecure_no_auth,
            ", as for the workers; --insecure-no-auth for workers that run without one",
        )
        if any(not name for name in self.served_model_names):
            raise ConfigError("served-model-name: names must not be empty")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max-model-len: must be >= 2, got {self.max_model_len}")

    @property
    def access_keys(self) -> AccessKeys:
        """The keys of the API, admin and metrics planes."""
        return AccessKeys(self.api_key, self.admin_key, self.metrics_key)

    @property
    def initial_mode(self) -> Mode:
        """The mode requests begin in at start (auto starts colocated)."""
        return "colocated" if self.mode == "auto" else self.mode

    @property
    def model_name(self) -> str:
        """The name responses report: the first served name, else the folder's name."""
        return self.served_model_names[0] if self.served_model_names else self.model.name

    @property
    def accepted_model_names(self) -> tuple[str, ...]:
        """What a request's `model` may be. vLLM's rule: with --served-model-name only those
        names; else the folder's name (or its path)."""
        return self.served_model_names or (self.model.name, str(self.model))

    def chat_template_text(self) -> str | None:
        """The --chat-template override: a file's contents, or the text itself."""
        value = self.chat_template
        if value is None:
            return None
        path = Path(value)
        try:
            if len(value) < 4096 and path.is_file():
                return path.read_text("utf-8")
        except OSError as exc:
            raise ConfigError(f"chat-template: cannot read {value}: {exc}") from exc
        if "{" not in value:
            raise ConfigError(f"chat-template: {value!r} is neither a file nor a Jinja template")
        return value
