"""Named fault-injection sites and seeded fault plans, for tests and chaos runs only.

A plan is a list of `FaultRule`s, each written `SITE:ACTION[:key=value,...]`, e.g.
`transfer.send:corrupt:after=2` or `worker.decode_tokens:crash:after=5`. A process holds one
`FaultInjector`; the code at each site calls `fire(site)`, which counts the hit and returns the
rule to apply, if any. Every draw (probability, byte offset) comes from an RNG seeded by
(plan seed, site, hit index), so a plan gives the same faults at the same hits in every run and
every process.

Off means free: a part that was not given an injector holds `faults = None` and every site is
`if self.faults is not None and (rule := self.faults.fire(SITE)) is not None: ...`, so nothing
is counted or drawn. Injection is enabled only by an explicit flag (`--fault`,
`--enable-fault-admin`).

Actions: delay (sleep `delay_s`, then go on), stall (block until cancelled: the caller's
deadline), close (drop the connection; at control sites `perform` raises `FaultClosed`), crash
(SIGKILL to this process: it exits at once, nothing is cleaned up). drop, corrupt and truncate
change bytes on the wire, so they exist only at `transfer.send` (see `transfer.faulty`).
Two sites damage KV in memory instead, which checksums cannot see (the canary must): at
`transfer.source_kv` corrupt flips the top exponent bit of one KV element of the held prefill
KV after its value digest was taken and before its checksums are; at `transfer.recv_map` shift
lands a transfer's blocks one place off (a stale or shifted block table).

The parsing and the injector are pure; `perform` and `crash` are the only I/O here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import random
import signal
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import NamedTuple, NoReturn

from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)


class FaultSite(enum.StrEnum):
    """Where a fault can be injected; each hit is one pass of the code through the site."""

    # Router, before it asks a decode worker for a reservation.
    ROUTER_BEFORE_RESERVE = "router.before_reserve"
    # Router, after a prefill worker answered /prefill.
    ROUTER_AFTER_PREFILL = "router.after_prefill"
    # Decode side, start of POST /reserve.
    WORKER_RESERVE = "worker.reserve"
    # Prefill side, start of POST /prefill, before the engine runs.
    WORKER_PREFILL = "worker.prefill"
    # Prefill side, after the prefill ran and its KV send started, before the HTTP reply.
    WORKER_PREFILL_REPLY = "worker.prefill_reply"
    # Decode side, once per token streamed by /decode or /generate (before it is written).
    WORKER_DECODE_TOKENS = "worker.decode_tokens"
    # Any worker, once per engine step that produced output, on the engine thread (delay only:
    # an engine slower than the machine, whatever else runs on it).
    WORKER_ENGINE_STEP = "worker.engine_step"
    # Prefill side, once per send on a KV byte stream, counted across every transfer.
    TRANSFER_SEND = "transfer.send"
    # Decode side, once per Chunk frame the KV receiver accepts (before its data lands).
    TRANSFER_RECV_CHUNK = "transfer.recv_chunk"
    # Prefill side, once per KV send, after the value digest and before the checksums.
    TRANSFER_SOURCE_KV = "transfer.source_kv"
    # Decode side, once per reservation whose KV will arrive: where its blocks land.
    TRANSFER_RECV_MAP = "transfer.recv_map"


class FaultKind(enum.StrEnum):
    """What a fault does; see the module docstring."""

    DELAY = "delay"
    DROP = "drop"
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    CLOSE = "close"
    STALL = "stall"
    CRASH = "crash"
    SHIFT = "shift"


# Actions that damage bytes need a byte stream (or KV memory) to damage.
_WIRE_ONLY = frozenset({FaultKind.DROP, FaultKind.CORRUPT, FaultKind.TRUNCATE})
_NEEDS_OFFSET = frozenset({FaultKind.CORRUPT, FaultKind.TRUNCATE})
_CONTROL_ACTIONS = tuple(k for k in FaultKind if k not in _WIRE_ONLY and k is not FaultKind.SHIFT)
_SITE_ACTIONS: dict[FaultSite, tuple[FaultKind, ...]] = {
    FaultSite.TRANSFER_SEND: tuple(k for k in FaultKind if k is not FaultKind.SHIFT),
    FaultSite.TRANSFER_SOURCE_KV: (FaultKind.CORRUPT,),
    FaultSite.TRANSFER_RECV_MAP: (FaultKind.SHIFT,),
    FaultSite.WORKER_ENGINE_STEP: (FaultKind.DELAY,),
}
DEFAULT_DELAY_S = 0.5


def allowed_actions(site: FaultSite) -> tuple[FaultKind, ...]:
    """The actions a site supports."""
    return _SITE_ACTIONS.get(site, _CONTROL_ACTIONS)


class _BadRule(ConfigError):
    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One fault of a plan: at `site`, do `action` on some hits."""

    site: FaultSite
    action: FaultKind
    # Hits of the site that pass untouched before the rule may fire.
    after: int = 0
    # How many hits it fires on; 0: every eligible hit from then on.
    times: int = 1
    # Chance that it fires on an eligible hit (seeded draw).
    probability: float = 1.0
    # delay: seconds to sleep before going on.
    delay_s: float = DEFAULT_DELAY_S
    # corrupt: the byte to flip (bit `offset % 8`); truncate: the prefix length kept; delay
    # at transfer.send: the bytes sent before the pause (a pause mid-frame). None: drawn from
    # the seed for each hit (corrupt, truncate) or 0 (delay: before the send).
    offset: int | None = None

    def __post_init__(self) -> None:
        detail = _problem(self)
        if detail is not None:
            raise _BadRule(f"fault rule {self.spec()!r}: {detail}", detail)

    def spec(self) -> str:
        """The rule as `SITE:ACTION[:key=value,...]`; `parse_rule(rule.spec()) == rule`."""
        options = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name in _OPTIONS and getattr(self, f.name) != f.default
        ]
        head = f"{self.site}:{self.action}"
        return f"{head}:{','.join(options)}" if options else head


