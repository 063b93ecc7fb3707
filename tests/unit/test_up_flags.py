"""`pdserve up`'s own options, declared on `UpConfig`'s fields: each is a flag, a
`PDSERVE_<FLAG>` variable and a `--config` key, and what up passes on to its children is
only what it was given."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli.up import build_parser, config_from_args
from pdserve.errors import ConfigError
from pdserve.settings import parse_args
from pdserve.supervise.launcher import UpConfig, router_specs, worker_specs
from pdserve.supervise.policy import RestartPolicy


def _config(argv: list[str], environ: dict[str, str] | None = None) -> UpConfig:
    return config_from_args(parse_args(build_parser(), argv, environ or {}))


def test_no_flags_build_the_declared_defaults() -> None:
    config = _config([])
    assert config == UpConfig(state_file=config.state_file)


def test_flags_build_up_config() -> None:
    argv = ["--prefill", "2", "--decode", "3", "--routers", "2", "--port", "9000"]
    argv += ["--max-restarts", "1", "--restart-window-s", "5", "--liveness-timeout-s", "0"]
    argv += ["--etcd", "--model", "/m", "--dtype", "bfloat16", "--block-size", "32"]
    config = _config(argv)
    assert (config.num_prefill, config.num_decode, config.num_routers) == (2, 3, 2)
    assert (config.port, config.local_etcd, config.liveness_timeout_s) == (9000, True, None)
    assert config.restart == RestartPolicy(max_restarts=1, window_s=5.0)
    assert (config.model, config.dtype, config.block_size) == ("/m", "bfloat16", 32)


def test_options_from_the_environment_and_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "up.yaml"
    path.write_text("mode: auto\ndecode: 2\nrouters: 2\nliveness-timeout-s: 12.5\n")
    # Keys come from the process environment (or a file), as the children will read them.
    monkeypatch.setenv("PDSERVE_API_KEY", "k-from-the-env")
    environ = {"PDSERVE_ROUTERS": "3", "PDSERVE_ETCD": "yes"}
    config = _config(["--config", str(path)], environ)
    # auto mode without --prefill: no prefill-only workers.
    assert (config.mode, config.num_prefill, config.num_decode) == ("auto", 0, 2)
    assert (config.num_routers, config.local_etcd) == (3, True)
    assert config.api_key is not None and config.api_key.text == "k-from-the-env"
    assert config.liveness_timeout_s == 12.5


@pytest.mark.parametrize(
    ("environ", "file", "says"),
    [
        ({"PDSERVE_DECODE": "0"}, "", "environment PDSERVE_DECODE: expected a positive integer"),
        ({"PDSERVE_PORT": "70000"}, "", "environment PDSERVE_PORT: expected a port"),
        ({}, "mode: sideways\n", "key 'mode': 'sideways' is not one of"),
        ({}, "restart-window-s: 0\n", "key 'restart-window-s': expected a number > 0"),
        ({"PDSERVE_ETCD": "1", "PDSERVE_DISCOVERY": "etcd://h:1"}, "", "etcd: give --etcd"),
    ],
)
def test_a_bad_value_names_the_variable_or_the_key(
    tmp_path: Path, environ: dict[str, str], file: str, says: str
) -> None:
    argv: list[str] = []
    if file:
        (tmp_path / "up.yaml").write_text(file)
        argv = ["--config", str(tmp_path / "up.yaml")]
    with pytest.raises(ConfigError, match=says):
        _config(argv, environ)


def test_children_get_the_flags_they_always_got(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("k-from-a-file\n")
    argv = ["--model", "/m", "--dtype", "bfloat16", "--block-size", "32", "--max-num-seqs", "8"]
    argv += [
        "--slo-tpot-ms",
        "30",
        "--api-key-file",
        str(key_file),
        "--max-model-len",
        "128",
        "--mode",
        "colocated",
    ]
    argv += ["--router-arg=--routing=round_robin", "--device", "cpu", "--prefill", "0"]
    config = _config(argv)
    assert config.worker_args == (
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "128",
        "--device",
        "cpu",
    )
    assert config.router_args == ("--slo-tpot-ms", "30.0", "--max-model-len", "128",
                                  "--routing=round_robin")  # fmt: skip
    (worker,) = worker_specs(config, None)
    assert worker.argv == (
        *("pdserve.worker.main", "--role", "both", "--host", "127.0.0.1", "--port", "0"),
        *("--kv-port", "0", "--worker-id", "decode-0", "--dtype", "bfloat16", "--block-size"),
        *("32", "--model", "/m", *config.worker_args),
    )
    (router,) = router_specs(config, ["http://w:1"], None)
    assert router.argv == (
        *("pdserve.router.main", "--host", "127.0.0.1", "--port", "8000", "--mode", "colocated"),
        *("--worker", "http://w:1", "--model", "/m", *config.router_args),
    )
    # The key reaches the routers through their environment, never their command line.
    assert config.api_key is not None and config.api_key.text == "k-from-a-file"
    assert "k-from-a-file" not in " ".join(router.argv)


def test_tls_files_go_to_every_router_and_worker(tmp_path: Path) -> None:
    """One set of `--tls-*` files for the whole cluster: each child gets the same three flags
    (paths, not secrets: the key file's bytes never reach a command line)."""
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    for path in files.values():
        path.write_text("PEM\n")
    argv = [arg for name, path in files.items() for arg in (f"--tls-{name}", str(path))]
    config = _config(argv)
    assert config.tls.ca == files["ca"]
    tls = ("--tls-cert", str(files["cert"]), "--tls-key", str(files["key"]),
           "--tls-ca", str(files["ca"]))  # fmt: skip
    for spec in (*worker_specs(config, None), *router_specs(config, ["https://w:1"], None)):
        assert spec.argv[-6:] == tls, spec.argv
    with pytest.raises(ConfigError, match="tls-cert, tls-key: give both"):
        _config(["--tls-cert", str(files["cert"])])
