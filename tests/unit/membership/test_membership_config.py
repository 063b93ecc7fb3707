"""`--discovery` and friends on the router and worker command lines and configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.errors import ConfigError
from pdserve.router.config import RouterConfig
from pdserve.router.main import config_from_args
from pdserve.worker.config import WorkerConfig
from pdserve.worker.main import build_config, build_parser

URI = "etcd://127.0.0.1:2379/test"


def test_router_discovery_replaces_the_worker_list() -> None:
    config = config_from_args(["--discovery", URI, "--model", "/m"])
    assert config.discovery == URI and config.workers == ()


@pytest.mark.parametrize(
    ("workers", "discovery", "message"),
    [
        ((), None, "worker: at least one --worker URL (or --discovery) is needed"),
        (("http://w",), URI, "worker: give --worker URLs or --discovery, not both"),
        ((), "etcd://h:x", "discovery: 'etcd://h:x': the port is not a number"),
    ],
)
def test_router_config_errors(
    workers: tuple[str, ...], discovery: str | None, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        RouterConfig(workers=workers, model=Path("/m"), discovery=discovery)
    assert str(err.value).startswith(message)


def test_worker_flags() -> None:
    args = build_parser().parse_args(
        ["--role", "decode", "--discovery", URI, "--host", "0.0.0.0", "--advertise-host",
         "10.1.2.3", "--membership-ttl-s", "3"]
    )  # fmt: skip
    config = build_config(args)
    assert (config.discovery, config.advertised_host, config.membership_ttl_s) == (
        URI,
        "10.1.2.3",
        3,
    )
    # Without a --worker-id the default names the machine: pids repeat across machines.
    assert config.worker_id.startswith("decode-") and config.worker_id.count("-") >= 2
    assert build_config(build_parser().parse_args([])).advertised_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"discovery": "http://x"}, "discovery: 'http://x': scheme 'http'"),
        ({"discovery": URI, "worker_id": "a/b"}, "worker-id: 'a/b' must be non-empty"),
        ({"discovery": URI, "membership_ttl_s": 0}, "membership-ttl-s: must be a whole"),
        ({"discovery": URI, "host": "0.0.0.0"}, "advertise-host: needed with --host 0.0.0.0"),
    ],
)
def test_worker_config_errors(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        WorkerConfig(**fields)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)


def test_without_discovery_nothing_membership_is_checked() -> None:
    assert (
        WorkerConfig(
            worker_id="a/b", host="0.0.0.0", membership_ttl_s=0, insecure_no_auth=True
        ).discovery
        is None
    )
