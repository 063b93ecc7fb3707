"""The automatic mode's loop: gather the live figures, decide (`auto_mode.decide`), apply.

Every `interval_s` while enabled (`--mode auto`, or `POST /admin/mode {"mode": "auto"}`):
1. inputs: the live window (`LiveMonitor.figures`), the `both` workers of the compatible group
   from the pool, the breaker, and the engine busy time per phase over the window (the
   difference of each worker's step totals, from its /health polls, between now and the oldest
   sample inside the window; a worker that restarted is counted from its new start);
2. `decide` (pure) returns the layout to run and why;
3. apply: the overlay gets the prefill workers (`roles.choose_prefill`: those already assigned
   first, then the least loaded) and the dispatcher the mode (`disagg` when split, else
   `colocated`), in that order and with no await between, so no request begins in between.
   Requests already in flight keep the workers and the mode they began with.

Every evaluation is counted by (action, reason) (`pdserve_router_auto_decisions_total`) and
kept in a ring (`GET /admin/auto`); a change of layout is logged at INFO with its reason and
figures, a keep whose reason differs from the previous evaluation's at INFO too, repeats at
DEBUG. An operator's `POST /admin/mode {"mode": "disagg"|"colocated"}` disables the loop and
clears the overlay.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, deque
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from pdserve.clock import Clock, MonotonicClock
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import render_family
from pdserve.router.config import Mode
from pdserve.router.flows.dispatcher import Dispatcher
from pdserve.router.mode.auto_mode import (
    Action,
    AutoConfig,
    AutoInputs,
    AutoMemory,
    BreakerHealth,
    Decision,
    Layout,
    PhaseLoad,
    Reason,
    decide,
)
from pdserve.router.mode.breaker import BreakerState, CircuitBreaker
from pdserve.router.mode.interference import LiveFigures
from pdserve.router.mode.live_monitor import LiveMonitor
from pdserve.router.mode.roles import AssignedPool, assignable, choose_prefill
from pdserve.router.placement.policy import WorkerView, compatible_digest
from pdserve.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluation as `GET /admin/auto` shows it (also the recorded curves of the tests)."""

    at_s: float
    figures: LiveFigures
    num_workers: int
    breaker: BreakerHealth
    load: PhaseLoad
    decision: Decision


@dataclass(frozen=True, slots=True)
class _BusySample:
    at_s: float
    # url -> (pid, prefill busy s, decode busy s)
    workers: dict[str, tuple[int, float, float]]


def breaker_health(breaker: CircuitBreaker | None) -> BreakerHealth:
    """The breaker as the decision sees it."""
    if breaker is None or breaker.state is BreakerState.CLOSED:
        return BreakerHealth.CLOSED
    if breaker.state is BreakerState.HALF_OPEN or breaker.cooldown_over():
        return BreakerHealth.PROBING
    return BreakerHealth.OPEN


def phase_load(old: _BusySample | None, new: _BusySample) -> PhaseLoad:
    """Busy seconds per phase between two samples, summed over workers present in both with
    the same pid (a restarted worker's counters began again)."""
    if old is None:
        return PhaseLoad()
    prefill = decode = 0.0
    for url, (pid, p, d) in new.workers.items():
        before = old.workers.get(url)
        if before is None or before[0] != pid:
            continue
        prefill += max(0.0, p - before[1])
        decode += max(0.0, d - before[2])
    return PhaseLoad(prefill, decode)


