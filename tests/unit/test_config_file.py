"""`--config FILE` (YAML / JSON) for router, worker and `pdserve up`: keys are flags, typed and
checked by the flag itself, the command line overrides; `pdserve up` passes the router's and
the engine's flags on to its children."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.cli.up import forwarded
from pdserve.errors import ConfigError
from pdserve.router.main import config_from_args
from pdserve.settings import parse_args
from pdserve.worker.main import build_config
from pdserve.worker.main import build_parser as worker_parser


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_router_yaml_and_flags_override(tmp_path: Path) -> None:
    cfg = write(tmp_path, "r.yaml", """
worker: [http://127.0.0.1:1, http://127.0.0.1:2]
served_model_name: [alpha, beta]
max-model-len: 512
routing: load
max_migrations: 5
allow_unknown_fields: true
recovery: reprefill,local_prefill
""")  # fmt: skip
    config = config_from_args(["--config", str(cfg), "--max-migrations", "1", "--model", "/m"])
    assert config.workers == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert config.served_model_names == ("alpha", "beta") and config.model_name == "alpha"
    assert config.max_model_len == 512 and config.allow_unknown_fields
    assert config.affinity.routing == "load"
    assert config.recovery.max_migrations == 1  # the command line wins
    assert config.recovery.steps == ("reprefill", "local_prefill")


def test_worker_json_booleans(tmp_path: Path) -> None:
    cfg = write(tmp_path, "w.json", '{"enable_prefix_caching": false, "max_num_seqs": 8,'
                ' "enable-chunked-prefill": true, "batch_invariant": false}')  # fmt: skip
    parser = worker_parser()
    args = parse_args(parser, ["--config", str(cfg), "--role", "decode"], environ={})
    engine = build_config(args).engine
    assert (engine.enable_prefix_caching, engine.enable_chunked_prefill) == (False, True)
    assert (engine.max_num_seqs, engine.batch_invariant) == (8, False)
    args = parse_args(parser, ["--config", str(cfg), "--enable-prefix-caching"], environ={})
    assert build_config(args).engine.enable_prefix_caching


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("max_num_seqs: many\n", "max_num_seqs"),
        ("nonsense_key: 1\n", "nonsense_key"),
        ("enable_prefix_caching: maybe\n", "enable_prefix_caching"),
        ("no_enable_prefix_caching: true\n", "no_enable_prefix_caching"),
        ("role: sideways\n", "role"),
        ("max_num_seqs: [1, 2]\n", "max_num_seqs"),
        ("- just\n- a list\n", "mapping"),
        ("role: [\n", "YAML"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, named: str) -> None:
    cfg = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError, match=named):
        parse_args(worker_parser(), ["--config", str(cfg)], environ={})


def test_pdserve_up_forwards_router_and_engine_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, object] = {}

    def fake_run_up(config: object) -> int:
        seen["config"] = config
        return 0

    monkeypatch.setattr("pdserve.supervise.launcher.run_up", fake_run_up)
    cfg = write(tmp_path, "up.yaml", "max_num_seqs: 4\nserved_model_name: [m]\nmode: colocated\n")
    argv = ["up", "--config", str(cfg), "--no-enable-prefix-caching", "--max-model-len", "300",
            "--routing", "round_robin", "--max-reprefills", "0"]  # fmt: skip
    assert cli.main(argv) == 0
    config = seen["config"]
    assert config.mode == "colocated"  # type: ignore[attr-defined]
    assert config.worker_args == (  # type: ignore[attr-defined]
        "--max-num-seqs",
        "4",
        "--no-enable-prefix-caching",
        "--max-model-len",
        "300",
    )
    router = config.router_args  # type: ignore[attr-defined]
    assert router == ("--served-model-name", "m", "--routing", "round_robin",
                      "--max-reprefills", "0", "--max-model-len", "300")  # fmt: skip


def test_pdserve_up_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "up.yaml", "max_num_seqs: lots\n")
    assert cli.main(["up", "--config", str(cfg)]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_forwarded_skips_defaults() -> None:
    parser = argparse.ArgumentParser()
    actions = [parser.add_argument("--a", type=int, default=1),
               parser.add_argument("--b", action=argparse.BooleanOptionalAction, default=True)]  # fmt: skip
    assert forwarded(actions, parser.parse_args([])) == []
    assert forwarded(actions, parser.parse_args(["--a", "2", "--no-b"])) == [
        "--a",
        "2",
        "--no-b",
    ]
