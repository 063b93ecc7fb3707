"""`pdserve advise` and `pdserve bench serve` flags declared on `AdviseConfig`, `Relative` and
`ServeConfig`: each is also a `PDSERVE_<FLAG>` variable and a `--config` key, command line
first; a bad value from any of them is refused naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlab.bench.command import build_parser as bench_parser
from pdserve.advise import goodput
from pdserve.advise.calibration import Relative
from pdserve.advise.command import AdviseConfig, build_parser, config_from_args
from pdserve.errors import ConfigError
from pdserve.settings import parse_args


@pytest.fixture(autouse=True)
def _tiny_cache(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default model's context is read (not built again) from the session's cache.
    monkeypatch.setenv("PDSERVE_CACHE", str(tiny_model_path.parent))


def _advise(argv: list[str], environ: dict[str, str]) -> AdviseConfig:
    return config_from_args(parse_args(build_parser(), argv, environ))


def test_advise_flags_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "advise.yaml"
    path.write_text("workers: 3\nseed: 7\ntarget-attainment: 0.5\nplot: out\nrepeats: 2\n")
    environ = {"PDSERVE_WORKERS": "4", "PDSERVE_MAX_NUM_BATCHED_TOKENS": "512"}
    config = _advise(["--config", str(path), "--repeats", "3"], environ)
    assert (config.num_workers, config.seed, config.target_attainment) == (4, 7, 0.5)
    assert (config.max_num_batched_tokens, config.repeats) == (512, 3)
    assert config.plot_dir == Path("out") and config.json_path is None
    default = _advise([], {})
    assert (default.num_workers, default.seed, default.repeats) == (2, 0, 1)
    assert (default.target_attainment, default.max_num_batched_tokens) == (0.9, None)


def test_calibration_flags_from_the_environment() -> None:
    environ = {"PDSERVE_SLO_TTFT_X": "12", "PDSERVE_SLO_TPOT_X": "1.8", "PDSERVE_RATES_X": "1,2"}
    config = _advise([], {**environ, "PDSERVE_CALIBRATION_REPEATS": "3"})
    assert config.relative == Relative(ttft_x=12, tpot_x=1.8, rates_x=(1.0, 2.0), repeats=3)


@pytest.mark.parametrize(
    ("environ", "file", "says"),
    [
        ({"PDSERVE_WORKERS": "9"}, "", "--workers: expected an integer >= 2 and <= 8, got '9'"),
        ({}, "target_attainment: 2\n", "--target-attainment: expected a number > 0 and <= 1"),
        ({}, "seed: -1\n", "--seed: expected an integer >= 0"),
        ({"PDSERVE_SLO_TTFT_X": "10", "PDSERVE_SLO_TPOT_X": "2"}, "", "--rates-x: needed with"),
        ({}, "workerz: 3\n", "unknown key 'workerz' \\(did you mean 'workers'\\?\\)"),
    ],
)
def test_a_bad_advise_value_names_the_flag(
    tmp_path: Path, environ: dict[str, str], file: str, says: str
) -> None:
    argv: list[str] = []
    if file:
        (tmp_path / "a.yaml").write_text(file)
        argv = ["--config", str(tmp_path / "a.yaml")]
    with pytest.raises(ConfigError, match=says):
        _advise(argv, environ)


def test_serve_flags_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "serve.json"
    path.write_text('{"modes": "colocated", "seed": 4, "json": "r.json"}')
    argv = ["serve", "--config", str(path), "--seed", "5"]
    config = goodput.config_from_args(parse_args(bench_parser(), argv, {"PDSERVE_SEED": "6"}))
    assert (config.modes, config.seed, config.json_path) == (("colocated",), 5, Path("r.json"))
    default = goodput.config_from_args(parse_args(bench_parser(), ["serve"], {}))
    assert (default.modes, default.seed, default.model) == (("disagg", "colocated"), 0, None)


def test_a_bad_serve_mode_names_the_flag() -> None:
    args = parse_args(bench_parser(), ["serve"], {"PDSERVE_MODES": "disagg,pigeon"})
    with pytest.raises(ConfigError, match="--modes: expected distinct names"):
        goodput.config_from_args(args)
