"""`pdserve chaos --plot`: the slowest *completed* request's timeline is the one drawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pdlab.chaos import run as chaos
from pdlab.chaos.scenarios import Scenario, ScenarioResult, Trigger
from pdserve.advise.client import Completion


class _Cluster:
    """Just what `_collect_facts` asks of a cluster whose router is alive."""

    def router_alive(self) -> bool:
        return True


def _view(request_id: str) -> dict[str, object]:
    history = [{"state": "RECEIVED", "monotonic_ns": 0, "detail": ""}]
    return {"request_id": request_id, "history": history}


def _collect(
    monkeypatch: pytest.MonkeyPatch, completions: list[Completion], plot_dir: Path | None
) -> tuple[ScenarioResult, list[tuple[str, Path]]]:
    drawn: list[tuple[str, Path]] = []

    def timelines(cluster: object, done: Sequence[Completion]) -> list[dict[str, object]]:
        return [_view(c.request_id) for c in done if c.request_id is not None]

    def save_plot(view: Mapping[str, Any], path: Path) -> None:
        drawn.append((str(view["request_id"]), path))

    monkeypatch.setattr(chaos, "_timelines", timelines)
    monkeypatch.setattr(chaos, "save_plot", save_plot)
    result = ScenarioResult("s", "")
    scenario = Scenario("stall_link", "", Trigger.PLAN)
    chaos._collect_facts(scenario, _Cluster(), completions, result, plot_dir)  # type: ignore[arg-type]
    return result, drawn


def test_the_slowest_completed_request_is_drawn_not_a_slower_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    completions = [
        Completion("cmpl-a", [1], "length", None, 0.1, 1.0),
        Completion("cmpl-b", [1], "length", None, 0.1, 3.0),
        Completion("cmpl-c", [], None, "http_503: busy", None, 9.0),
    ]
    result, drawn = _collect(monkeypatch, completions, tmp_path)
    assert drawn == [("cmpl-b", tmp_path / "stall_link.png")]
    assert result.facts["timeline_plot"] == str(tmp_path / "stall_link.png")
    # The text waterfall still shows the slowest request however it ended.
    assert result.facts["slowest_timeline"] == ["+0ms RECEIVED "]


def test_no_plot_without_a_folder_or_a_completed_request(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ok = Completion("cmpl-a", [1], "length", None, 0.1, 1.0)
    assert _collect(monkeypatch, [ok], None)[1] == []
    failed = Completion("cmpl-c", [], None, "http_503: busy", None, 9.0)
    result, drawn = _collect(monkeypatch, [failed], tmp_path)
    assert drawn == [] and "timeline_plot" not in result.facts
