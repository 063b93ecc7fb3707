"""Config declared once (`pdserve.settings`): a field's flag comes from its declaration, and
every source is read in one order: command line > environment > config file > default."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.cli.up import build_parser as up_parser
from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.errors import ConfigError
from pdserve.router.config import AffinityConfig, BreakerConfig, RecoveryConfig
from pdserve.router.main import build_parser as router_parser
from pdserve.router.main import config_from_args
from pdserve.router.mode.auto_mode import AutoConfig
from pdserve.router.mode.interference import SLOConfig
from pdserve.settings import env_name, parse_args
from pdserve.worker.main import build_config
from pdserve.worker.main import build_parser as worker_parser

BASE = ["--model", "/m", "--worker", "http://127.0.0.1:1", "--insecure-no-auth"]
POLICY = (
    (BreakerConfig, "breaker-"),
    (AffinityConfig, ""),
    (SLOConfig, ""),
    (AutoConfig, "auto-"),
    (RecoveryConfig, ""),
)


def _declared(cls: type, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("flag")
        if spec is not None:
            out.append("--" + (spec.name or prefix + f.name.replace("_", "-")))
    return out


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_every_declared_field_is_a_flag_of_each_command_that_builds_it() -> None:
    router, up, worker = _options(router_parser()), _options(up_parser()), _options(worker_parser())
    for cls, prefix in POLICY:
        for option in _declared(cls, prefix):
            assert option in router and option in up, option
    for option in _declared(EngineConfig, "") + _declared(ModelLoadConfig, ""):
        assert option in worker, option
        assert option in up or option == "--block-size", option  # up declares its own


def test_flags_build_the_policy_configs_with_units_and_inversions() -> None:
    flags = "--slo-ttft-ms 250 --no-breaker --breaker-window 7 --breaker-min-samples 3"
    flags += " --routing load --recovery local_prefill --auto-sustain 5"
    config = config_from_args([*BASE, *flags.split()])
    assert config.slo.ttft_s == 0.25 and config.slo.tpot_s == SLOConfig().tpot_s
    assert not config.breaker.enabled and config.breaker.window == 7
    assert config.affinity.routing == "load"
    assert config.recovery.steps == ("local_prefill",)
    assert config.auto.sustain == 5
    defaults = config_from_args(BASE)
    assert (defaults.slo, defaults.breaker, defaults.recovery) == (
        SLOConfig(),
        BreakerConfig(),
        RecoveryConfig(),
    )


@given(
    st.one_of(st.none(), st.integers(1, 500)),
    st.one_of(st.none(), st.integers(1, 500)),
    st.one_of(st.none(), st.integers(1, 500)),
)
def test_command_line_beats_environment_beats_file_beats_default(
    cli: int | None, env: int | None, file: int | None
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        argv: list[str] = []
        if file is not None:
            path = Path(tmp) / "w.yaml"
            path.write_text(f"max_num_seqs: {file}\n")
            argv += ["--config", str(path)]
        if cli is not None:
            argv += ["--max-num-seqs", str(cli)]
        environ = {} if env is None else {"PDSERVE_MAX_NUM_SEQS": str(env)}
        args = parse_args(worker_parser(), argv, environ)
    want = next(v for v in (cli, env, file, EngineConfig().max_num_seqs) if v is not None)
    assert build_config(args).engine.max_num_seqs == want


def test_environment_values_of_every_kind() -> None:
    environ = {
        "PDSERVE_ENABLE_PREFIX_CACHING": "false",
        "PDSERVE_INSECURE_NO_AUTH": "yes",
        "PDSERVE_KV_TRANSPORT": "tcp",
        "PDSERVE_MEMBERSHIP_TTL_S": "7",
    }
    args = parse_args(worker_parser(), [], environ)
    assert args.enable_prefix_caching is False and args.insecure_no_auth is True
    assert (args.kv_transport, args.membership_ttl_s) == ("tcp", 7)
    router = parse_args(router_parser(), [], {"PDSERVE_WORKER": "http://a:1,http://b:2"})
    assert router.worker == ["http://a:1", "http://b:2"]
    # A repeatable flag on the command line adds to the environment's list.
    more = parse_args(router_parser(), ["--worker", "http://c:3"], {"PDSERVE_WORKER": "http://a:1"})
    assert more.worker == ["http://a:1", "http://c:3"]


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("PDSERVE_MAX_NUM_SEQS", "many", "PDSERVE_MAX_NUM_SEQS"),
        ("PDSERVE_KV_TRANSPORT", "pigeon", "is not one of"),
        ("PDSERVE_ENABLE_PREFIX_CACHING", "maybe", "expected one of"),
    ],
)
def test_a_bad_environment_value_names_the_variable(name: str, value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as caught:
        parse_args(worker_parser(), [], {name: value})
    assert name in str(caught.value)


def test_an_unknown_config_key_names_the_closest_flag(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("max_num_seq: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'max-num-seqs'"):
        parse_args(worker_parser(), ["--config", str(path)], {})


def test_the_declared_defaults_stay_the_parsers_defaults(tmp_path: Path) -> None:
    # What `pdserve up` forwards is what differs from these: a file must not move them.
    path = tmp_path / "up.yaml"
    path.write_text("max_num_seqs: 4\n")
    parser = up_parser()
    args = parse_args(parser, ["--config", str(path)], {})
    action = next(a for a in parser._actions if a.dest == "max_num_seqs")
    assert (args.max_num_seqs, action.default) == (4, EngineConfig().max_num_seqs)


def test_env_names_follow_the_flag() -> None:
    action = next(a for a in worker_parser()._actions if a.dest == "kv_cache_bytes")
    assert env_name(action) == "PDSERVE_KV_CACHE_BYTES"