# Option keys and how their text is read.
_OPTIONS: dict[str, type[int] | type[float]] = {
    "after": int,
    "times": int,
    "probability": float,
    "delay_s": float,
    "offset": int,
}


def _problem(rule: FaultRule) -> str | None:
    """Why the rule is invalid, or None."""
    if not isinstance(rule.site, FaultSite):
        return f"unknown site {rule.site!r}"
    if not isinstance(rule.action, FaultKind):
        return f"unknown action {rule.action!r}"
    allowed = allowed_actions(rule.site)
    if rule.action not in allowed:
        names = ", ".join(a.value for a in allowed)
        return f"action {rule.action.value} is not allowed at {rule.site.value} (allowed: {names})"
    if rule.after < 0 or rule.times < 0:
        return f"after and times must be >= 0, got {rule.after} and {rule.times}"
    if not 0.0 <= rule.probability <= 1.0:
        return f"probability must be in [0, 1], got {rule.probability}"
    if not 0.0 <= rule.delay_s < float("inf"):
        return f"delay_s must be a finite number >= 0, got {rule.delay_s}"
    if rule.delay_s != DEFAULT_DELAY_S and rule.action is not FaultKind.DELAY:
        return f"delay_s applies to delay only, not {rule.action.value}"
    if rule.offset is not None:
        mid_send_delay = rule.action is FaultKind.DELAY and rule.site is FaultSite.TRANSFER_SEND
        if rule.action not in _NEEDS_OFFSET and not mid_send_delay:
            return (
                f"offset applies to corrupt and truncate (and delay at transfer.send) only,"
                f" not {rule.action.value}"
            )
        if rule.offset < 0:
            return f"offset must be >= 0, got {rule.offset}"
    return None


def parse_rule(text: str) -> FaultRule:
    """Parse `SITE:ACTION[:key=value,...]`; ConfigError names the piece that is wrong."""
    where = f"fault rule {text!r}"
    parts = text.strip().split(":", 2)
    if len(parts) < 2:
        raise ConfigError(f"{where}: expected SITE:ACTION[:key=value,...]")
    try:
        site = FaultSite(parts[0])
    except ValueError:
        names = ", ".join(s.value for s in FaultSite)
        raise ConfigError(f"{where}: unknown site {parts[0]!r} (sites: {names})") from None
    try:
        action = FaultKind(parts[1])
    except ValueError:
        names = ", ".join(a.value for a in allowed_actions(site))
        raise ConfigError(
            f"{where}: unknown action {parts[1]!r} (allowed at {site.value}: {names})"
        ) from None
    options: dict[str, int | float] = {}
    for item in parts[2].split(",") if len(parts) == 3 and parts[2] else ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _OPTIONS:
            keys = ", ".join(_OPTIONS)
            raise ConfigError(f"{where}: unknown option {item!r} (options: {keys})")
        if key in options:
            raise ConfigError(f"{where}: option {key} given twice")
        try:
            options[key] = _OPTIONS[key](value.strip())
        except ValueError:
            kind = _OPTIONS[key].__name__
            raise ConfigError(f"{where}: {key}={value!r} is not a valid {kind}") from None
    try:
        return FaultRule(site, action, **options)  # type: ignore[arg-type]  # keys checked above
    except _BadRule as exc:
        raise ConfigError(f"{where}: {exc.detail}") from None


