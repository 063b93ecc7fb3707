"""Decode checkpoints, bad input, with real worker processes: a checkpoint whose version,
chain or fingerprint does not match is refused and counted, and a resume whose checkpoint is
refused or missing falls back to recomputation with the same tokens."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_auth import signed_headers
from worker_proc import WorkerHandle, launch_worker, wait_ready, worker_processes

from pdserve.observability.exposition import parse

GREEDY = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
PROMPT = list(range(5, 75))  # 70 tokens: four full blocks of 16, and a part


@pytest.fixture(scope="module")
def trio(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerHandle, WorkerHandle, WorkerHandle]]:
    """Two decode workers of one fingerprint (D resumes, H holds) and X, whose KV blocks are
    twice as large (another fingerprint)."""
    workdir = tmp_path_factory.mktemp("checkpoints")
    with worker_processes() as handles:
        for extra in ([], [], ["--block-size", "32"]):
            handles.append(
                launch_worker("decode", workdir, model=tiny_model_path, extra_args=extra)
            )
        for handle in handles:
            wait_ready(handle)
        yield handles[0], handles[1], handles[2]


def post(url: str, body: object) -> tuple[int, bytes]:
    raw = json.dumps(body).encode()
    path = urllib.request.Request(url).selector
    req = urllib.request.Request(url, raw, signed_headers("POST", path, raw))
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def generate(url: str, rid: str, output: list[int], **extra: object) -> list[int]:
    """The tokens a /generate stream returns after `output`."""
    body = {"request_id": rid, "prompt_token_ids": PROMPT, "sampling": GREEDY,
            "output_token_ids": output, **extra}  # fmt: skip
    status, raw = post(f"{url}/generate", body)
    assert status == 200, raw
    tokens: list[int] = []
    for line in raw.splitlines():
        event = json.loads(line)
        assert event.get("error") is None, event
        tokens += event["token_ids"]
    return tokens


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        samples = parse(resp.read().decode())
    out: dict[str, float] = {}
    for s in samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels) if k != "worker_id")
        out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_puts_with_a_bad_version_chain_or_fingerprint_are_refused_and_counted(
    trio: tuple[WorkerHandle, WorkerHandle, WorkerHandle],
) -> None:
    _, holder, _ = trio
    fingerprint = str(holder.health["fingerprint_digest"])
    block = list(range(16))
    before = metrics(holder.url)
    cases = [
        ({"first_version": 17}, "version"),  # not a whole number of blocks
        ({"first_version": 32, "parent_hash": 12345}, "chain"),  # a parent never held
        ({"fingerprint_digest": "0" * 16}, "fingerprint"),  # KV of another engine
    ]
    for change, reason in cases:
        body = {"owner": f"bad-{reason}", "fingerprint_digest": fingerprint, "parent_hash": 0,
                "first_version": 16, "block_tokens": [block], **change}  # fmt: skip
        status, raw = post(f"{holder.url}/checkpoint/put", body)
        assert (status, json.loads(raw)["type"]) == (409, "CheckpointRefused"), raw
    after = metrics(holder.url)
    for _, reason in cases:
        key = f"pdserve_worker_checkpoint_refusals_total{{reason={reason}}}"
        assert after[key] - before.get(key, 0) == 1, reason
    assert after["pdserve_worker_checkpoint_held_bytes"] == 0  # nothing reserved or held


def test_a_resume_whose_checkpoint_is_refused_or_missing_recomputes_the_same_tokens(
    trio: tuple[WorkerHandle, WorkerHandle, WorkerHandle],
) -> None:
    decode, holder, other = trio
    reference = generate(holder.url, "reference", [])
    sent = reference[:20]
    before = metrics(decode.url)
    # X computes KV of another layout: its lookup refuses by fingerprint; D recomputes all.
    refused = generate(
        decode.url, "resume-refused", sent, checkpoint_from={"holder_url": other.url}
    )
    # H's tier holds nothing for these tokens; D's own prefix cache now has them (nearest
    # cache first: nothing travels, the last partial block and a token are recomputed).
    missing = generate(
        decode.url, "resume-missing", sent, checkpoint_from={"holder_url": holder.url}
    )
    assert refused == missing == reference[20:]
    after = metrics(decode.url)
    resumes = "pdserve_worker_checkpoint_resumes_total"
    for path, reason in (("recompute", "refused"), ("local", "none_held")):
        key = f"{resumes}{{path={path},reason={reason}}}"
        assert after[key] - before.get(key, 0) == 1, reason
    recomputed = "pdserve_worker_checkpoint_recomputed_tokens_total"
    num_tokens = len(PROMPT) + len(sent)  # 90: five full blocks and 10 tokens
    assert after[recomputed] - before.get(recomputed, 0) == num_tokens + (num_tokens - 5 * 16)
    assert after["pdserve_worker_checkpoint_pulled_bytes_total"] == 0
    assert metrics(other.url)["pdserve_worker_checkpoint_refusals_total{reason=fingerprint}"] >= 1
