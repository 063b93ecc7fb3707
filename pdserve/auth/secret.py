"""Where the cluster secret comes from, and the keys derived from it.

Sources, first found wins: `--cluster-secret-file PATH` (the file's text, surrounding white
space stripped), then the environment variable `PDSERVE_CLUSTER_SECRET`. A secret shorter than
16 bytes is refused (ConfigError naming the source). `pdserve up` writes a fresh random secret
(256 bits, hex) into a 0600 file per cluster and hands it to its children through the
environment, never on a command line (`ps` would show it).

Each use gets its own key, derived by HMAC-SHA256 from the secret under a label, so a MAC made
for one purpose (an HTTP call) can never be replayed as another (a KV Hello).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import ConfigError
from pdserve.settings import Flag

ENV_VAR = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class ClusterSecret:
    """The shared secret of one cluster; `key(label)` is the key for one use."""

    raw: bytes
    # Where it came from ("file /path", "environment PDSERVE_CLUSTER_SECRET"), for messages.
    source: str

    def __post_init__(self) -> None:
        if len(self.raw) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"cluster secret from {self.source}: {len(self.raw)} bytes, need at least"
                f" {MIN_SECRET_BYTES}"
            )

    def key(self, label: str) -> bytes:
        """The 32-byte key for one use (e.g. "http", "kv-hello", "reservation")."""
        return hmac.new(self.raw, b"pdserve/" + label.encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:  # never print the secret itself
        return f"ClusterSecret(source={self.source!r})"


def load_secret(
    path: Path | None = None, environ: Mapping[str, str] | None = None
) -> ClusterSecret | None:
    """The configured secret, or None when neither the file nor the variable is given."""
    found = read_file_or_env(path, ENV_VAR, "cluster-secret-file", environ)
    return None if found is None else ClusterSecret(found[0].encode(), found[1])


def read_file_or_env(
    path: Path | None, env_var: str, flag: str, environ: Mapping[str, str] | None = None
) -> tuple[str, str] | None:
    """A credential's text (white space stripped) and where it came from ("file PATH",
    "environment VAR"): the file when `path` is given, else the variable; None if neither.
    An unreadable file is a ConfigError naming `flag`."""
    if path is not None:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{flag}: cannot read {path}: {exc}") from None
        return text.strip(), f"file {path}"
    value = (os.environ if environ is None else environ).get(env_var)
    return None if value is None else (value.strip(), f"environment {env_var}")


# `--cluster-secret-file PATH`, declared once for the router's and the worker's configs (each
# says in its help what the secret guards there). Not given: the environment's secret, if any.
SECRET_FILE = Flag(name="cluster-secret-file", type=Path, to_field=load_secret)


def require_secret(secret: ClusterSecret | None, insecure_no_auth: bool, advice: str) -> None:
    """ConfigError unless there is a secret or `--insecure-no-auth`; `advice` ends the message."""
    if secret is None and not insecure_no_auth:
        raise ConfigError(
            "cluster-secret-file: no cluster secret (give --cluster-secret-file PATH or set"
            f" {ENV_VAR}{advice})"
        )


def key_of(secret: ClusterSecret | None, label: str) -> bytes | None:
    """`secret.key(label)`, or None without a secret (--insecure-no-auth)."""
    return None if secret is None else secret.key(label)


class ClusterKeys:
    """The per-use keys of a config's `cluster_secret`, for the router's and the worker's
    configs alike (each is None under --insecure-no-auth)."""

    __slots__ = ()
    cluster_secret: ClusterSecret | None

    @property
    def http_key(self) -> bytes | None:
        """Key of the worker control calls' signatures."""
        return key_of(self.cluster_secret, "http")

    @property
    def reservation_key(self) -> bytes | None:
        """Key of the reservation signatures the router makes and prefill workers check."""
        return key_of(self.cluster_secret, "reservation")

    @property
    def membership_key(self) -> bytes | None:
        """Key of the MAC every etcd registration carries."""
        return key_of(self.cluster_secret, "membership")

    @property
    def kv_key(self) -> bytes | None:
        """Key of the KV Hello MACs."""
        return key_of(self.cluster_secret, "kv-hello")


def new_secret_text() -> str:
    """A fresh random secret (256 bits as hex)."""
    return secrets.token_hex(32)


def write_secret_file(path: Path, text: str | None = None) -> ClusterSecret:
    """Write a secret (a fresh one unless `text`) to `path`, readable by this user only."""
    text = text or new_secret_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return ClusterSecret(text.encode(), f"file {path}")
