"""A local etcd as a supervised child: its command line and where it answers.

Used by `pdserve up --etcd` and the soak's cluster (etcd membership on one host). The data
folder and both ports are fixed at start, so a restarted etcd (the soak's nemesis kills it)
comes back with the same members' leases at the same address. The binary is Debian's
`etcd-server` (3.4); its absence is a LaunchError that says how to install it.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from pdserve.supervise.process import LaunchError
from pdserve.supervise.supervisor import ChildKind, ChildSpec

INSTALL_HINT = "etcd is not on PATH (Debian: apt-get install etcd-server)"


def etcd_binary() -> str:
    """The etcd executable; LaunchError naming the package when there is none."""
    found = shutil.which("etcd")
    if found is None:
        raise LaunchError(INSTALL_HINT)
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def etcd_spec(workdir: Path, host: str = "127.0.0.1", name: str = "etcd") -> ChildSpec:
    """A single-member etcd on `host` with free ports and a data folder under `workdir`."""
    binary = etcd_binary()
    client = f"http://{host}:{free_port(host)}"
    peer = f"http://{host}:{free_port(host)}"
    data = workdir / f"{name}-data"
    argv = [binary, "--name", name, "--data-dir", str(data)]
    argv += ["--listen-client-urls", client, "--advertise-client-urls", client]
    argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
    argv += ["--initial-cluster", f"{name}={peer}", "--logger", "zap", "--log-level", "warn"]
    return ChildSpec(name, ChildKind.ETCD, tuple(argv), command=True, health_url=client)


def discovery_uri(spec: ChildSpec, prefix: str = "/pdserve") -> str:
    """The `--discovery` value for the etcd `spec` starts."""
    assert spec.health_url is not None
    return "etcd://" + spec.health_url.removeprefix("http://") + prefix
