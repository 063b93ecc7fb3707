"""How the operator commands (`status`, `top`, `trace`, `drain`) dial a cluster under TLS.

With `--tls-cert/--tls-key/--tls-ca` they present that certificate and trust that CA; without
them, the files the running `pdserve up` recorded in its state file (it serves with them);
with neither, plain HTTP and the system's CAs. The choice is installed as urllib's opener for
the command's process, so every call the command makes (the router, then each worker's
/health) dials the same way.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from pdserve.auth.tls import TLSConfig, client_context
from pdserve.errors import ConfigError
from pdserve.settings import add_fields, build
from pdserve.supervise.launcher import default_state_file


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The `--tls-*` flags, declared once in `TLSConfig`."""
    group = parser.add_argument_group("TLS (default: the running `pdserve up`'s files)")
    add_fields(group, TLSConfig, prefix="tls-")


def recorded_tls(state_file: Path) -> TLSConfig:
    """The TLS files a `pdserve up` recorded (plaintext when none, or no state file)."""
    try:
        files = json.loads(state_file.read_text()).get("tls") or {}
    except (OSError, ValueError, AttributeError):
        return TLSConfig()
    try:
        return TLSConfig(**{k: Path(v) for k, v in files.items() if k in ("cert", "key", "ca")})
    except ConfigError as exc:
        raise ConfigError(f"{state_file}: its recorded TLS files: {exc}") from None


def dial_with_tls(args: argparse.Namespace, state_file: Path | None = None) -> None:
    """Make this process's urllib calls dial with the flags' TLS, else the one recorded in
    `state_file` (default: the running `pdserve up`'s)."""
    given = build(TLSConfig, args, prefix="tls-")
    config = given if given.enabled else recorded_tls(state_file or default_state_file())
    context = client_context(config)
    if context is not None:
        handler = urllib.request.HTTPSHandler(context=context)
        urllib.request.install_opener(urllib.request.build_opener(handler))
