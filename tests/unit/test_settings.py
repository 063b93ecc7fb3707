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
from pdserve.config import DTYPE, DTYPES, EngineConfig, ModelLoadConfig
from pdserve.errors import ConfigError
from pdserve.router.config import AffinityConfig, BreakerConfig, RecoveryConfig, RouterConfig
from pdserve.router.flags import policy_configs
from pdserve.router.main import build_parser as router_parser
from pdserve.router.main import config_from_args
from pdserve.router.mode.auto_mode import AutoConfig
from pdserve.router.mode.interference import SLOConfig
from pdserve.settings import add_fields, build, env_name, parse_args, setting
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
        # up declares its block size itself (UpConfig) and takes no --quantization.
        assert option in up or option in ("--block-size", "--quantization"), option


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


# ---- the model to load and the cluster secret's file, declared on their config fields -----


def test_model_flags_come_from_the_environment_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("model: /models/a\nquantization: int8\n")
    environ = {"PDSERVE_DTYPE": "bfloat16", "PDSERVE_INSECURE_NO_AUTH": "1"}
    args = parse_args(worker_parser(), ["--config", str(path)], environ)
    model = build_config(args).engine.model
    assert (model.path, model.dtype, model.quantization) == ("/models/a", "bfloat16", "int8")
    none = parse_args(worker_parser(), ["--insecure-no-auth"], {"PDSERVE_QUANTIZATION": "none"})
    assert build_config(none).engine.model == ModelLoadConfig()


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"PDSERVE_DTYPE": "float8"}, "environment PDSERVE_DTYPE: 'float8' is not one of"),
        ({"PDSERVE_QUANTIZATION": "int4"}, "environment PDSERVE_QUANTIZATION: 'int4'"),
        ("dtype: float8\n", "key 'dtype': 'float8' is not one of"),
    ],
)
def test_a_bad_model_value_names_its_source(
    tmp_path: Path, source: dict[str, str] | str, says: str
) -> None:
    argv: list[str] = []
    if isinstance(source, str):
        (tmp_path / "w.yaml").write_text(source)
        argv, source = ["--config", str(tmp_path / "w.yaml")], {}
    with pytest.raises(ConfigError, match=says):
        parse_args(worker_parser(), argv, source)


def test_one_declaration_gives_every_command_the_same_model_flags() -> None:
    from pdserve.cli.generate import build_parser as generate_parser

    def action(parser: argparse.ArgumentParser, dest: str) -> tuple[object, ...]:
        a = next(a for a in parser._actions if a.dest == dest)
        return (a.option_strings, a.default, a.choices, a.help)

    for dest in ("model", "dtype", "block_size"):
        want = action(worker_parser(), dest)
        assert action(up_parser(), dest) == action(generate_parser(), dest) == want, dest
    assert action(generate_parser(), "quantization") == action(worker_parser(), "quantization")


@pytest.mark.parametrize("where", ["environment", "file"])
@pytest.mark.parametrize("command", ["router", "worker"])
def test_the_cluster_secret_file_from_the_environment_or_a_file(
    tmp_path: Path, where: str, command: str
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32 + "\n")
    argv, environ = (["--model", "/m", "--worker", "http://w:1"] if command == "router" else []), {}
    if where == "environment":
        environ = {"PDSERVE_CLUSTER_SECRET_FILE": str(secret)}
    else:
        (tmp_path / "c.yaml").write_text(f"cluster-secret-file: {secret}\n")
        argv += ["--config", str(tmp_path / "c.yaml")]
    if command == "router":
        parser, make = router_parser(), lambda a: build(RouterConfig, a, **policy_configs(a))
    else:
        parser, make = worker_parser(), build_config
    config = make(parse_args(parser, argv, environ))
    assert config.cluster_secret is not None and config.cluster_secret.source == f"file {secret}"


def test_an_unreadable_cluster_secret_file_names_the_flag(tmp_path: Path) -> None:
    environ = {"PDSERVE_CLUSTER_SECRET_FILE": str(tmp_path / "missing")}
    with pytest.raises(ConfigError, match="cluster-secret-file: cannot read"):
        build_config(parse_args(worker_parser(), [], environ))


def test_a_shared_flag_declaration_takes_per_field_changes() -> None:
    @dataclasses.dataclass
    class Two:
        first: str = setting("float32", DTYPE)
        second: str = setting("bfloat16", DTYPE, name="speed-dtype", help="of the speed runs")

    parser = argparse.ArgumentParser()
    add_fields(parser, Two)
    first, second = parser._actions[1:]
    assert (first.option_strings, first.choices, first.help) == (["--first"], DTYPES, DTYPE.help)
    assert (second.option_strings, second.choices) == (["--speed-dtype"], DTYPES)
    assert (second.default, second.help) == ("bfloat16", "of the speed runs")
    assert build(Two, parser.parse_args(["--speed-dtype", "float16"])) == Two("float32", "float16")
