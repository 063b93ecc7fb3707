"""The checkpoint cost report: ratios and targets from measured runs, a table per run."""

from __future__ import annotations

from pdlab.chaos.checkpoint_costs import CostResult, render_table, summarize


def _run(context: int, mode: str, gap: float, recomputed: int, equal: bool = True) -> CostResult:
    return CostResult(context, mode, gap, recomputed, 0 if mode == "off" else 1 << 20,
                      "" if mode == "off" else "checkpoint", equal)  # fmt: skip


def test_targets_are_judged_at_the_longest_context() -> None:
    results = [
        _run(512, "off", 0.06, 530),
        _run(512, "every-1", 0.05, 8),
        _run(8192, "off", 2.8, 8216),
        _run(8192, "every-1", 0.2, 8),
    ]
    summary = summarize(results)
    ratios = summary["recovery_ratio_on_over_off"]
    assert isinstance(ratios, dict)
    assert round(ratios["512"], 3) == 0.833 and round(ratios["8192"], 3) == 0.071
    assert summary["target_recovery_ratio_le_0.25"] is True
    assert summary["target_recomputed_lt_one_block"] is True
    assert summary["all_text_equal"] is True


def test_missed_targets_and_differing_text_are_reported() -> None:
    results = [_run(8192, "off", 1.0, 8216), _run(8192, "every-1", 0.5, 16, equal=False)]
    summary = summarize(results)
    assert summary["target_recovery_ratio_le_0.25"] is False
    assert summary["target_recomputed_lt_one_block"] is False  # 16 is a whole block
    assert summary["all_text_equal"] is False
    table = render_table([*results, CostResult(2048, "off", error="boom")])
    assert "DIFF" in table and "error: boom" in table and "1.00" in table


def test_a_missing_mode_gives_no_ratio() -> None:
    summary = summarize([_run(512, "off", 0.1, 530)])
    assert summary["recovery_ratio_on_over_off"] == {"512": None}
    assert summary["target_recovery_ratio_le_0.25"] is False
