"""The soak's checker: a history in, a verdict out. Pure.

Every request of a phase is judged on its own record (it carries its expectation):
- a well-formed request is **ok** when it completed with exactly the reference tokens and
  text, or when its client left on purpose having received a prefix of them (the reference,
  or another fault-free output of the request the record carries: see
  `RequestRecord.alternative_token_ids`); a **typed
  error** when the router answered an error status (502, 503, 504) or sent an error event;
  it is **excused** when it broke off or found no router while its own router had been killed;
- a malformed request is ok when it got 400 naming the expected `param`.
Everything else is a **violation**, each with its rule: tokens that differ from the reference
(divergent; lost and duplicated tokens counted against the reference as multisets), an
internal error (500), a stream cut with no error while its router lived, a malformed request
not refused as it should be, an outcome past the request's deadline, or two outcomes for one
request. At rest: pinned blocks above idle (leaked), work still queued or running, a worker
that does not answer, a process left after the stop, a process the supervisor gave up on.

Figures: availability (ok / sent, and ok / (sent - excused)); goodput (ok requests and their
tokens per second) under faults against the fault-free phase at the same rate; recovery time
per fault kind (from a fault's start to the end of the first ok request that started after it
and went through its target: the worker, the router, either end of a partition; any request
for etcd); and the targets missed (`SoakTargets`, plus 0 of every violation).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdlab.chaos.scenarios import lost_and_duplicated, percentile
from pdlab.soak.history import Ending, FaultRecord, History, Phase, RequestRecord

# Statuses that are typed, retryable refusals of a well-formed request.
_TYPED_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: which request (None: the cluster), the rule, the detail."""

    phase: str
    index: int | None
    rule: str
    detail: str


@dataclass(frozen=True, slots=True)
class Recovery:
    """Recovery times of one fault kind."""

    kind: str
    num_faults: int
    num_recovered: int
    p50_s: float
    max_s: float


@dataclass(slots=True)
class PhaseFigures:
    """Counts of one phase."""

    num_sent: int = 0
    num_ok: int = 0
    num_typed_errors: int = 0
    num_excused: int = 0
    num_ok_tokens: int = 0
    num_divergent: int = 0
    num_tokens_lost: int = 0
    num_tokens_duplicated: int = 0
    num_past_deadline: int = 0
    # Requests whose output is not the batched reference but the request's own fault-free
    # output computed alone (batch-dependent numerics at a near-tie; see `RequestRecord`).
    num_reference_ties: int = 0
    # Typed errors by "status type" (e.g. "503 server_error"), for the report.
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def availability(self) -> float:
        return self.num_ok / self.num_sent if self.num_sent else math.nan

    @property
    def availability_excused(self) -> float:
        """Availability leaving out the requests whose own router was killed."""
        judged = self.num_sent - self.num_excused
        return self.num_ok / judged if judged else math.nan


@dataclass(slots=True)
class Verdict:
    """What the checker found."""

    soak: PhaseFigures
    fault_free: PhaseFigures
    goodput_req_s: float
    goodput_tokens_s: float
    fault_free_goodput_req_s: float
    fault_free_goodput_tokens_s: float
    num_leaked_blocks: int
    recovery: list[Recovery]
    num_faults_applied: int
    num_faults_skipped: int
    violations: list[Violation]
    missed: list[str]

    @property
    def passed(self) -> bool:
        return not self.missed

    @property
    def goodput_ratio(self) -> float:
        """Goodput under faults over fault-free goodput (requests/s; same rate)."""
        base = self.fault_free_goodput_req_s
        return self.goodput_req_s / base if base else math.nan


def _is_prefix(got: Sequence[int], want: Sequence[int]) -> bool:
    return len(got) <= len(want) and tuple(want[: len(got)]) == tuple(got)


def _router_killed(r: RequestRecord, kills: Sequence[FaultRecord]) -> bool:
    """Whether a router the request depended on was SIGKILLed while it was open."""
    tried = set(r.routers)
    return any(
        f.start_s is not None
        and r.start_s - 1.0 <= f.start_s <= r.end_s + 0.5
        and tried & set(f.targets)
        for f in kills
    )


