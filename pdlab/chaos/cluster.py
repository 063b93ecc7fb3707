"""The local cluster of one chaos scenario: named workers and a router, started and stopped by PID.

Workers run with `--enable-fault-admin` (so a plan can be posted once the cluster is warm) and a
short per-chunk deadline; the router with short leases and a request deadline. Processes are
started with `pdserve.supervise.launcher`'s helpers (own session, ready file, /health) and always stopped
by PID: SIGTERM, then SIGKILL after a grace period. A worker a scenario killed stays dead.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pdlab.chaos.scenarios import (
    CHUNK_TIMEOUT_S,
    LEASE_TTL_S,
    REQUEST_TIMEOUT_S,
    WorkerSpec,
)
from pdserve.auth.secret import ENV_VAR, ClusterSecret, new_secret_text
from pdserve.auth.signing import auth_headers
from pdserve.supervise.process import (
    Child,
    spawn_child,
    stop_children,
    wait_child_ready,
    worker_threads,
)


def http_json(
    url: str, body: object | None = None, timeout_s: float = 5.0, key: bytes | None = None
) -> dict[str, object]:
    """GET (or POST `body` as JSON to) `url` and decode the JSON answer; signed with `key`
    (the cluster's "http" key) when given, as a worker's control calls must be."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    method = "GET" if data is None else "POST"
    headers.update(auth_headers(key, method, urllib.parse.urlsplit(url).path, data or b""))
    request = urllib.request.Request(url, data, headers, method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        answer: dict[str, object] = json.loads(resp.read())
        return answer


class ChaosCluster:
    """Workers by name plus a router, on loopback, for one scenario."""

    def __init__(
        self,
        workers: tuple[WorkerSpec, ...],
        router_args: tuple[str, ...],
        workdir: Path,
        model: str | None = None,
        startup_timeout_s: float = 180.0,
    ) -> None:
        self.specs = workers
        self.workdir = workdir
        self._router_args = router_args
        self._model = model
        self._startup_timeout_s = startup_timeout_s
        self.workers: dict[str, Child] = {}
        self.router: Child | None = None
        # The cluster's secret (the caller's PDSERVE_CLUSTER_SECRET if set, else a fresh one).
        self.secret = os.environ.get(ENV_VAR) or new_secret_text()
        self.http_key = ClusterSecret(self.secret.encode(), "chaos cluster").key("http")
        # The `model` clients name (the router's), known once it runs.
        self.model_name = ""

    def start(self) -> str:
        """Start every worker, then the router; returns the router URL."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self._startup_timeout_s
        model = ["--model", self._model] if self._model else []
        for spec in self.specs:
            args = ["pdserve.worker.main", "--role", spec.role, "--host", "127.0.0.1"]
            args += ["--port", "0", "--kv-port", "0", "--worker-id", spec.name, *model]
            args += ["--enable-fault-admin", "--transfer-chunk-timeout-s", str(CHUNK_TIMEOUT_S)]
            self.workers[spec.name] = spawn_child(
                spec.name,
                [*args, *spec.args],
                self.workdir,
                worker_threads(len(self.specs)),
                env={ENV_VAR: self.secret},
            )
        for child in self.workers.values():
            child.url = wait_child_ready(child, deadline)
        args = ["pdserve.router.main", "--host", "127.0.0.1", "--port", "0", *model]
        args += ["--lease-ttl-s", str(LEASE_TTL_S), "--request-timeout-s", str(REQUEST_TIMEOUT_S)]
        # Every request takes the prefill → transfer → decode path, even with its prefix warm
        # on a decode worker: the faults under test live on that path.
        args += ["--local-prefill-threshold", "0"]
        for child in self.workers.values():
            args += ["--worker", child.url or ""]
        self.router = spawn_child(
            "router", [*args, *self._router_args], self.workdir, env={ENV_VAR: self.secret}
        )
        self.router.url = wait_child_ready(self.router, deadline)
        self.model_name = str(http_json(f"{self.router.url}/health")["model"])
        return self.router.url

    @property
    def router_url(self) -> str:
        """The router's base URL (after `start`)."""
        assert self.router is not None and self.router.url is not None
        return self.router.url

    def url(self, name: str) -> str:
        """A worker's base URL."""
        url = self.workers[name].url
        assert url is not None
        return url

    def alive(self, name: str) -> bool:
        """Whether the worker's process still runs."""
        return self.workers[name].proc.poll() is None

    def router_alive(self) -> bool:
        """Whether the router's process still runs."""
        return self.router is not None and self.router.proc.poll() is None

    def dead_workers(self) -> list[str]:
        """Names of workers whose process has exited."""
        return [name for name in self.workers if not self.alive(name)]

    def kill(self, name: str) -> None:
        """SIGKILL the worker by PID and reap it."""
        child = self.workers[name]
        if child.proc.poll() is None:
            os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.wait(10)

    def health(self, name: str) -> dict[str, object]:
        """A worker's GET /health."""
        return http_json(f"{self.url(name)}/health")

    def set_faults(self, name: str, rules: tuple[str, ...], seed: int = 0) -> None:
        """Replace a worker's fault plan (POST /admin/faults)."""
        body = {"rules": list(rules), "seed": seed}
        http_json(f"{self.url(name)}/admin/faults", body, key=self.http_key)

    def injected(self) -> list[str]:
        """Every fault the live workers report having fired, as "worker: site#hit action"."""
        found: list[str] = []
        for name in self.workers:
            if not self.alive(name):
                continue
            try:
                state = http_json(f"{self.url(name)}/admin/faults", key=self.http_key)
            except (OSError, urllib.error.URLError):
                continue
            for item in state.get("injected", []):  # type: ignore[attr-defined]
                found.append(f"{name}: {item['site']}#{item['hit']} {item['action']}")
        return found

    def log_tail(self, name: str, num_bytes: int = 4000) -> str:
        """The end of a process's log, for error reports."""
        path = self.workdir / f"{name}.log"
        return path.read_bytes()[-num_bytes:].decode(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop the router, then every worker, by PID."""
        children = [*self.workers.values()]
        if self.router is not None:
            children.insert(0, self.router)
        stop_children(children)
