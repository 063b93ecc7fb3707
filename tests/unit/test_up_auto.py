"""`pdserve up --mode auto`: checked before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.errors import ConfigError
from pdserve.supervise.launcher import UpConfig, check_router_args


@pytest.fixture(autouse=True)
def _tiny_cache(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tiny_model_path.parent))


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--mode", "auto", "--prefill", "1"], "prefill: auto mode gives `both` workers"),
        (["--mode", "auto", "--router-arg=--slo-tpot-ms=-1"], "--slo-tpot-ms"),
        (["--mode", "auto", "--router-arg=--auto-low-water=2"], "--auto-low-water"),
        (["--mode", "auto", "--router-arg=--no-such-flag"], "router-arg"),
    ],
)
def test_bad_auto_settings_exit_2_before_anything_starts(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["up", "--decode", "2", "--port", "0", *argv]) == 2
    assert named in capsys.readouterr().err


def test_auto_mode_takes_both_workers_only() -> None:
    config = UpConfig(num_prefill=0, num_decode=3, mode="auto", router_args=("--slo-tpot-ms", "20"))
    check_router_args(config)  # valid: no error
    with pytest.raises(ConfigError, match="mode"):
        UpConfig(mode="sideways")
