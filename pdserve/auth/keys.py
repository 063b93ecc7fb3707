"""Bearer keys of the router's planes: inference (`/v1`), admin (`/admin`, `/debug`), metrics.

A key comes from a file (`--api-key-file PATH`: the file's text, surrounding white space
stripped) or else the environment (`PDSERVE_API_KEY`); never from a command line, where `ps`
and `/proc/PID/cmdline` show it to every user of the machine. `--api-key KEY` is refused with
a message naming both sources. A key is printable ASCII without spaces (it must travel in an
`Authorization: Bearer` header) and at least 8 characters.

The admin key is its own credential: a client holding the inference key cannot flip the mode
or read other clients' request timelines.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.auth.secret import read_file_or_env
from pdserve.errors import ConfigError
from pdserve.settings import Flag

MIN_KEY_CHARS = 8


class KeyKind(enum.Enum):
    """Which plane a key opens; the value is its environment variable."""

    API = "PDSERVE_API_KEY"
    ADMIN = "PDSERVE_ADMIN_KEY"
    METRICS = "PDSERVE_METRICS_KEY"

    @property
    def file_flag(self) -> str:
        """The flag naming its file: `--api-key-file`."""
        return f"--{self.name.lower()}-key-file"


@dataclass(frozen=True, slots=True)
class BearerKey:
    """One plane's key; `matches` checks an Authorization header in constant time."""

    text: str
    kind: KeyKind
    # Where it came from ("file /path", "environment PDSERVE_API_KEY"), for messages.
    source: str

    def __post_init__(self) -> None:
        if len(self.text) < MIN_KEY_CHARS:
            raise ConfigError(
                f"{self.kind.name.lower()} key from {self.source}: {len(self.text)} characters,"
                f" need at least {MIN_KEY_CHARS}"
            )
        if not (self.text.isascii() and self.text.isprintable()) or " " in self.text:
            raise ConfigError(
                f"{self.kind.name.lower()} key from {self.source}: printable ASCII without"
                " spaces only (it travels in an Authorization header)"
            )

    def matches(self, authorization: str | None) -> bool:
        """True when the header is `Bearer <this key>`; any text at all, never raises."""
        if authorization is None:
            return False
        # aiohttp hands undecodable header bytes over as lone surrogates: keep them as bytes.
        given = authorization.encode("utf-8", "surrogatepass")
        return hmac.compare_digest(given, f"Bearer {self.text}".encode())

    def __repr__(self) -> str:  # never print the key itself
        return f"BearerKey({self.kind.name}, source={self.source!r})"


def load_key(
    kind: KeyKind, path: Path | None = None, environ: Mapping[str, str] | None = None
) -> BearerKey | None:
    """The key of `kind` from `path`, else from its environment variable; None if neither."""
    found = read_file_or_env(path, kind.value, kind.file_flag[2:], environ)
    return None if found is None else BearerKey(found[0], kind, found[1])


def _file_flag(kind: KeyKind) -> Flag:
    return Flag(
        name=kind.file_flag[2:],
        type=Path,
        to_field=lambda path: load_key(kind, path),
        metavar="PATH",
        group="security",
    )


# Declared once, used by the router's config and by `pdserve up` (which hands the keys on).
API_KEY_FILE = _file_flag(KeyKind.API)
ADMIN_KEY_FILE = _file_flag(KeyKind.ADMIN)
METRICS_KEY_FILE = _file_flag(KeyKind.METRICS)


def refuse_keys_on_argv(argv: Sequence[str]) -> None:
    """ConfigError for `--api-key KEY` (or any `--*-key KEY`): a key on argv is a leaked key."""
    for arg in argv:
        name = arg.split("=", 1)[0]
        for kind in KeyKind:
            if name == kind.file_flag.removesuffix("-file"):
                raise ConfigError(
                    f"{name}: a key on the command line is visible to every user (ps,"
                    f" /proc/PID/cmdline); give {kind.file_flag} PATH or ${kind.value} instead"
                )


def key_environment(*keys: BearerKey | None) -> dict[str, str]:
    """The environment that hands `keys` to a child process (`pdserve up`'s routers)."""
    return {key.kind.value: key.text for key in keys if key is not None}
