"""The `pdserve` command table: each command's module is imported only when it runs, process
commands get their arguments untouched, and tooling commands come from entry points."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import cli
from pdserve.cli.main import commands


def test_worker_help_is_the_workers_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["worker", "--help"])
    assert exit_info.value.code == 0
    assert "--role {prefill,decode,both}" in capsys.readouterr().out


def test_a_leading_double_dash_is_not_the_process_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["router", "--", "--help"])
    assert exit_info.value.code == 0
    assert "--cluster-secret-file" in capsys.readouterr().out


def test_unknown_command_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sideways"]) == 2
    assert "unknown command 'sideways'" in capsys.readouterr().err


def test_help_lists_every_command_with_tooling_from_entry_points(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("up", "worker", "router", "status", "advise", "bench", "chaos"):
        assert f"\n  {name} " in out
    assert commands()["chaos"].module == "pdlab.chaos.command"


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: pdserve COMMAND" in capsys.readouterr().err


def test_the_cli_loads_only_the_command_that_runs() -> None:
    # `pdserve status --help` must not import the router, the engine, torch or the tooling.
    code = (
        "import sys\n"
        "from pdserve.cli import main\n"
        "try:\n"
        "    main(['status', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "loaded = [m for m in ('torch', 'pdserve.router.app', 'pdserve.engine.engine',"
        " 'pdlab', 'pdserve.advise.goodput') if m in sys.modules]\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
