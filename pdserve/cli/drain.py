"""`pdserve drain URL`: ask a worker to drain (finish what it holds, take nothing new) and exit.

The call is `POST /admin/drain`, signed with the cluster secret (`--cluster-secret-file` or
`$PDSERVE_CLUSTER_SECRET`), as every worker control call is. With `--wait` the command returns
once the worker has exited (its URL stops answering) or `--timeout-s` passed: the shape of a
Kubernetes `preStop` hook, which holds SIGTERM back until the drain is done.
"""

from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pdserve.auth.secret import load_secret
from pdserve.auth.signing import auth_headers
from pdserve.cli.command import run
from pdserve.cli.dial import add_tls_flags, dial_with_tls
from pdserve.errors import ConfigError
from pdserve.flag_types import positive_float

PATH = "/admin/drain"


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    d = argparse.ArgumentParser(prog="pdserve drain", description=__doc__.splitlines()[0])
    d.add_argument("url", help="the worker's base URL, e.g. http://127.0.0.1:8100")
    d.add_argument("--wait", action="store_true", help="return once the worker has exited")
    d.add_argument("--timeout-s", type=positive_float, default=60.0, help="longest --wait")
    d.add_argument("--cluster-secret-file", type=Path, default=None, metavar="PATH",
                   help="the cluster secret (else $PDSERVE_CLUSTER_SECRET)")  # fmt: skip
    add_tls_flags(d)
    return d


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def _drain(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    dial_with_tls(args)
    secret = load_secret(args.cluster_secret_file)
    if secret is None:
        raise ConfigError(
            "cluster-secret-file: no cluster secret (give --cluster-secret-file PATH or set"
            " PDSERVE_CLUSTER_SECRET): worker calls are signed"
        )
    headers = auth_headers(secret.key("http"), "POST", PATH, b"")
    request = urllib.request.Request(url + PATH, data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            print(f"pdserve drain: {url}: {resp.read().decode().strip()}")
    except urllib.error.HTTPError as exc:
        print(f"pdserve drain: {url} refused: HTTP {exc.code} {exc.read().decode()[:300]}")
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"pdserve drain: {url} did not answer: {exc}")
        return 1
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout_s
    while _answers(url):
        if time.monotonic() > deadline:
            print(f"pdserve drain: {url} still running after {args.timeout_s:g} s")
            return 1
        time.sleep(0.2)
    print(f"pdserve drain: {url} drained and exited")
    return 0


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    return run("drain", build_parser(), _drain, argv)
