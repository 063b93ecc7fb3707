"""A decode worker SIGKILLed mid-stream while serving requests that use logprobs, penalties,
min_tokens, logit_bias, echo (completion and chat), n > 1, structured output, logprob tokens
named by id (`return_tokens_as_token_ids`) and a forced tool call: the migrated
stream's text, tool call and logprobs equal the fault-free run's bit for bit, and JSON or a
call's arguments cut mid-object by the kill are still the same valid JSON (the grammar state
is rebuilt from the tokens, and the sampler keeps the request's seed)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai_cases import check_valid, run_case
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

# Every step 5 ms or more: a stream lasts long enough for the test to kill its decoder.
PACED = ("--fault", "worker.engine_step:delay:delay_s=0.005,times=0")
WORKER_ARGS = ("--kv-cache-bytes", str(32 << 20), "--batch-invariant", *PACED)


@pytest.fixture(scope="module")
def cluster(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """One prefill worker, and a `both` worker per kill (each case's and the batch's) and one
    more to migrate to."""
    workdir = tmp_path_factory.mktemp("feature-migration")
    with worker_processes() as handles:
        for role in ("prefill", *["both"] * (len(KILL_AT) + 2)):
            handles.append(launch_worker(role, workdir, model=tiny_model_path,
                                         extra_args=WORKER_ARGS))  # fmt: skip
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


def test_a_chat_batch_whose_decoder_dies_answers_as_without_the_fault(
    cluster: tuple[str, list[WorkerHandle]],
) -> None:
    """vLLM's /v1/chat/completions/batch (test_batched_chat_completions.py) across a decode
    migration: each conversation is its own flow, so the one whose decode worker is killed
    mid-decode migrates and the batch answers exactly as the fault-free run (seeded sampling
    with penalties, so a lost or repeated token would change the text)."""
    url, handles = cluster
    conversations = [[{"role": "user", "content": "Tell me about the sea"}],
                     [{"role": "user", "content": "Tell me about the hills"}]]  # fmt: skip
    body = {"model": "tiny-v2", "messages": conversations, "max_tokens": 300, "temperature": 0.8,
            "seed": 13, "frequency_penalty": 0.3, "ignore_eos": True}  # fmt: skip

    def post() -> dict[str, object]:
        request = urllib.request.Request(
            f"{url}/v1/chat/completions/batch",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            data: dict[str, object] = json.loads(resp.read())
            return data

    def texts(data: dict[str, object]) -> list[str]:
        return [c["message"]["content"] for c in data["choices"]]  # type: ignore[attr-defined, index]

    reference = post()
    before = migrations(url)
    killed: list[WorkerHandle] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post)
        # Decoding is paced (every worker's steps take 5 ms or more): 300 tokens last
        # seconds, so the first decode worker seen busy dies mid-decode.
        while not killed and not answer.done():
            for h in handles:
                if (
                    h.role == "both"
                    and h.proc.poll() is None
                    and int(health(h.url)["num_running"]) > 0
                ):  # type: ignore[call-overload]
                    os.kill(h.pid, signal.SIGKILL)
                    h.proc.wait(5)
                    killed.append(h)
                    break
        outcome = answer.result()
    assert killed and migrations(url) > before
    assert texts(outcome) == texts(reference) and len(texts(reference)) == 2
    # Token counts as without the fault (what the prefix cache served differs, as it may).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    usage = [{k: d["usage"][k] for k in counts} for d in (outcome, reference)]  # type: ignore[index]
    assert usage[0] == usage[1] == {**usage[1], "completion_tokens": 600}
