"""GPU check step: one prefill and one decode worker on the one device, through the router.

Two processes as `pdserve up` starts them, on a KV-heavy checkpoint (megabyte blocks): greedy
text through the router equals the offline engine's, and the prefill worker's metrics give the
handoff's bytes, seconds and GB/s; the router's histograms give mean TTFT and TPOT, and the
handoff's cost (the transfer, and the gap from prefill's first token to decode's first, which
delays the second token: counted in TPOTs). Two processes on one GPU
time-slice its SMs: this proves correctness and the handoff's cost, not a goodput win from the
split.
"""

from __future__ import annotations

import argparse
import json
import random
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdlab.bench.kv_heavy_model import KVHeavyShape, build_kv_heavy_checkpoint
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import parse, total
from pdserve.supervise.launcher import Cluster, UpConfig


def scrape(url: str) -> list[Any]:
    """A worker's or router's /metrics, parsed."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


def completion_request(url: str, model: str, prompt: list[int], n: int) -> urllib.request.Request:
    """The router's /v1/completions call for `n` greedy tokens of `prompt`, with their ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )


def token_ids(resp: Any) -> list[int]:
    """The token ids of a completion's one choice."""
    return [int(t) for t in json.loads(resp.read())["choices"][0]["token_ids"]]


def complete(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    """Greedy token ids of `n` new tokens through the router's /v1/completions."""
    with urllib.request.urlopen(completion_request(url, model, prompt, n), timeout=300) as resp:
        return token_ids(resp)


def offline_tokens(path: Path, device: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens (`n` each, EOS ignored) of an in-process engine: what the cluster must give;
    the engine is freed before the cluster's workers take the device."""
    from pdserve.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    offline = LLM(str(path), device=device, kv_cache_bytes=1 << 30)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in offline.generate(prompts, params)]


@dataclass(frozen=True, slots=True)
class Workload:
    """What a cluster step sends and the answers it must get back."""

    shape: KVHeavyShape
    path: Path  # the KV-heavy checkpoint
    prompts: list[list[int]]
    want: list[list[int]]  # the offline engine's greedy tokens for each prompt
    n: int  # tokens asked per prompt


def workload(
    folder: Path, num_layers: int, sizes: tuple[int, int, int], seed: int, device: str
) -> Workload:
    """A KV-heavy checkpoint of `num_layers` in `folder`; `sizes` = (prompts, tokens each,
    tokens asked), the prompts drawn from `seed`, and their offline greedy answers."""
    shape = KVHeavyShape(num_layers=num_layers)
    path = build_kv_heavy_checkpoint(folder, shape)
    count, length, n = sizes
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(count)]
    return Workload(shape, path, prompts, offline_tokens(path, device, prompts, n), n)


def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy text through a one-GPU split cluster against the offline engine's."""
    sizes = (2, 64, 4) if args.quick else (6, 1024, 16)
    load = workload(workdir / "kv-heavy", 2 if args.quick else 16, sizes, 1, args.device)
    shape, path, prompts, want, n = load.shape, load.path, load.prompts, load.want, load.n
    count, length = len(prompts), sizes[1]
    up = UpConfig(
        num_prefill=1,
        num_decode=1,
        mode="disagg",
        model=str(path),
        port=0,
        router_args=("--local-prefill-threshold", "0", "--no-breaker"),
        worker_args=("--device", args.device, "--kv-cache-bytes", str(2 << 30)),
        state_file=workdir / "cluster.json",
    )
    cluster = Cluster(up)
    try:
        url = cluster.start()
        names = cluster.supervisor.names()
        prefill = next(cluster.supervisor.url(x) for x in names if x.startswith("prefill"))
        decode = next(cluster.supervisor.url(x) for x in names if x.startswith("decode"))
        got = [complete(url, path.name, p, n) for p in prompts]
        sent = scrape(str(prefill))
        received = scrape(str(decode))
        routed = scrape(url)
    finally:
        cluster.stop()
    # The split's cost, from the router's own histograms. The prefill worker sends the first
    # token, so TTFT holds no transfer; the handoff delays the second token instead: the gap
    # from the prefill's first token to the decode worker's first (it holds the transfer),
    # counted in decode steps (TPOT).
    phases = {
        "ttft": m.ROUTER_TTFT,
        "tpot": m.ROUTER_TPOT,
        "transfer": m.ROUTER_TRANSFER,
        "handoff_gap": m.ROUTER_HANDOFF_GAP,
    }
    mean_s = {
        k: total(routed, spec.name + "_sum") / max(1.0, total(routed, spec.name + "_count"))
        for k, spec in phases.items()
    }
    seconds = total(sent, m.WORKER_KV_SEND_SECONDS.name + "_sum")
    num_bytes = total(sent, m.WORKER_KV_SEND_BYTES.name + "_sum")
    handoffs = total(sent, m.WORKER_KV_SEND_SECONDS.name + "_count")
    # Which path the KV took: through each side's host mirror (a GPU worker today, counted)
    # or straight from the cache's own memory (the CPU).
    staged = m.WORKER_KV_HOST_STAGED_BYTES.name
    host_staged = {
        "out": total(sent, staged, direction="out"),
        "in": total(received, staged, direction="in"),
    }
    kv_path = "host mirror" if any(host_staged.values()) else "cache memory"
    rate = num_bytes / seconds / 1e9 if seconds else None
    gap = mean_s["handoff_gap"] / mean_s["tpot"] if mean_s["tpot"] else None
    print(
        f"split on one {args.device}: tokens identical {'yes' if got == want else 'NO'};"
        f" {handoffs:.0f} handoffs of {num_bytes / max(1.0, handoffs) / 2**20:.1f} MiB"
        f" at {rate or 0:.2f} GB/s via the {kv_path};"
        f" TTFT {mean_s['ttft'] * 1e3:.1f} ms, TPOT {mean_s['tpot'] * 1e3:.2f} ms,"
        f" handoff gap {gap or 0:.1f} TPOTs",
        flush=True,
    )
    return {
        "requests": count,
        "prompt_tokens": length,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "tokens_identical": got == want,
        "handoffs": handoffs,
        "kv_bytes": num_bytes,
        "send_seconds": seconds,
        "handoff_gb_per_s": rate,
        "host_staged_bytes": host_staged,
        "kv_path": kv_path,
        "mean_ttft_s": mean_s["ttft"],
        "mean_tpot_s": mean_s["tpot"],
        "mean_transfer_s": mean_s["transfer"],
        "mean_handoff_gap_s": mean_s["handoff_gap"],
        "handoff_gap_in_tpots": gap,
        "passed": got == want and handoffs == count,
    }