def parse_rules(texts: Iterable[str]) -> tuple[FaultRule, ...]:
    """Parse every rule of a plan, in order."""
    return tuple(parse_rule(text) for text in texts)


class Injection(NamedTuple):
    """A fault as fired: the site, its 0-based hit index there, and the action."""

    site: FaultSite
    hit: int
    action: FaultKind


# Injections a plan keeps a record of, the latest: a rule that repeats forever (a delay
# pacing every engine step) would otherwise grow the record for the life of the process.
RECORD_LIMIT = 1000


class FaultInjector:
    """A process's fault plan: counts hits per site and decides which fire.

    Thread-safe (one lock around the counters), though sites run on the event loop's thread.
    """

    def __init__(self, rules: Iterable[FaultRule] = (), seed: int = 0) -> None:
        self._lock = threading.Lock()
        self.rules: tuple[FaultRule, ...] = ()
        self.seed = seed
        self._injected: deque[Injection] = deque(maxlen=RECORD_LIMIT)
        # Every injection since the plan was set; `injected` lists the latest RECORD_LIMIT.
        self.num_injected = 0
        self._hits: dict[FaultSite, int] = {}
        self._fired: list[int] = []
        self.reset(rules, seed)

    def reset(self, rules: Iterable[FaultRule] = (), seed: int = 0) -> None:
        """Replace the plan; every counter and the record start again from zero."""
        rules = tuple(rules)
        with self._lock:
            self.rules = rules
            self.seed = seed
            self._injected.clear()
            self.num_injected = 0
            self._hits = {}
            self._fired = [0] * len(rules)

    @property
    def injected(self) -> list[Injection]:
        """The latest injections (at most RECORD_LIMIT), oldest first."""
        with self._lock:
            return list(self._injected)

    @property
    def hits(self) -> dict[FaultSite, int]:
        """Hits counted per site since the last reset."""
        with self._lock:
            return dict(self._hits)

    def fire(self, site: FaultSite, num_bytes: int | None = None) -> FaultRule | None:
        """Count a hit of `site`; return the first rule that fires on it, or None.

        With `num_bytes` (a send's size), a corrupt or truncate rule without an offset comes
        back with one drawn for this hit, in range for the send.
        """
        if not self.rules:
            return None
        with self._lock:
            hit = self._hits.get(site, 0)
            self._hits[site] = hit + 1
            rng = random.Random(f"pdserve-fault:{self.seed}:{site.value}:{hit}")
            for index, rule in enumerate(self.rules):
                if rule.site is not site or hit < rule.after:
                    continue
                if rule.times and self._fired[index] >= rule.times:
                    continue
                if rng.random() >= rule.probability:
                    continue
                self._fired[index] += 1
                # Read under the lock: another thread's hit may count next.
                quiet = rule.action is FaultKind.DELAY and self._fired[index] > 1
                self._injected.append(Injection(site, hit, rule.action))
                self.num_injected += 1
                break
            else:
                return None
        if num_bytes is not None and rule.offset is None and rule.action in _NEEDS_OFFSET:
            rule = dataclasses.replace(rule, offset=rng.randrange(num_bytes) if num_bytes else 0)
        # A delay paces rather than breaks (a rule may slow every engine step): its first hit
        # is a warning, the rest would drown the log.
        level = logging.DEBUG if quiet else logging.WARNING
        logger.log(level, "fault injected at %s hit %d: %s", site.value, hit, rule.spec())
        return rule


class FaultClosed(ConnectionResetError):
    """An injected close: the caller drops its connection without answering."""


def crash(rule: FaultRule | None = None) -> NoReturn:
    """Kill this process at once (SIGKILL): no cleanup, no reply, as a real crash."""
    logger.warning("fault crash: killing process %d (%s)", os.getpid(), rule.spec() if rule else "")
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(137)  # not reached: SIGKILL cannot be caught


async def perform(rule: FaultRule) -> None:
    """Apply a control-path rule: delay, stall (until cancelled), close (FaultClosed), crash."""
    match rule.action:
        case FaultKind.DELAY:
            await asyncio.sleep(rule.delay_s)
        case FaultKind.STALL:
            await asyncio.Event().wait()
        case FaultKind.CLOSE:
            raise FaultClosed(f"fault injected at {rule.site.value}: connection closed")
        case FaultKind.CRASH:
            crash(rule)
        case _:
            raise ConfigError(f"fault {rule.spec()!r}: {rule.action.value} acts on bytes only")
