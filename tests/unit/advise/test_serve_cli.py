"""`pdserve bench serve` flags: defaults, and one line naming the flag for each bad value."""

from __future__ import annotations

import pytest

from pdlab.bench.command import build_parser
from pdserve.advise.goodput import MODES, ServeConfig, config_from_args
from pdserve.advise.goodput_stats import SLO
from pdserve.cli import main


def parse(*flags: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_defaults_compare_both_modes_on_two_workers_each() -> None:
    c = parse()
    assert c.rates == ServeConfig().rates and c.modes == ("disagg", "colocated")
    assert (c.num_requests, c.duration_s) == (None, ServeConfig().duration_s)
    assert {m: s.num_prefill + s.num_decode for m, s in MODES.items()} == {
        "disagg": 2,
        "colocated": 2,
    }


def test_flags_reach_the_config() -> None:
    c = parse("--rates", "1,2.5", "--num-requests", "7", "--modes", "colocated")
    assert (c.rates, c.num_requests, c.duration_s, c.modes) == ((1.0, 2.5), 7, None, ("colocated",))
    c = parse("--ttft-slo-ms", "500", "--tpot-slo-ms", "40", "--seed", "9", "--duration-s", "3")
    assert (c.slo, c.seed, c.duration_s) == (SLO(ttft_s=0.5, tpot_s=0.04), 9, 3.0)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rates", "abc"], "--rates"),
        (["--rates", "1,0"], "--rates"),
        (["--rates", "2,2"], "--rates"),
        (["--ttft-slo-ms", "-5"], "--ttft-slo-ms"),
        (["--tpot-slo-ms", "nan"], "--tpot-slo-ms"),
        (["--num-requests", "0"], "--num-requests"),
        (["--num-requests", "3", "--duration-s", "2"], "--num-requests"),
        (["--duration-s", "x"], "--duration-s"),
        (["--modes", "disagg,pipelined"], "--modes"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pdserve bench: error: {named}:")
