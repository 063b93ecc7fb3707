"""The steady-state cost of decode checkpoints: TPOT with them on vs off, at the same load.

One local cluster (one prefill, two decode workers) and two routers over the same workers: one
with `--checkpoint off`, one with `--checkpoint every-N` for each N asked. Rounds alternate the
routers (off, on, off, on, ..., the first rotating each round) so all see the same workers and
machine noise; each round sends `--concurrency` streamed greedy completions at once (prompt
`--prompt-tokens` random ids of its own, never shared with another policy's round: a prompt
cached by one policy would spare the next its prefill and change its decode batching;
`--max-tokens` each). TPOT per request is (last token - first token) / (tokens - 1) at the
client; the figure per policy is the median over its requests. Prints a table; `--json FILE`
writes every figure and the ratio on/off (the target: at most 1.05).

`--model-shape midsize` runs a ~100M-parameter random Llama-layout checkpoint written by
transformers' `save_pretrained` (8 layers, hidden 1024, 16 heads of 64: 64 KiB of KV per token,
1 MiB per block) instead of the 4M-parameter tiny model, so a decode step costs what a
compute-bound step costs rather than mostly Python.

    .venv/bin/python benchmarks/checkpoint_tpot.py [--json tpot.json] [--rounds 4]
        [--model-shape tiny|midsize]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from pdlab.bench.kv_heavy_model import KVHeavyShape, build_kv_heavy_checkpoint
from pdlab.chaos.cluster import ChaosCluster
from pdlab.chaos.scenarios import WorkerSpec
from pdserve.advise.client import stream_completion
from pdserve.auth.secret import ENV_VAR
from pdserve.observability.exposition import parse as parse_exposition
from pdserve.supervise.process import (
    Child,
    exit_on_sigterm,
    spawn_child,
    stop_children,
    wait_child_ready,
)

# A compute-bound decode step on this CPU (~100M parameters), KV of a small real model.
MIDSIZE = KVHeavyShape(
    num_layers=8,
    num_kv_heads=16,
    head_dim=64,
    hidden_size=1024,
    intermediate_size=2816,
    max_position_embeddings=4096,
)
WORKERS = (
    WorkerSpec("prefill-0", "prefill"),
    WorkerSpec("decode-0", "decode"),
    WorkerSpec("decode-1", "decode"),
)


def start_router(
    cluster: ChaosCluster, policy: str, workdir: Path, model: str | None = None
) -> Child:
    """Another router over the cluster's workers, with `--checkpoint policy`."""
    args = ["pdserve.router.main", "--host", "127.0.0.1", "--port", "0", "--checkpoint", policy]
    if model is not None:
        args += ["--model", model]
    args += ["--local-prefill-threshold", "0"]
    for name in cluster.workers:
        args += ["--worker", cluster.url(name)]
    child = spawn_child(
        f"router-{policy}-{time.monotonic_ns()}", args, workdir, env={ENV_VAR: cluster.secret}
    )
    child.url = wait_child_ready(child, time.monotonic() + 60)
    return child


