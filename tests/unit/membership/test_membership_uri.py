"""`--discovery` URIs: what parses to which endpoint, and which message each bad form gets."""

from __future__ import annotations

import pytest

from pdserve.errors import ConfigError
from pdserve.membership.uri import DEFAULT_PORT, DEFAULT_PREFIX, EtcdEndpoint, parse_discovery


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("etcd://127.0.0.1:2379", EtcdEndpoint("127.0.0.1", 2379, DEFAULT_PREFIX)),
        ("etcd://etcd.svc", EtcdEndpoint("etcd.svc", DEFAULT_PORT, DEFAULT_PREFIX)),
        ("etcd://h:23790/", EtcdEndpoint("h", 23790, DEFAULT_PREFIX)),
        ("etcd://h:1/team-a/pd.v1", EtcdEndpoint("h", 1, "/team-a/pd.v1")),
        ("etcd://h:1/x/", EtcdEndpoint("h", 1, "/x")),
        ("etcd://[::1]:2379/p", EtcdEndpoint("::1", 2379, "/p")),
    ],
)
def test_valid_uris(value: str, expected: EtcdEndpoint) -> None:
    assert parse_discovery(value) == expected


def test_target_and_str_bracket_ipv6() -> None:
    assert parse_discovery("etcd://[::1]:5/p").target == "[::1]:5"
    assert str(parse_discovery("etcd://h")) == "etcd://h:2379/pdserve"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("127.0.0.1:2379", "no scheme"),
        ("http://h:2379", "scheme 'http' is not supported"),
        ("etcd://", "no host"),
        ("etcd://:2379", "no host"),
        ("etcd://h:port", "the port is not a number in 1..65535"),
        ("etcd://h:0", "the port is not a number in 1..65535"),
        ("etcd://h:70000", "the port is not a number in 1..65535"),
        ("etcd://user:pw@h:2379", "credentials in the URI are not supported"),
        ("etcd://h:2379?x=1", "query strings and fragments are not supported"),
        ("etcd://h:2379#f", "query strings and fragments are not supported"),
        ("etcd://h/a//b", "prefix '/a//b' must be /-separated segments"),
        ("etcd://h/a b", "prefix '/a b' must be /-separated segments"),
    ],
)
def test_bad_uris_name_the_value_and_the_form(value: str, why: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_discovery(value)
    message = str(err.value)
    assert message.startswith(f"discovery: {value!r}: {why}")
    assert message.endswith("expected etcd://HOST[:PORT][/PREFIX]")
