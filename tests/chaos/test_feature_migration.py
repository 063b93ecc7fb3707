"""A decode worker SIGKILLed mid-stream while serving requests that use logprobs, penalties,
min_tokens, logit_bias, echo (completion and chat), n > 1, structured output, logprob tokens
named by id (`return_tokens_as_token_ids`) and a forced tool call: the migrated
stream's text, tool call and logprobs equal the fault-free run's bit for bit, and JSON or a
call's arguments cut mid-object by the kill are still the same valid JSON (the grammar state
is rebuilt from the tokens, and the sampler keeps the request's seed)."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai_cases import check_valid, run_case
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes


@pytest.fixture(scope="module")
def cluster(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """One prefill worker and a `both` worker per case and one more: each case kills one."""
    workdir = tmp_path_factory.mktemp("feature-migration")
    with worker_processes() as handles:
        for role in ("prefill", *["both"] * (len(KILL_AT) + 1)):
            handles.append(launch_worker(role, workdir, model=tiny_model_path,
                                         extra_args=("--kv-cache-bytes", str(32 << 20), "--batch-invariant")))  # fmt: skip
        for handle in handles:
            wait_ready(handle)
        args = ["--local-prefill-threshold", "0"]
        with router_process(
            workdir, tiny_model_path, [h.url for h in handles], extra_args=args
        ) as url:
            yield url, handles


def health(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


def migrations(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("pdserve_router_migrations_total"))
    return float(line.rsplit(" ", 1)[1])


# The chunk after which the decode worker dies: ~5 tokens in, well inside the JSON object of
# the 20- or 24-token texts; for the tool call (one chunk a token: it asks for logprobs), past
# its ~35-token `<tool_call>` header and name, inside the arguments.
# Chat echo (vLLM's test_chat_echo.py): chunk 0 is the role, chunk 1 the echoed message.
KILL_AT = {"json-schema": 6, "greedy-penalties-echo": 6, "seeded-n2-minp": 6, "tool-required": 42,
           "chat-echo-continue": 6, "chat-token-ids": 6}  # fmt: skip


@pytest.mark.parametrize("name", list(KILL_AT))
def test_kill_mid_stream_keeps_tokens_logprobs_and_grammar(
    cluster: tuple[str, list[WorkerHandle]], name: str
) -> None:
    url, handles = cluster
    reference = run_case(url, name, stream=True)
    check_valid(name, reference)
    assert all(len(o.logprobs) > KILL_AT[name] + 6 for o in reference)
    if name == "tool-required":
        # Chunk 0 is the role; chunk k carries token k - 1: the kill follows token KILL_AT - 1.
        sent = "".join(token for token, _, _ in reference[0].logprobs[: KILL_AT[name]])
        assert '"arguments": {' in sent and not sent.endswith("}"), sent
    killed: list[WorkerHandle] = []

    def kill_the_decoder(num_chunks: int) -> None:
        if num_chunks != KILL_AT[name] or killed:
            return
        for h in handles:
            if h.role == "both" and h.proc.poll() is None and int(health(h.url)["num_running"]) > 0:  # type: ignore[call-overload]
                os.kill(h.pid, signal.SIGKILL)
                h.proc.wait(5)
                killed.append(h)
                return

    before = migrations(url)
    outcome = run_case(url, name, stream=True, on_chunk=kill_the_decoder)
    assert killed, "no decode worker was running the request when the kill was due"
    assert migrations(url) > before
    check_valid(name, outcome)
    assert outcome == reference  # same text, same logprobs, nothing lost or repeated
    for h in handles:
        if h.proc.poll() is None:
            state = health(h.url)
            assert (state["num_pinned_blocks"], state["num_running"]) == (0, 0)
