"""Who sets the mode and the roles: the operator (`POST /admin/mode`) or the automatic mode.

    POST /admin/mode {"mode": "colocated"}                    auto off, overlay cleared
    POST /admin/mode {"mode": "disagg"}                       auto off, the workers' own roles
    POST /admin/mode {"mode": "disagg", "num_prefill": P}     auto off, P `both` workers act
                                                              as prefill workers, the rest decode
    POST /admin/mode {"mode": "auto"}                         the automatic mode decides from now
    GET  /admin/auto                                          the automatic mode's last
                                                              evaluations (figures + decision)

A bad body is a 400 naming the field (`mode`, `num_prefill`) and changes nothing. Whatever
changes, requests in flight keep the mode and workers they began with (the dispatcher reads
the mode once per request; the overlay only changes later placements). `GET /health` shows
the same state through `AutoView`.
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from pdserve.errors import InvalidRequest
from pdserve.router.config import ModeSetting
from pdserve.router.flows.dispatcher import Dispatcher
from pdserve.router.mode.auto_controller import AutoController, Evaluation, finite
from pdserve.router.mode.interference import DecodeFigures, LiveFigures
from pdserve.router.mode.roles import AssignedPool, assignable, choose_prefill
from pdserve.router.placement.policy import compatible_digest

log = logging.getLogger(__name__)


class ModeChange(BaseModel):
    """POST /admin/mode body and answer."""

    # A misspelt field is a 400 naming it, not a silent default.
    model_config = ConfigDict(extra="forbid")

    mode: ModeSetting
    # Only with mode disagg: this many `both` workers take the prefill role (the others
    # decode); None: every worker keeps its own role.
    num_prefill: int | None = None
    previous: ModeSetting | None = None


class DecodeView(BaseModel):
    """Decode TPOT samples of one label in the live window (ms; None when there are none)."""

    num_tokens: int
    mean_ms: float | None
    p90_ms: float | None


class AutoView(BaseModel):
    """The automatic mode and the live figures it reads, in GET /health."""

    enabled: bool
    # Workers acting as prefill and as decode now (colocated: 0 prefill, every `both` worker).
    num_prefill: int
    num_decode: int
    prefill_workers: list[str]
    window_s: float
    decode_with_prefill: DecodeView
    decode_without_prefill: DecodeView
    # Fraction of requests ended in the window meeting each SLO (None: none ended).
    ttft_attainment: float | None
    tpot_attainment: float | None
    attainment: float | None
    arrival_rate: float
    last_action: str | None
    last_reason: str | None
    last_detail: str | None


def _nan_as_none(value: float | None) -> float | None:
    return None if value is None else finite(value)


def _none_as_nan(value: float | None) -> float:
    return math.nan if value is None else value


# A figure with no samples (NaN) is None in JSON; `to_figures` reads None back as NaN.
_Figure = Annotated[float | None, BeforeValidator(_nan_as_none)]


class DecodeFiguresView(BaseModel):
    """`interference.DecodeFigures` as JSON (seconds; None for NaN)."""

    num_tokens: int
    mean_s: _Figure
    p50_s: _Figure
    p90_s: _Figure

    def to_figures(self) -> DecodeFigures:
        """The figures back, None as NaN."""
        nan = _none_as_nan
        return DecodeFigures(self.num_tokens, nan(self.mean_s), nan(self.p50_s), nan(self.p90_s))


class FiguresView(BaseModel):
    """`interference.LiveFigures` as JSON (None for NaN); `to_figures` reads it back, which is
    how recorded evaluations replay through `auto_mode.decide` in the tests."""

    window_s: float
    with_prefill: DecodeFiguresView
    without_prefill: DecodeFiguresView
    num_requests: int
    ttft_attainment: _Figure
    tpot_attainment: _Figure
    attainment: _Figure
    request_tpot_p90_s: _Figure
    num_tpot_missed: int
    num_tpot_missed_interfered: int
    arrival_rate: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float

    def to_figures(self) -> LiveFigures:
        """The figures back, None as NaN."""
        figures: dict[str, Any] = {
            name: value.to_figures()
            if isinstance(value, DecodeFiguresView)
            else _none_as_nan(value)
            for name, value in self
        }
        return LiveFigures(**figures)


def _ms(seconds: float) -> float | None:
    value = finite(seconds)
    return None if value is None else value * 1e3


def figures_view(f: LiveFigures) -> FiguresView:
    """The JSON form of live figures (NaN as None)."""
    return FiguresView.model_validate(f, from_attributes=True)


class EvaluationView(BaseModel):
    """One evaluation in GET /admin/auto: its inputs and its decision."""

    at_s: float
    num_workers: int
    breaker: str
    prefill_busy_s: float
    decode_busy_s: float
    figures: FiguresView
    action: str
    reason: str
    num_prefill: int
    detail: str


def evaluation_view(e: Evaluation) -> EvaluationView:
    """The JSON form of one evaluation."""
    return EvaluationView(
        at_s=e.at_s,
        num_workers=e.num_workers,
        breaker=e.breaker.value,
        prefill_busy_s=e.load.prefill_busy_s,
        decode_busy_s=e.load.decode_busy_s,
        figures=figures_view(e.figures),
        action=e.decision.action.value,
        reason=e.decision.reason.value,
        num_prefill=e.decision.layout.num_prefill,
        detail=e.decision.detail,
    )


class ModeControl:
    """The admin side of modes and roles."""

    def __init__(
        self, dispatcher: Dispatcher, pool: AssignedPool, controller: AutoController
    ) -> None:
        self._dispatcher = dispatcher
        self._pool = pool
        self._controller = controller

    @property
    def setting(self) -> ModeSetting:
        """ "auto" while the automatic mode decides, else the mode new requests begin in."""
        return "auto" if self._controller.enabled else self._dispatcher.mode

    def change(self, change: ModeChange) -> ModeChange:
        """Apply an operator's change; InvalidRequest (nothing changed) for a bad one."""
        previous = self.setting
        if change.num_prefill is not None and change.mode != "disagg":
            raise InvalidRequest(
                f"num_prefill: only with mode disagg, got mode {change.mode!r}", "num_prefill"
            )
        if change.mode == "auto":
            self._controller.enable()
            return ModeChange(mode="auto", previous=previous)
        views = self._pool.snapshot()
        workers = assignable(views, compatible_digest(views))
        prefill: frozenset[str] = frozenset()
        if change.num_prefill is not None:
            if not 1 <= change.num_prefill <= len(workers) - 1:
                raise InvalidRequest(
                    f"num_prefill: must be in 1..{len(workers) - 1} (healthy `both` workers:"
                    f" {len(workers)}), got {change.num_prefill}",
                    "num_prefill",
                )
            prefill = choose_prefill(workers, self._pool.overlay.prefill_urls, change.num_prefill)
        self._controller.disable()
        self._pool.overlay.assign(prefill)
        self._dispatcher.set_mode(change.mode)
        log.info(
            "mode %s -> %s%s",
            previous,
            change.mode,
            f" with {len(prefill)} prefill: {sorted(prefill)}" if prefill else "",
        )
        return ModeChange(mode=change.mode, num_prefill=change.num_prefill, previous=previous)

    async def set_mode(self, request: web.Request) -> web.Response:
        """POST /admin/mode."""
        try:
            change = ModeChange.model_validate_json(await request.read())
        except ValidationError as exc:
            error = exc.errors()[0]
            field = str(error["loc"][0]) if error["loc"] else "mode"
            raise InvalidRequest(f"{field}: {error['msg']}", field) from exc
        return web.json_response(text=self.change(change).model_dump_json(exclude_none=True))

    async def get_auto(self, request: web.Request) -> web.Response:
        """GET /admin/auto: the evaluations in the ring, oldest first."""
        body = [evaluation_view(e).model_dump() for e in self._controller.history]
        return web.json_response({"enabled": self._controller.enabled, "evaluations": body})

    def view(self) -> AutoView:
        """The automatic mode and live figures for GET /health."""
        c = self._controller
        f = c.monitor.figures()
        num_prefill, num_decode = c.layout_counts()
        last = c.history[-1].decision if c.history else None
        return AutoView(
            enabled=c.enabled,
            num_prefill=num_prefill,
            num_decode=num_decode,
            prefill_workers=sorted(self._pool.overlay.prefill_urls),
            window_s=f.window_s,
            decode_with_prefill=DecodeView(
                num_tokens=f.with_prefill.num_tokens,
                mean_ms=_ms(f.with_prefill.mean_s),
                p90_ms=_ms(f.with_prefill.p90_s),
            ),
            decode_without_prefill=DecodeView(
                num_tokens=f.without_prefill.num_tokens,
                mean_ms=_ms(f.without_prefill.mean_s),
                p90_ms=_ms(f.without_prefill.p90_s),
            ),
            ttft_attainment=finite(f.ttft_attainment),
            tpot_attainment=finite(f.tpot_attainment),
            attainment=finite(f.attainment),
            arrival_rate=f.arrival_rate,
            last_action=None if last is None else last.action.value,
            last_reason=None if last is None else last.reason.value,
            last_detail=None if last is None else last.detail,
        )
