"""Cluster credentials: secrets, signed calls (forged, stale, replayed), field MACs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.auth.secret import ENV_VAR, ClusterSecret, load_secret, write_secret_file
from pdserve.auth.signing import (
    AUTH_HEADER,
    TARGET_HEADER,
    CallVerifier,
    auth_headers,
    call_target,
    mac_fields,
    sign_call,
)
from pdserve.errors import ConfigError, Forbidden, StaleInstance, Unauthenticated

KEY = ClusterSecret(b"s" * 32, "test").key("http")


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_signed_call_passes_once_and_its_replay_is_refused() -> None:
    clock = Clock()
    verifier = CallVerifier(KEY, clock, window_s=60)
    header = sign_call(KEY, "POST", "/reserve", b'{"a":1}', clock.now)
    verifier.verify(header, "POST", "/reserve", b'{"a":1}')
    with pytest.raises(Forbidden, match="already used"):
        verifier.verify(header, "POST", "/reserve", b'{"a":1}')
    assert verifier.num_refused == 1 and verifier.num_remembered == 1


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"header": None}, Unauthenticated, "no X-Pdserve-Auth"),
        ({"header": "Bearer x"}, Unauthenticated, "is not"),
        ({"header": "pdserve-v1 soon abcdefgh 00"}, Unauthenticated, "timestamp"),
        ({"body": b'{"a":2}'}, Forbidden, "does not match"),  # the body changed
        ({"path": "/release"}, Forbidden, "does not match"),  # another endpoint
        ({"method": "GET"}, Forbidden, "does not match"),
        ({"key": b"k" * 32}, Forbidden, "does not match"),  # another cluster
        ({"sent_at": 1000.0 - 61}, Forbidden, "outside the 60 s window"),
        ({"sent_at": 1000.0 + 61}, Forbidden, "outside the 60 s window"),
    ],
)
def test_bad_credentials_are_refused_and_leave_no_state(
    change: dict[str, object], error: type[Exception], match: str
) -> None:
    verifier = CallVerifier(KEY, Clock(), window_s=60)
    key = change.get("key", KEY)
    sent_at = change.get("sent_at", 1000.0)
    header = sign_call(key, "POST", "/reserve", b'{"a":1}', sent_at)  # type: ignore[arg-type]
    header = change.get("header", header)  # type: ignore[assignment]
    method = str(change.get("method", "POST"))
    path = str(change.get("path", "/reserve"))
    body = change.get("body", b'{"a":1}')
    with pytest.raises(error, match=match):
        verifier.verify(header, method, path, body)  # type: ignore[arg-type]
    assert verifier.num_remembered == 0 and verifier.num_refused == 1


def test_nonce_memory_is_bounded_and_never_lets_a_replay_through() -> None:
    clock = Clock()
    verifier = CallVerifier(KEY, clock, window_s=60, max_nonces=3)
    headers = [sign_call(KEY, "GET", "/x", b"", clock.now + i * 0.1) for i in range(5)]
    clock.now += 1.0
    for header in headers:
        verifier.verify(header, "GET", "/x", b"")
    assert verifier.num_remembered == 3
    # The two forgotten ones are refused as stale, not accepted again.
    for header in headers:
        with pytest.raises(Forbidden):
            verifier.verify(header, "GET", "/x", b"")
    # Fresh calls still pass; old nonces leave once their window is over.
    clock.now += 120
    verifier.verify(sign_call(KEY, "GET", "/x", b"", clock.now), "GET", "/x", b"")
    assert verifier.num_remembered == 1


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.one_of(st.text(), st.binary(), st.integers(), st.none()), max_size=4),
    b=st.lists(st.one_of(st.text(), st.binary(), st.integers(), st.none()), max_size=4),
)
def test_field_macs_are_unambiguous(a: list[object], b: list[object]) -> None:
    # Different field lists never sign the same bytes (each part is typed and length-prefixed).
    same = a == b and [type(x) for x in a] == [type(x) for x in b]
    assert (mac_fields(KEY, *a) == mac_fields(KEY, *b)) == same  # type: ignore[arg-type]


def test_secret_sources(tmp_path: Path) -> None:
    assert load_secret(None, environ={}) is None
    from_env = load_secret(None, environ={ENV_VAR: " " + "e" * 20 + "\n"})
    assert from_env is not None and from_env.raw == b"e" * 20
    written = write_secret_file(tmp_path / "s")
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o600
    loaded = load_secret(tmp_path / "s", environ={ENV_VAR: "ignored-because-a-file-wins"})
    assert loaded is not None and loaded.raw == written.raw and "file" in loaded.source
    assert written.raw.decode() not in repr(loaded)  # never printed
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(None, environ={ENV_VAR: "short"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(tmp_path / "missing")
    # Each use has its own key: an HTTP signature is no KV Hello MAC.
    assert written.key("http") != written.key("kv-hello") != written.key("reservation")
    assert AUTH_HEADER == "X-Pdserve-Auth"


# ---- calls bound to their target (issue 31 D3, issue 30 D2) ----------------------------------

DECODE_0 = call_target("decode-0", "a1a1a1a1")


@pytest.mark.parametrize(
    ("own", "sent", "error", "match"),
    [
        (DECODE_0, DECODE_0, None, ""),
        # Replayed to another worker: never valid there.
        (call_target("decode-1", "b2b2b2b2"), DECODE_0, Forbidden, "signed for worker decode-0"),
        # Sent to a later life of the same worker (restarted at its address): typed, retryable.
        (call_target("decode-0", "c3c3c3c3"), DECODE_0, StaleInstance, "earlier life"),
    ],
)
def test_a_call_lands_only_on_the_life_of_the_worker_it_was_signed_for(
    own: str, sent: str, error: type[Exception] | None, match: str
) -> None:
    verifier = CallVerifier(KEY, Clock(), window_s=60, target=own)
    header = sign_call(KEY, "POST", "/decode", b"{}", 1000.0, target=sent)
    if error is None:
        verifier.verify(header, "POST", "/decode", b"{}", sent)
        return
    with pytest.raises(error, match=match) as refused:
        verifier.verify(header, "POST", "/decode", b"{}", sent)
    assert getattr(refused.value, "retryable", False) is (error is StaleInstance)
    assert verifier.num_refused == 1 and verifier.num_remembered == 0


def test_the_target_cannot_be_stripped_or_swapped() -> None:
    verifier = CallVerifier(KEY, Clock(), window_s=60, target=DECODE_0)
    header = sign_call(KEY, "POST", "/decode", b"{}", 1000.0, target=DECODE_0)
    for sent in (None, call_target("decode-0", "other")):
        with pytest.raises(Forbidden, match="does not match"):
            verifier.verify(header, "POST", "/decode", b"{}", sent)
    # A call signed with no target (tooling) is still a call of the cluster.
    verifier.verify(
        sign_call(KEY, "GET", "/admin/faults", b"", 1000.0), "GET", "/admin/faults", b""
    )


def test_auth_headers_carry_the_target_they_sign() -> None:
    headers = auth_headers(KEY, "POST", "/prefill", b"{}", DECODE_0)
    assert headers[TARGET_HEADER] == DECODE_0
    verifier = CallVerifier(KEY, time.time, target=DECODE_0)
    verifier.verify(headers[AUTH_HEADER], "POST", "/prefill", b"{}", headers[TARGET_HEADER])
    assert TARGET_HEADER not in auth_headers(KEY, "POST", "/prefill", b"{}")
