"""The benchmarks' flags declared on their configs (`EngineBenchConfig`, `MultiTurnConfig`,
`TransferBenchConfig`, `LayoutSpec`, `HandoffConfig`): each is also a `PDSERVE_<FLAG>` variable and a `--config`
key of its subcommand, command line first; a bad value's error names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdlab.bench.command import build_parser
from pdlab.bench.engine_config import EngineBenchConfig
from pdlab.bench.engine_config import config_from_args as engine_config_from_args
from pdlab.bench.multiturn import ROUTINGS, MultiTurnConfig
from pdlab.bench.transfer import TransferBenchConfig
from pdlab.bench.transfer_command import config_from_args, handoff_config_from_args
from pdserve.errors import ConfigError
from pdserve.settings import build, parse_args


def _multiturn(argv: list[str], environ: dict[str, str]) -> MultiTurnConfig:
    return build(MultiTurnConfig, parse_args(build_parser(), ["multiturn", *argv], environ))


def test_multiturn_flags_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "mt.yaml"
    path.write_text("turns: 5\nchats: 9\nrouting: [round_robin]\n")
    environ = {"PDSERVE_CHATS": "3", "PDSERVE_DECODE": "4"}
    config = _multiturn(["--config", str(path), "--decode", "1"], environ)
    assert (config.num_turns, config.num_chats, config.num_decode) == (5, 3, 1)
    assert config.routings == ("round_robin",)
    assert _multiturn([], {}) == MultiTurnConfig()
    assert _multiturn([], {}).routings == tuple(ROUTINGS)


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"PDSERVE_CHATS": "many"}, "environment PDSERVE_CHATS"),
        ({"PDSERVE_ROUTING": "sideways"}, "environment PDSERVE_ROUTING: 'sideways' is not one of"),
        ({"PDSERVE_TURNS": "2"}, "--turns: must be >= 4"),
    ],
)
def test_a_bad_multiturn_value_names_it(environ: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _multiturn([], environ)


def test_transfer_flags_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"layers": 2, "runs": 7, "handoff-requests": 3, "transports": "tcp"}')
    environ = {"PDSERVE_RUNS": "3", "PDSERVE_FRAME_KIB": "64"}
    args = parse_args(build_parser(), ["transfer", "--config", str(path)], environ)
    config = config_from_args(args)
    assert (config.layout.num_layers, config.num_runs, config.transports) == (2, 3, ("tcp",))
    assert config.frame_bytes == 64 * 1024
    assert handoff_config_from_args(args).num_requests == 3
    defaults = parse_args(build_parser(), ["transfer"], {})
    assert config_from_args(defaults) == TransferBenchConfig()


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"PDSERVE_RUNS": "0"}, "--runs: expected comma-separated integers >= 1"),
        ({"PDSERVE_LAYERS": "x"}, "--layers: expected comma-separated integers >= 1"),
        ({"PDSERVE_TRANSPORTS": "tcp,pigeon"}, "--transports: expected distinct names"),
        ({"PDSERVE_DTYPE": "float16"}, "--dtype: LayoutSpec"),
    ],
)
def test_a_bad_transfer_value_names_its_flag(environ: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        config_from_args(parse_args(build_parser(), ["transfer"], environ))


def test_an_unknown_key_of_a_subcommand_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("layer: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'layer' \\(did you mean 'layers'\\?\\)"):
        parse_args(build_parser(), ["transfer", "--config", str(path)], {})


def test_a_subcommand_parse_leaves_the_parser_defaults_as_declared() -> None:
    parser = build_parser()
    parse_args(parser, ["multiturn"], {"PDSERVE_CHATS": "3"})
    assert parser.parse_args(["multiturn"]).chats == MultiTurnConfig().num_chats


def test_engine_bench_flags_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("model-shape: [tiny]\nrepeats: 5\ndtype: bfloat16\nquantization: int8\n")
    environ = {"PDSERVE_BATCH": "4,8", "PDSERVE_REPEATS": "2", "PDSERVE_QUICK": "1"}
    args = parse_args(
        build_parser(), ["engine", "--config", str(path), "--block-size", "8"], environ
    )
    config = engine_config_from_args(args)
    assert (config.batches, config.repeats, config.quick) == ((4, 8), 2, True)
    assert (config.model_shapes, config.block_size) == (("tiny",), 8)
    assert (config.model.dtype, config.model.quantization) == ("bfloat16", "int8")
    default = engine_config_from_args(parse_args(build_parser(), ["engine"], {}))
    assert default == EngineBenchConfig()


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"PDSERVE_MODEL_SHAPE": "huge"}, "environment PDSERVE_MODEL_SHAPE: 'huge' is not one of"),
        ({"PDSERVE_BATCH": "4,0"}, "environment PDSERVE_BATCH: expected a positive integer"),
        ({"PDSERVE_QUANTIZATION": "int4"}, "environment PDSERVE_QUANTIZATION"),
    ],
)
def test_a_bad_engine_bench_value_names_the_variable(environ: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_args(build_parser(), ["engine"], environ)