class AutoController:
    """Runs the automatic mode over one pool and dispatcher."""

    def __init__(
        self,
        config: AutoConfig,
        monitor: LiveMonitor,
        pool: AssignedPool,
        dispatcher: Dispatcher,
        clock: Clock | None = None,
        enabled: bool = False,
        max_history: int = 300,
    ) -> None:
        self.config = config
        self.monitor = monitor
        self.pool = pool
        self.dispatcher = dispatcher
        self.clock = clock or MonotonicClock()
        self.enabled = enabled
        self.memory = AutoMemory()
        self.history: deque[Evaluation] = deque(maxlen=max_history)
        self.counts: Counter[tuple[Action, Reason]] = Counter()
        self._busy: deque[_BusySample] = deque()
        self._task: asyncio.Task[None] | None = None

    # ---- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Evaluate every interval in the background (evaluations skip while disabled)."""
        self._task = asyncio.create_task(self._run(), name="auto-mode")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            if not self.enabled:
                continue
            try:
                self.evaluate()
            except Exception:  # a bug here must not stop serving; the layout stays as it is
                log.exception("auto mode: evaluation failed")

    def enable(self) -> None:
        """Take over from the current layout (the operator's mode is overridden)."""
        if not self.enabled:
            self.enabled = True
            num_prefill = len(self.pool.overlay.prefill_urls)
            self.memory = AutoMemory(Layout(num_prefill), changed_at_s=self.clock.now())
            self.dispatcher.set_mode("disagg" if num_prefill else "colocated")
            log.info("auto mode: enabled at %s", _layout_text(self.memory.layout))

    def disable(self) -> None:
        """Stop deciding (an operator set the mode); the caller sets layout and mode."""
        if self.enabled:
            self.enabled = False
            log.info("auto mode: disabled by an operator's mode change")

    # ---- one evaluation -------------------------------------------------------------------

    def evaluate(self) -> Decision:
        """Gather, decide, apply and record one evaluation."""
        now = self.clock.now()
        views = self.pool.snapshot()
        workers = assignable(views, compatible_digest(views))
        inputs = AutoInputs(
            now_s=now,
            # Only what the current layout produced: figures of the previous one say nothing
            # about it, nor do requests that began before the change and end after it.
            figures=self.monitor.figures(self.memory.changed_at_s),
            num_workers=len(workers),
            breaker=breaker_health(self.dispatcher.breaker),
            load=self._phase_load(now, workers),
        )
        decision, self.memory = decide(self.memory, inputs, self.config, self.monitor.slo)
        self._apply(decision.layout, workers)
        self.counts[(decision.action, decision.reason)] += 1
        self._log(decision)
        self.history.append(
            Evaluation(
                now, inputs.figures, inputs.num_workers, inputs.breaker, inputs.load, decision
            )
        )
        return decision

    def _phase_load(self, now: float, workers: list[WorkerView]) -> PhaseLoad:
        sample = _BusySample(
            now,
            {
                w.url: (w.health.pid, w.health.steps.prefill_busy_s, w.health.steps.decode_busy_s)
                for w in workers
                if w.health is not None and w.health.steps is not None
            },
        )
        self._busy.append(sample)
        while len(self._busy) > 1 and self._busy[1].at_s <= now - self.config.window_s:
            self._busy.popleft()
        return phase_load(self._busy[0] if len(self._busy) > 1 else None, sample)

    def _apply(self, layout: Layout, workers: list[WorkerView]) -> None:
        overlay = self.pool.overlay
        wanted = min(layout.num_prefill, max(0, len(workers) - 1))
        prefill = choose_prefill(workers, overlay.prefill_urls & {w.url for w in workers}, wanted)
        if prefill != overlay.prefill_urls:
            overlay.assign(prefill)
        mode: Mode = "disagg" if prefill else "colocated"
        if self.dispatcher.mode != mode:
            self.dispatcher.set_mode(mode)

    def _log(self, decision: Decision) -> None:
        last = self.history[-1].decision if self.history else None
        if decision.action is not Action.KEEP:
            log.info(
                "auto mode: %s -> %s (%s): %s",
                decision.action.value,
                _layout_text(decision.layout),
                decision.reason.value,
                decision.detail,
            )
        elif last is None or last.reason is not decision.reason:
            log.info(
                "auto mode: keep %s (%s): %s",
                _layout_text(decision.layout),
                decision.reason.value,
                decision.detail,
            )
        else:
            log.debug("auto mode: keep (%s): %s", decision.reason.value, decision.detail)

    # ---- views ----------------------------------------------------------------------------

    def layout_counts(self) -> tuple[int, int]:
        """(prefill, decode) workers assigned now; colocated: (0, every assignable worker)."""
        views = self.pool.snapshot()
        workers = assignable(views, compatible_digest(views))
        num_prefill = len(self.pool.overlay.prefill_urls & {w.url for w in workers})
        return num_prefill, len(workers) - num_prefill

    def render(self) -> list[Metric]:
        """Prometheus lines: decisions by (action, reason), workers per role, split or not."""
        lines = render_family(
            m.ROUTER_AUTO_DECISIONS,
            (
                ({"action": a.value, "reason": r.value}, n)
                for (a, r), n in sorted(
                    self.counts.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)
                )
            ),
        )
        num_prefill, num_decode = self.layout_counts()
        split = num_prefill > 0
        lines += render_family(
            m.ROUTER_AUTO_WORKERS,
            [
                ({"role": "prefill"}, num_prefill),
                ({"role": "decode"}, num_decode if split else 0),
                ({"role": "both"}, 0 if split else num_decode),
            ],
        )
        lines += render_family(m.ROUTER_AUTO_SPLIT, [({}, int(split))])
        return lines


def _layout_text(layout: Layout) -> str:
    return f"split, {layout.num_prefill} prefill" if layout.split else "colocated"


def finite(value: float) -> float | None:
    """JSON-safe: NaN and infinities become None."""
    return value if math.isfinite(value) else None