async def one_round(
    url: str, model: str, concurrency: int, prompt_tokens: int, max_tokens: int, seed: int
) -> list[float]:
    """TPOTs (seconds) of `concurrency` requests sent at once."""
    rng = random.Random(seed)
    times: dict[int, list[float]] = {i: [] for i in range(concurrency)}

    def recorder(i: int):  # type: ignore[no-untyped-def]
        async def on_tokens(num_tokens: int) -> None:
            times[i].append(time.monotonic())

        return on_tokens

    async with aiohttp.ClientSession() as session:
        bodies = [
            {"model": model, "prompt": [rng.randrange(3, 2000) for _ in range(prompt_tokens)],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            for _ in range(concurrency)
        ]  # fmt: skip
        done = await asyncio.gather(
            *(stream_completion(session, url, b, recorder(i)) for i, b in enumerate(bodies))
        )
    tpots = []
    for i, completion in enumerate(done):
        if completion.error is not None:
            raise RuntimeError(f"request failed: {completion.error}")
        stamps = times[i]
        n = len(completion.token_ids)
        tpots.append((stamps[-1] - stamps[0]) / max(n - 1, 1))
    return tpots


def put_counters(urls: list[str]) -> dict[str, float]:
    """Checkpoint puts by path, blocks put and replica failures, summed over `urls`."""
    wanted = {
        "pdserve_worker_checkpoint_puts_total": "path",
        "pdserve_worker_checkpoint_put_blocks_total": None,
        "pdserve_worker_checkpoint_stream_failures_total": "error",
    }
    out: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            samples = parse_exposition(resp.read().decode())
        for sample in samples:
            if sample.name not in wanted:
                continue
            label = wanted[sample.name]
            short = sample.name.removeprefix("pdserve_worker_checkpoint_").removesuffix("_total")
            key = f"{short}:{sample.label(label)}" if label else short
            out[key] = out.get(key, 0.0) + sample.value
    return out


def main() -> int:
    exit_on_sigterm()  # a SIGTERM stops the clusters it started (their finally blocks)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--policies", default="off,every-1,every-4")
    parser.add_argument(
        "--kv-transport", default="auto", help="the workers' --kv-transport (auto, tcp, ...)"
    )
    parser.add_argument("--model-shape", choices=("tiny", "midsize"), default="tiny")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="one more worker flag (repeatable; e.g. --worker-arg=--checkpoint-small-put-kib=0)",
    )
    args = parser.parse_args()
    # "off" first (the cluster's own router); a second "off" measures the noise floor.
    policies = ["off", *(f"{p}#{i}" for i, p in enumerate(args.policies.split(","), 1))]
    with tempfile.TemporaryDirectory(prefix="pdserve-ckpt-tpot-") as tmp:
        workdir = Path(tmp)
        workers = tuple(
            WorkerSpec(w.name, w.role, ("--kv-transport", args.kv_transport, *args.worker_arg))
            for w in WORKERS
        )
        model_path = None
        if args.model_shape == "midsize":
            model_path = str(build_kv_heavy_checkpoint(workdir / "midsize", MIDSIZE))
        cluster = ChaosCluster(workers, ("--checkpoint", "off"), workdir, model=model_path)
        routers: list[Child] = []
        results: dict[str, list[float]] = {p: [] for p in policies}
        try:
            cluster.start()
            urls = {"off": cluster.router_url}
            for policy in policies[1:]:
                routers.append(start_router(cluster, policy.split("#")[0], workdir, model_path))
                urls[policy] = routers[-1].url or ""
            model = cluster.model_name
            # Warm-up: every path once.
            for policy in policies:
                asyncio.run(one_round(urls[policy], model, 1, 64, 16, seed=999))
            for r in range(args.rounds):
                # Rotate which policy goes first, so none always follows another's tail.
                shift = r % len(policies)
                for i, policy in enumerate(policies[shift:] + policies[:shift]):
                    results[policy] += asyncio.run(
                        one_round(
                            urls[policy],
                            model,
                            args.concurrency,
                            args.prompt_tokens,
                            args.max_tokens,
                            # Fresh prompts for every policy and round: no policy may find
                            # another's prompts in the prefill worker's cache (a warm cache
                            # on one side only), and every one computes its own prefills.
                            seed=r * len(policies) + i,
                        )
                    )
            # What the checkpoints did, summed over the decode workers: a cheap policy that
            # stopped replicating after a failure would look cheap for the wrong reason.
            puts = put_counters([cluster.url(w.name) for w in WORKERS if w.role == "decode"])
        finally:
            stop_children(routers)
            cluster.stop()
    base = statistics.median(results["off"])
    report: dict[str, object] = {
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "kv_transport": args.kv_transport,
        "worker_args": args.worker_arg,
        "model_shape": args.model_shape,
        "checkpoint_counters": puts,
        "policies": {},
    }
    print(f"{'checkpoint':<12} {'TPOT p50 ms':>12} {'p90 ms':>8} {'vs off':>8}")
    for policy in policies:
        values = sorted(results[policy])
        p50, p90 = statistics.median(values), values[int(0.9 * (len(values) - 1))]
        ratio = p50 / base
        report["policies"][policy] = {  # type: ignore[index]
            "tpot_p50_s": p50,
            "tpot_p90_s": p90,
            "tpot_p50_over_off": ratio,
            "num_requests": len(values),
        }
        print(f"{policy:<12} {p50 * 1e3:>12.2f} {p90 * 1e3:>8.2f} {ratio:>8.3f}")
    print("checkpoint counters (decode workers):", ", ".join(f"{k}={v:g}" for k, v in puts.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