class _Judge:
    def __init__(self, history: History) -> None:
        self.history = history
        self.kills = [f for f in history.faults if f.applied and f.kind == "kill-router"]
        self.violations: list[Violation] = []

    def violate(self, r: RequestRecord, rule: str, detail: str) -> None:
        self.violations.append(Violation(r.phase.value, r.index, rule, detail))

    def tokens(self, r: RequestRecord, fig: PhaseFigures, whole: bool) -> bool:
        """Check the tokens received against the reference (all of it when `whole`), or
        against one of the request's other fault-free outputs."""
        got, want = r.token_ids, r.expected_token_ids
        for i, ref in enumerate((want, *r.alternative_token_ids)):
            if got == ref if whole else _is_prefix(got, ref):
                fig.num_reference_ties += i > 0
                return True
        lost, dup = lost_and_duplicated(want if whole else want[: len(got)], got)
        fig.num_divergent += 1
        fig.num_tokens_lost += lost
        fig.num_tokens_duplicated += dup
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        self.violate(
            r,
            "divergent",
            f"{len(got)} tokens, {len(want)} expected; first difference at {at}"
            f" ({lost} lost, {dup} duplicated)",
        )
        return False

    def judge(self, r: RequestRecord, fig: PhaseFigures) -> None:
        fig.num_sent += 1
        if r.latency_s > r.deadline_s or r.ending is Ending.TIMEOUT:
            fig.num_past_deadline += 1
            self.violate(r, "past_deadline", f"{r.latency_s:.1f} s, deadline {r.deadline_s:g} s")
            return
        killed = _router_killed(r, self.kills)
        if r.malformed is not None:
            self._malformed(r, fig, killed)
            return
        ending = r.ending
        if ending is Ending.COMPLETE:
            if self.tokens(r, fig, whole=True):
                texts = {r.expected_token_ids: r.expected_text}
                texts |= dict(zip(r.alternative_token_ids, r.alternative_texts, strict=False))
                if r.text != texts.get(r.token_ids):
                    self.violate(r, "text_differs", f"{r.text[:60]!r} != {r.expected_text[:60]!r}")
                    return
                fig.num_ok += 1
                fig.num_ok_tokens += len(r.token_ids)
        elif ending is Ending.CLIENT_DISCONNECT:
            if self.tokens(r, fig, whole=False):
                fig.num_ok += 1
        elif ending is Ending.HTTP_ERROR:
            self._http_error(r, fig)
        elif ending is Ending.STREAM_ERROR:
            if self.tokens(r, fig, whole=False):
                fig.num_typed_errors += 1
                key = f"stream {r.error_type}"
                fig.errors[key] = fig.errors.get(key, 0) + 1
        elif ending in (Ending.CUT, Ending.UNREACHABLE):
            if ending is Ending.CUT and not self.tokens(r, fig, whole=False):
                return
            if killed:
                fig.num_excused += 1
            else:
                self.violate(r, ending.value, f"no error and its router lived: {r.error_message}")

    def _http_error(self, r: RequestRecord, fig: PhaseFigures) -> None:
        if r.status in _TYPED_STATUSES and r.error_type:
            fig.num_typed_errors += 1
            key = f"{r.status} {r.error_type}"
            fig.errors[key] = fig.errors.get(key, 0) + 1
        elif r.status == 500:
            self.violate(r, "internal_error", f"500: {r.error_message}")
        else:
            self.violate(r, "refused", f"{r.status} {r.error_type}: {r.error_message}")

    def _malformed(self, r: RequestRecord, fig: PhaseFigures, killed: bool) -> None:
        if r.status == 400 and r.error_param == r.expected_param:
            fig.num_ok += 1
        elif r.ending in (Ending.CUT, Ending.UNREACHABLE) and killed:
            fig.num_excused += 1
        else:
            self.violate(
                r,
                "malformed_not_refused",
                f"{r.malformed}: got {r.status} param {r.error_param!r},"
                f" expected 400 param {r.expected_param!r}",
            )


def _recoveries(history: History, ok: list[RequestRecord]) -> list[Recovery]:
    by_kind: dict[str, list[float | None]] = {}
    for f in history.faults:
        if not f.applied or f.start_s is None:
            continue
        start = f.start_s
        targets = set(f.targets)
        after = sorted((r for r in ok if r.start_s >= start), key=lambda r: r.end_s)
        if f.kind == "etcd-restart":
            first = next(iter(after), None)
        elif f.kind in ("kill-router", "pause-router"):
            first = next((r for r in after if r.router in targets), None)
        else:
            first = next((r for r in after if targets & set(r.workers)), None)
        by_kind.setdefault(f.kind, []).append(None if first is None else first.end_s - start)
    out = []
    for kind, times in sorted(by_kind.items()):
        done = [t for t in times if t is not None]
        out.append(
            Recovery(
                kind,
                len(times),
                len(done),
                percentile(done, 50),
                max(done) if done else math.nan,
            )
        )
    return out


