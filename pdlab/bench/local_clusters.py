"""Local clusters for benchmarks that compare configurations side by side: one `pdserve up`-
style cluster per name, started together and all stopped (by PID) however the run ends."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.supervise.launcher import Cluster, UpConfig


@dataclass(frozen=True, slots=True)
class Endpoints:
    """One running cluster: its routers' URLs, the model name it serves, its workers' URLs."""

    routers: list[str]
    model: str
    workers: list[str]


@contextmanager
def local_clusters(configs: Mapping[str, UpConfig]) -> Iterator[dict[str, Endpoints]]:
    """Start a cluster per name; yield their endpoints; stop every one at the end."""
    started: list[Cluster] = []
    try:
        endpoints = {}
        for name, config in configs.items():
            cluster = Cluster(config)
            started.append(cluster)
            router = cluster.start()
            with urllib.request.urlopen(f"{router}/v1/models", timeout=10) as resp:
                model = str(json.loads(resp.read())["data"][0]["id"])
            endpoints[name] = Endpoints(list(cluster.router_urls), model, list(cluster.worker_urls))
        yield endpoints
    finally:
        for cluster in started:
            cluster.stop()
