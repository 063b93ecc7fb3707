"""The planes' bearer keys: from a file or the environment only, checked in constant time, any
header text answered without raising, never printed."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_support import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from pdserve.auth.keys import BearerKey, KeyKind, key_environment, load_key, refuse_keys_on_argv
from pdserve.errors import ConfigError

KEY = "s3cret-key-0123"


def test_a_file_wins_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "admin-key"
    path.write_text(f"  {KEY}\n")
    environ = {"PDSERVE_ADMIN_KEY": "other-key-456"}
    key = load_key(KeyKind.ADMIN, path, environ)
    assert key is not None and (key.text, key.source) == (KEY, f"file {path}")
    key = load_key(KeyKind.ADMIN, None, environ)
    assert key is not None and key.source == "environment PDSERVE_ADMIN_KEY"
    assert load_key(KeyKind.API, None, environ) is None


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("short", "5 characters, need at least 8"),
        ("has a space", "printable ASCII without spaces"),
        ("clé-non-ascii", "printable ASCII without spaces"),
        ("tab\tinside-key", "printable ASCII without spaces"),
    ],
)
def test_a_key_that_cannot_travel_in_a_header_is_refused_naming_its_source(
    text: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=f"api key from environment PDSERVE_API_KEY: .*{says}"):
        load_key(KeyKind.API, None, {"PDSERVE_API_KEY": text})


def test_an_unreadable_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="metrics-key-file: cannot read"):
        load_key(KeyKind.METRICS, tmp_path / "missing")


def test_only_the_exact_bearer_header_matches() -> None:
    key = BearerKey(KEY, KeyKind.API, "test")
    assert key.matches(f"Bearer {KEY}")
    for other in (None, "", KEY, f"bearer {KEY}", f"Bearer {KEY} ", f"Bearer {KEY}x"):
        assert not key.matches(other)


@fuzz_settings(300)
@given(st.text())
def test_any_header_text_is_answered_without_raising(text: str) -> None:
    """Lone surrogates (aiohttp's rendering of undecodable bytes) and non-ASCII included."""
    key = BearerKey(KEY, KeyKind.ADMIN, "test")
    assert key.matches(text) == (text == f"Bearer {KEY}")


@pytest.mark.parametrize("argv", [["--api-key", KEY], [f"--admin-key={KEY}"], ["--metrics-key"]])
def test_a_key_on_the_command_line_is_refused_with_the_sources_to_use(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"visible to every user .* give --\w+-key-file PATH"):
        refuse_keys_on_argv(["--port", "0", *argv])


def test_key_files_on_the_command_line_are_fine() -> None:
    refuse_keys_on_argv(["--api-key-file", "/run/secrets/api", "--admin-key-file=/k"])


def test_the_key_never_shows_in_its_repr_and_travels_by_environment() -> None:
    api, admin = BearerKey(KEY, KeyKind.API, "test"), BearerKey("admin-key-789", KeyKind.ADMIN, "t")
    assert KEY not in repr(api) and KEY not in str(api)
    assert key_environment(api, None, admin) == {
        "PDSERVE_API_KEY": KEY,
        "PDSERVE_ADMIN_KEY": "admin-key-789",
    }