def check(history: History) -> Verdict:
    """Judge a history against its targets (see the module docstring)."""
    judge = _Judge(history)
    figures = {Phase.FAULT_FREE: PhaseFigures(), Phase.SOAK: PhaseFigures()}
    seen = Counter((r.phase, r.index) for r in history.requests)
    for (phase, index), n in seen.items():
        if n > 1:
            judge.violations.append(Violation(phase.value, index, "two_outcomes", f"{n} records"))
    for r in history.requests:
        judge.judge(r, figures[r.phase])
    q = history.quiescence
    leaked = 0
    for w in q.workers:
        if not w.reachable:
            judge.violations.append(Violation("rest", None, "worker_down", w.name))
            continue
        leaked += max(0, w.pinned_after - w.pinned_idle)
        if w.pinned_after > w.pinned_idle:
            judge.violations.append(
                Violation(
                    "rest",
                    None,
                    "leaked_blocks",
                    f"{w.name}: {w.pinned_after} pinned, idle {w.pinned_idle}",
                )
            )
        if w.num_running or w.num_waiting:
            judge.violations.append(
                Violation(
                    "rest",
                    None,
                    "work_left",
                    f"{w.name}: {w.num_running} running, {w.num_waiting} waiting",
                )
            )
    for left in q.processes_left:
        judge.violations.append(Violation("rest", None, "process_left", left))
    for name in q.given_up:
        judge.violations.append(Violation("rest", None, "given_up", name))
    soak, free = figures[Phase.SOAK], figures[Phase.FAULT_FREE]
    ok = [r for r in history.requests if r.phase is Phase.SOAK and _ok(r)]
    meta = history.meta
    verdict = Verdict(
        soak=soak,
        fault_free=free,
        goodput_req_s=soak.num_ok / meta.duration_s,
        goodput_tokens_s=soak.num_ok_tokens / meta.duration_s,
        fault_free_goodput_req_s=free.num_ok / meta.fault_free_s if meta.fault_free_s else 0.0,
        fault_free_goodput_tokens_s=(
            free.num_ok_tokens / meta.fault_free_s if meta.fault_free_s else 0.0
        ),
        num_leaked_blocks=leaked,
        recovery=_recoveries(history, ok),
        num_faults_applied=sum(f.applied for f in history.faults),
        num_faults_skipped=sum(not f.applied for f in history.faults),
        violations=judge.violations,
        missed=[],
    )
    verdict.missed = _missed(verdict, history)
    return verdict


def _ok(r: RequestRecord) -> bool:
    """A soak request that completed exactly as a fault-free output (for recovery times)."""
    return (
        r.malformed is None
        and r.ending is Ending.COMPLETE
        and (r.token_ids, r.text)
        in {
            (r.expected_token_ids, r.expected_text),
            *zip(r.alternative_token_ids, r.alternative_texts, strict=False),
        }
    )


def _missed(v: Verdict, history: History) -> list[str]:
    missed: list[str] = []
    s = v.soak
    rules = Counter(x.rule for x in v.violations)
    if s.num_sent == 0:
        missed.append("no request was sent under faults")
    for name, value in (
        ("divergent outputs", s.num_divergent + v.fault_free.num_divergent),
        ("tokens lost", s.num_tokens_lost + v.fault_free.num_tokens_lost),
        ("tokens duplicated", s.num_tokens_duplicated + v.fault_free.num_tokens_duplicated),
        ("leaked blocks", v.num_leaked_blocks),
        ("requests past their deadline", s.num_past_deadline + v.fault_free.num_past_deadline),
    ):
        if value:
            missed.append(f"{value} {name} (target 0)")
    target = history.meta.targets.min_availability
    if not s.availability_excused >= target:
        missed.append(
            f"availability {s.availability_excused:.4f} excluding requests whose router was"
            f" killed, target >= {target}"
        )
    if v.fault_free.num_sent and v.fault_free.num_ok != v.fault_free.num_sent:
        missed.append(
            f"the fault-free phase served {v.fault_free.num_ok} of {v.fault_free.num_sent}"
            " requests as expected"
        )
    counted = {"divergent", "past_deadline", "leaked_blocks"}
    for rule, n in sorted(rules.items()):
        if rule not in counted:
            missed.append(f"{n} x {rule} (target 0)")
    return missed
