"""Routers that agree: two routers follow the same workers' KV events (real processes).

One prefill worker and two `both` decode workers with small KV caches (24 blocks, so a few
long prompts evict everything older), and two routers over them. What a user of either router
sees: both routers hold the same prefix index as the worker's own cache; a conversation whose
next turn goes through the other router still lands on the worker holding its history (and
prefills only the suffix there); once that history is evicted, it no longer attracts the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from cluster_auth import HTTP_KEY, signed_headers
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

from pdserve.protocol.worker_observe import KVEventsRequest
from pdserve.router.placement.prefix_index import PrefixIndex
from pdserve.router.workers.client import ClientTimeouts, WorkerClient

MODEL = "tiny-v2"
BLOCK_BYTES = 64 * 1024  # one block of the tiny model, every layer
ROUTER_ARGS = ("--routing", "affinity", "--local-prefill-threshold", "64")


@dataclass(frozen=True, slots=True)
class Cluster:
    routers: tuple[str, str]
    prefill: WorkerHandle
    decodes: tuple[WorkerHandle, WorkerHandle]


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("kv-events")
    small = ("--kv-cache-bytes", str(24 * BLOCK_BYTES))
    with worker_processes() as handles:
        handles.append(launch_worker("prefill", workdir, model=tiny_model_path))
        for _ in range(2):
            handles.append(launch_worker("both", workdir, model=tiny_model_path, extra_args=small))
        for handle in handles:
            wait_ready(handle)
        urls = [h.url for h in handles]
        (workdir / "a").mkdir()
        (workdir / "b").mkdir()
        with (
            router_process(workdir / "a", tiny_model_path, urls, extra_args=ROUTER_ARGS) as a,
            router_process(workdir / "b", tiny_model_path, urls, extra_args=ROUTER_ARGS) as b,
        ):
            yield Cluster((a, b), handles[0], (handles[1], handles[2]))


def get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


def complete(router: str, prompt: list[int], session: str | None = None) -> str:
    """A greedy completion; returns the router's request id."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True, "user": session}
    req = urllib.request.Request(
        f"{router}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = json.loads(resp.read())
    assert len(data["choices"][0]["token_ids"]) == 8
    return str(data["id"])


def index_views(router: str) -> dict[str, dict[str, object]]:
    body = get(f"{router}/debug/kv_index")
    return {str(w["url"]): w for w in body["workers"]}  # type: ignore[attr-defined]


def worker_snapshot(url: str) -> dict[str, object]:
    """The worker's own cache, as the first line of its event stream, summarized like a router
    summarizes it."""

    async def first_line() -> dict[str, object]:
        async with aiohttp.ClientSession() as session:
            client = WorkerClient(session, ClientTimeouts(), key=HTTP_KEY)
            async with contextlib.aclosing(client.kv_events(url, KVEventsRequest())) as stream:
                batch = await anext(stream)
        assert batch.kind == "snapshot"
        index = PrefixIndex()
        index.apply(url, batch)
        return {"num_blocks": index.view(url).num_blocks, "digest": index.view(url).digest}

    return asyncio.run(first_line())


def wait_agreeing(cluster: Cluster, timeout_s: float = 10.0) -> dict[str, dict[str, object]]:
    """Both routers' views once they are fed and agree on every worker."""
    deadline = time.monotonic() + timeout_s
    while True:
        a, b = (index_views(r) for r in cluster.routers)
        fed = all(v["fed"] for v in (*a.values(), *b.values()))
        same = {u: (v["digest"], v["seq"]) for u, v in a.items()} == {
            u: (v["digest"], v["seq"]) for u, v in b.items()
        }
        if fed and same:
            return a
        assert time.monotonic() < deadline, f"routers disagree: {a} != {b}"
        time.sleep(0.1)


def wait_current(cluster: Cluster, timeout_s: float = 10.0) -> None:
    """Until both routers agree and their views are the decode workers' own caches (the
    events of the last evictions may still be on their way when the routers agree)."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = wait_agreeing(cluster, timeout_s)
        mine = {d.url: worker_snapshot(d.url)["digest"] for d in cluster.decodes}
        if all(views[url]["digest"] == digest for url, digest in mine.items()):
            return
        assert time.monotonic() < deadline, f"routers behind the workers: {views} vs {mine}"
        time.sleep(0.1)


def fill(worker: WorkerHandle, request_id: str, prompt: list[int]) -> None:
    """Run one prompt on `worker` itself (its own /generate, signed): 16 blocks into its cache."""
    body = json.dumps(
        {"request_id": request_id, "prompt_token_ids": prompt, "sampling": {"max_tokens": 1}}
    ).encode()
    request = urllib.request.Request(
        f"{worker.url}/generate", body, signed_headers("POST", "/generate", body)
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        lines = [json.loads(line) for line in resp.read().splitlines() if line]
    assert lines and lines[-1]["finished"], lines


def decode_of(router: str, request_id: str, cluster: Cluster) -> tuple[str, str]:
    """(the decode worker that served the request, its routing details) from the timeline."""
    history = get(f"{router}/debug/requests/{request_id}?workers=0")["history"]
    details = " ".join(str(t["detail"]) for t in history)  # type: ignore[attr-defined]
    served = [d.url for d in cluster.decodes if d.url in details]
    assert len(served) == 1, details
    return served[0], details


def test_both_routers_hold_each_workers_cache(cluster: Cluster) -> None:
    for i in range(4):
        complete(cluster.routers[i % 2], [100 + i] * 40 + list(range(200, 260)))
    views = wait_agreeing(cluster)
    mine = {w.url: worker_snapshot(w.url) for w in (cluster.prefill, *cluster.decodes)}
    for url, snapshot in mine.items():
        assert views[url]["num_blocks"] == snapshot["num_blocks"]
        assert views[url]["digest"] == snapshot["digest"]
    assert mine[cluster.prefill.url]["num_blocks"]
    assert any(mine[d.url]["num_blocks"] for d in cluster.decodes)


def test_a_session_keeps_its_worker_across_routers_until_its_blocks_are_evicted(
    cluster: Cluster,
) -> None:
    a, b = cluster.routers
    history = list(range(300, 428))  # 8 blocks
    first = complete(a, history, "chat-x")
    holder, _ = decode_of(a, first, cluster)
    wait_agreeing(cluster)
    # Router b never saw chat-x: the KV events tell it where the history is.
    turn = history + [7] * 16
    served, details = decode_of(b, complete(b, turn, "chat-x"), cluster)
    assert served == holder
    assert "holds the prefix, local prefill of the suffix" in details
    # Long unrelated prompts fill each decode worker's 24 blocks: the history is evicted. They
    # go to each worker directly: through a router, load ties could send them all to one.
    for d in cluster.decodes:
        for i in range(2):
            fill(d, f"fill-{i}", [500 + i] * 256)
    wait_current(cluster)
    served, details = decode_of(b, complete(b, turn + [9] * 16, "chat-y"), cluster)
    assert "holds the prefix" not in details
