"""Which KV transport a pair uses (pure): best common one, never a silent downgrade."""

from __future__ import annotations

import pytest

from pdserve.errors import ConfigError, TransportUnavailable
from pdserve.protocol.worker_api import KVEndpoint
from pdserve.worker.kv.transports import (
    DIFFERENT_HOSTS,
    NOT_ON_SENDER,
    choose,
    local_transports,
    parse_address,
)


def offer(*transports: str, host: str = "h1") -> list[KVEndpoint]:
    return [
        KVEndpoint(transport=t, address=f"127.0.0.1:{i + 1}", host_id=host)
        for i, t in enumerate(transports)
    ]  # type: ignore[arg-type]


def test_the_best_transport_both_sides_have_is_used() -> None:
    assert (
        choose(offer("nixl", "shm", "tcp"), ("nixl", "shm", "tcp"), "h1", False).endpoint.transport
        == "nixl"
    )
    choice = choose(offer("shm", "tcp"), ("nixl", "shm", "tcp"), "h1", False)
    assert (choice.endpoint.transport, choice.downgraded_from) == ("shm", None)


def test_a_fallback_says_what_was_given_up_and_why() -> None:
    choice = choose(offer("nixl", "shm", "tcp"), ("shm", "tcp"), "h1", False)
    assert (choice.endpoint.transport, choice.downgraded_from, choice.reason) == (
        "shm",
        "nixl",
        NOT_ON_SENDER,
    )
    choice = choose(offer("shm", "tcp", host="h2"), ("shm", "tcp"), "h1", False)
    assert (choice.endpoint.transport, choice.reason) == ("tcp", DIFFERENT_HOSTS)
    assert "different hosts" in (choice.detail or "")


def test_an_explicit_transport_the_peer_lacks_is_an_error_naming_why() -> None:
    with pytest.raises(TransportUnavailable, match=r"asked for here.*offers tcp"):
        choose(offer("tcp"), ("shm",), "h1", True)
    with pytest.raises(TransportUnavailable, match="different hosts"):
        choose(offer("shm", host="h2"), ("shm",), "h1", True)


def test_local_transports_and_addresses() -> None:
    assert local_transports("tcp") == ("tcp",)
    assert local_transports("auto")[-2:] == ("shm", "tcp")
    with pytest.raises(ConfigError, match="kv-transport"):
        local_transports("rdma")
    assert parse_address("[::1]:80", "f") == ("::1", 80)
    for bad in ("host", "host:0", ":80", "h:99999", "h:x"):
        with pytest.raises(ConfigError, match="f: "):
            parse_address(bad, "f")
