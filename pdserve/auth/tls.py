"""Optional TLS for every plane: the router's API, the workers' HTTP and the KV TCP path.

`--tls-cert FILE --tls-key FILE` (PEM) make a process serve TLS; `--tls-ca FILE` makes it
mutual: a server then requires a client certificate signed by that CA, and as a client it
trusts only servers whose certificate that CA signed and presents its own. Give all three to
every cluster process (router and workers) and only holders of a CA-signed certificate can
call a worker or move KV; the router's OpenAI API takes the same certificate, and with a CA
requires clients to present one too.

Certificates are checked by their CA chain, not by host name (`check_hostname` off): cluster
processes are dialled by IP address from reservations and membership records, and a worker
restarted elsewhere keeps its certificate. Anyone holding a CA-signed certificate is a member,
as anyone holding the cluster secret is.

Under TLS the KV path is TCP only: NIXL (UCX) and shared memory carry no TLS, so a worker with
certificates neither serves nor uses them (`worker/kv/transports.py`), rather than sending KV
in the clear beside an encrypted control plane.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdserve.errors import ConfigError
from pdserve.settings import setting


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """This process's certificate, key and the cluster CA (PEM files); all None: plaintext."""

    cert: Path | None = setting(
        None,
        type=Path,
        metavar="FILE",
        help="the certificate chain this process serves and presents (PEM)",
    )
    key: Path | None = setting(
        None, type=Path, metavar="FILE", help="the certificate's private key (PEM)"
    )
    ca: Path | None = setting(
        None,
        type=Path,
        metavar="FILE",
        help="cluster CA (PEM): trust only what it signed, and require it of clients (mutual TLS)",
    )

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("tls-cert, tls-key: give both or neither")
        if self.ca is not None and self.cert is None:
            raise ConfigError("tls-ca: needs --tls-cert and --tls-key (mutual TLS)")
        for flag, path in (("tls-cert", self.cert), ("tls-key", self.key), ("tls-ca", self.ca)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag}: {path} is not a readable file")

    @property
    def enabled(self) -> bool:
        """Whether this process speaks TLS."""
        return self.cert is not None

    @property
    def scheme(self) -> str:
        """The scheme of this process's URL."""
        return "https" if self.enabled else "http"

    def args(self) -> list[str]:
        """The flags that give a child process this config (`pdserve up`)."""
        out: list[str] = []
        for flag, path in (
            ("--tls-cert", self.cert),
            ("--tls-key", self.key),
            ("--tls-ca", self.ca),
        ):
            if path is not None:
                out += [flag, str(path)]
        return out


def server_context(config: TLSConfig) -> ssl.SSLContext | None:
    """The context a server listens with (None without TLS); ConfigError naming the flag whose
    file does not load."""
    if config.cert is None or config.key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, config.cert, config.key)
    if config.ca is not None:
        _load_ca(context, config.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(config: TLSConfig) -> ssl.SSLContext | None:
    """The context a cluster process dials others with (None without TLS): it trusts the
    cluster CA (else the system's) and presents this process's certificate."""
    if config.cert is None or config.key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # By chain, not by name: see the module docstring.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    if config.ca is not None:
        _load_ca(context, config.ca)
    else:
        context.load_default_certs()
    _load_chain(context, config.cert, config.key)
    return context


def http_connector(context: ssl.SSLContext | None) -> aiohttp.TCPConnector | None:
    """An aiohttp connector dialling with `context` (None: aiohttp's default)."""
    return None if context is None else aiohttp.TCPConnector(ssl=context)


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path) -> None:
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"tls-cert, tls-key: {cert} and {key} do not load as a certificate and its key: {exc}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"tls-cert, tls-key: {exc}") from None


def _load_ca(context: ssl.SSLContext, ca: Path) -> None:
    try:
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"tls-ca: {ca} does not load as PEM certificates: {exc}") from None
