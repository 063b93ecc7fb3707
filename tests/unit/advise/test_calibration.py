"""SLOs and rates relative to a lone request: the conversion, the measurement, the flags."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.advise.calibration import Lone, Relative, calibrated, measure_lone, tpot_of
from pdserve.advise.command import build_parser, config_from_args
from pdserve.errors import ConfigError


def test_multiples_of_a_lone_request_become_absolute_slos_and_rates() -> None:
    lone = Lone(ttft_s=0.2, tpot_s=0.005, num_output_tokens=41)  # e2e 0.4 s
    slo, rates = calibrated(lone, Relative(ttft_x=10, tpot_x=2, rates_x=(0.5, 1, 2)))
    assert (slo.ttft_s, slo.tpot_s) == (pytest.approx(2.0), pytest.approx(0.01))
    assert rates == (1.25, 2.5, 5.0)
    # A machine twice as slow gets SLOs twice as loose and rates half as high.
    slow = Lone(ttft_s=0.4, tpot_s=0.010, num_output_tokens=41)
    slo2, rates2 = calibrated(slow, Relative(ttft_x=10, tpot_x=2, rates_x=(0.5, 1, 2)))
    assert slo2.tpot_s == pytest.approx(2 * slo.tpot_s) and rates2 == (0.625, 1.25, 2.5)


def test_the_measurement_takes_medians_after_a_warm_up_and_skips_failures() -> None:
    answers = iter([(9.0, 9.0), (0.3, 0.004), None, (0.1, 0.006), (0.2, 0.005)])

    async def send() -> tuple[float, float] | None:
        return next(answers)

    lone = asyncio.run(measure_lone(send, repeats=4, num_output_tokens=10))
    assert (lone.ttft_s, lone.tpot_s) == (0.2, 0.005)  # the warm-up's 9 s is not counted

    async def failing() -> tuple[float, float] | None:
        return None

    with pytest.raises(ConfigError, match="every lone request failed"):
        asyncio.run(measure_lone(failing, repeats=2, num_output_tokens=10))


def test_tpot_of_a_stream() -> None:
    assert tpot_of(0.1, 0.5, 5) == pytest.approx(0.1)
    assert tpot_of(None, 0.5, 5) is None and tpot_of(0.1, 0.5, 1) is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--slo-ttft-x", "10"], "--slo-tpot-x: needed"),
        (["--slo-ttft-x", "10", "--slo-tpot-x", "2", "--rates-x", "1", "--slo-tpot-ms", "5"],
         "--slo-tpot-ms: give absolute SLOs"),
        (["--slo-ttft-x", "10", "--slo-tpot-x", "2", "--rates-x", "1", "--rates", "3"],
         "--rates: give absolute rates"),
        (["--slo-ttft-x", "-1", "--slo-tpot-x", "2", "--rates-x", "1"], "--slo-ttft-x"),
        (["--slo-ttft-x", "10", "--slo-tpot-x", "2", "--rates-x", "1,x"], "--rates-x"),
    ],
)  # fmt: skip
def test_bad_relative_flags_are_named(argv: list[str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        config_from_args(build_parser().parse_args(argv))


def test_relative_flags_make_a_relative_config() -> None:
    argv = ["--slo-ttft-x", "12", "--slo-tpot-x", "1.8", "--rates-x", "0.25,0.5", "--calibration-repeats", "3"]  # fmt: skip
    config = config_from_args(build_parser().parse_args(argv))
    assert config.relative == Relative(ttft_x=12, tpot_x=1.8, rates_x=(0.25, 0.5), repeats=3)
    assert config_from_args(build_parser().parse_args([])).relative is None
