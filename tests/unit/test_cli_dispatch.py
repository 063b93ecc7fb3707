"""`pdserve worker` / `pdserve router` hand every argument, --help included, to the process."""

from __future__ import annotations

import pytest

from pdserve import cli


def test_process_commands_keep_their_own_flags() -> None:
    assert cli.process_command(["worker", "--help"]) == ("worker", ["--help"])
    assert cli.process_command(["router", "--", "--port", "0"]) == ("router", ["--port", "0"])
    assert cli.process_command(["status", "--json"]) is None
    assert cli.process_command([]) is None


def test_worker_help_is_the_workers_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["worker", "--help"])
    assert exit_info.value.code == 0
    assert "--role {prefill,decode,both}" in capsys.readouterr().out
