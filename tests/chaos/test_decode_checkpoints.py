"""Decode checkpoints with real processes: the decode worker is killed (SIGKILL) or paused
(SIGSTOP) mid-generation, the request resumes on another decode worker from the checkpoint
its holder kept, not by recomputing, and the client's text equals the fault-free text.

Each case asserts from the resuming worker's /metrics that it pulled the checkpoint and
recomputed fewer tokens than one KV block, and that one checkpoint lease TTL later no worker
holds anything for the request (engine blocks or checkpoint blocks). A holder killed while
the request decodes costs the request nothing; a holder and then the decoder killed (faults
overlapping) resume from the prefill worker's prefix cache instead of recomputing the prompt.
The official `openai` client sees the same streamed chat across a checkpointed resume.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_decode_death import health, stream_tokens
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

from pdserve.observability.exposition import parse

BLOCK_SIZE = 16
# A killed worker's checkpoint lapses after this; a paused one's must outlive the router's
# drain (poll 1 s + timeout 2 s + deadline), so the pause case uses the longer one.
CHECKPOINT_TTL_S = 3.0
PAUSE_CHECKPOINT_TTL_S = 8.0
HEALTH_DEADLINE_S = 1.0
# A prompt of a few blocks, then a long generation: the kill comes mid-decode.
PROMPT = "Once upon a time " * 12
BODY = {"model": "tiny-v2", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
PUTS = "pdserve_worker_checkpoint_put_blocks_total"
# Decode steps of at least 5 ms: a stream outlasts the puts and the watcher that counts them
# however loaded the machine is (a starved decoder could finish 400 tokens before its
# checkpoint puts, which share its process, had counted the fault's block).
PACED_DECODE = ("--fault", "worker.engine_step:delay:delay_s=0.005,times=0")


def _cluster(
    tiny_model_path: Path, tmp_path: Path, num_decode: int, ttl_s: float = CHECKPOINT_TTL_S
) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """`tiny_model_path`: whichever checkpoint the cluster serves."""
    with worker_processes() as handles:
        handles.append(launch_worker("prefill", tmp_path, model=tiny_model_path))
        for _ in range(num_decode):
            handles.append(
                launch_worker("decode", tmp_path, model=tiny_model_path, extra_args=PACED_DECODE)
            )
        for handle in handles:
            wait_ready(handle)
        router_args = (
            "--checkpoint", "every-1",
            "--checkpoint-lease-ttl-s", str(ttl_s),
            "--health-deadline-s", str(HEALTH_DEADLINE_S),
            "--lease-ttl-s", "3",
        )  # fmt: skip
        with router_process(
            tmp_path, tiny_model_path, [h.url for h in handles], extra_args=router_args
        ) as url:
            yield url, handles
        for h in handles:  # never leave a stopped process behind
            if h.proc.poll() is None:
                os.kill(h.pid, signal.SIGCONT)


@pytest.fixture
def cluster(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """A router with checkpoints every block over one prefill and two decode workers."""
    yield from _cluster(tiny_model_path, tmp_path, 2)


@pytest.fixture
def paused_cluster(
    tiny_model_path: Path, tmp_path: Path
) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """Two decode workers, checkpoints that outlive the router's drain of a paused one."""
    yield from _cluster(tiny_model_path, tmp_path, 2, PAUSE_CHECKPOINT_TTL_S)


@pytest.fixture
def heavy_cluster(
    kv_heavy_model_path: Path, tmp_path: Path
) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """The pause-proof cluster on the KV-heavy checkpoint: 2 MiB blocks, so a put is a
    megabyte-sized frame on the replication link and a resume pulls tens of MiB."""
    yield from _cluster(kv_heavy_model_path, tmp_path, 2, PAUSE_CHECKPOINT_TTL_S)


@pytest.fixture
def cluster3(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """The same with three decode workers (decoder, holder, a spare)."""
    yield from _cluster(tiny_model_path, tmp_path, 3)


def metrics(url: str) -> dict[str, float]:
    """A worker's samples as {"name{label=value,...}": value} (labels sorted, worker_id out)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for s in parse(text):
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels) if k != "worker_id")
        out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def busy_decoder(router_url: str, decodes: list[WorkerHandle]) -> WorkerHandle | None:
    """The decode worker the router has the stream open on."""
    busy = {w["url"] for w in health(router_url)["workers"] if w["num_inflight"]}  # type: ignore[attr-defined]
    return next((h for h in decodes if h.url in busy), None)


def after_a_checkpoint(victim: WorkerHandle, signum: int, puts: int = 1) -> None:
    """Send `signum` to the decoder right after its `puts`-th next checkpoint put completed:
    the request is then at most one block ahead of its checkpoint (a kill during a put would
    lose that put's block too, a tokens-per-put race the test must not depend on)."""
    before = metrics(victim.url).get(PUTS, 0)
    deadline = time.monotonic() + 5 * puts
    while metrics(victim.url).get(PUTS, 0) < before + puts:
        assert time.monotonic() < deadline, f"fewer than {puts} checkpoint puts in {5 * puts} s"
        time.sleep(0.002)
    os.kill(victim.pid, signum)


@contextlib.contextmanager
def killing_after_puts(
    url: str, decodes: list[WorkerHandle], signum: int, puts: int
) -> Iterator[list[WorkerHandle]]:
    """Beside the body: send `signum` to the decode worker whose checkpoint puts grew by `puts`
    since the body began (so however late this thread runs, it counts the body's stream from
    its start); yields the list the victim is added to."""
    faulted: list[WorkerHandle] = []
    before = {h.url: metrics(h.url).get(PUTS, 0) for h in decodes}
    streaming = threading.Event()

    def watch() -> dict[str, float]:
        deadline = time.monotonic() + 60
        while streaming.is_set():
            for h in decodes:
                if metrics(h.url).get(PUTS, 0) >= before[h.url] + puts:
                    os.kill(h.pid, signum)
                    if signum == signal.SIGKILL:
                        h.proc.wait(5)
                    faulted.append(h)
                    return {}
            assert time.monotonic() < deadline, f"no decode worker made {puts} puts in 60 s"
            time.sleep(0.002)
        return {h.url: metrics(h.url).get(PUTS, 0) - before[h.url] for h in decodes}

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming.set()
        watcher = pool.submit(watch)
        try:
            yield faulted
        finally:
            streaming.clear()  # the body ended: a fault not sent by now is never sent
            grown = watcher.result()
        assert faulted, f"the stream ended before {puts} puts on one decoder: {grown}"


def wait_clean(handles: list[WorkerHandle], timeout_s: float) -> None:
    """Every live worker back to nothing pinned, running or held as a checkpoint."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {}
        for h in handles:
            if h.proc.poll() is not None:
                continue
            state = health(h.url)
            held = metrics(h.url).get("pdserve_worker_checkpoint_held_blocks", 0)
            states[h.url] = (state["num_pinned_blocks"], state["num_running"], held)
        if all(v == (0, 0, 0) for v in states.values()):
            return
        assert time.monotonic() < deadline, f"still held one TTL later: {states}"
        time.sleep(0.2)


def resumed_from_checkpoint(handles: list[WorkerHandle], faulted: WorkerHandle) -> float:
    """Check one surviving decode worker resumed from the checkpoint; its recomputed tokens."""
    resumes = {}
    for h in handles:
        if h is faulted or h.role != "decode":
            continue
        m = metrics(h.url)
        n = sum(
            v
            for k, v in m.items()
            if k.startswith("pdserve_worker_checkpoint_resumes_total{path=checkpoint,")
        )
        resumes[h.url] = (n, m.get("pdserve_worker_checkpoint_recomputed_tokens_total", 0))
    pulled = [v for v in resumes.values() if v[0] == 1]
    assert len(pulled) == 1, f"no worker resumed from a checkpoint: {resumes}"
    return pulled[0][1]


@pytest.mark.parametrize(
    ("sampling", "kill_at"),
    [({"temperature": 0}, 60), ({"temperature": 0.9, "seed": 7}, 150)],
    ids=["greedy@60", "seeded@150"],
)
def test_killed_decoder_resumes_from_its_checkpoint(
    cluster: tuple[str, list[WorkerHandle]], sampling: dict[str, object], kill_at: int
) -> None:
    url, handles = cluster
    decodes = [h for h in handles if h.role == "decode"]
    body = {**BODY, **sampling}
    reference, _ = stream_tokens(url, body)
    # Counted on the worker, beside the client (as the tool-call case below): a loaded
    # client reads far behind the decoder, which may have finished by its `kill_at`-th chunk.
    with killing_after_puts(url, decodes, signal.SIGKILL, kill_at // BLOCK_SIZE) as killed:
        pieces, finish = stream_tokens(url, body)
    assert killed, "no decode worker had the stream when the kill was due"
    assert finish == "length" and "".join(pieces) == "".join(reference)
    recomputed = resumed_from_checkpoint(handles, killed[0])
    assert recomputed <= BLOCK_SIZE, f"{recomputed} tokens recomputed"
    wait_clean(handles, CHECKPOINT_TTL_S + 2)


def test_paused_decoder_resumes_from_its_checkpoint(
    paused_cluster: tuple[str, list[WorkerHandle]],
) -> None:
    url, handles = paused_cluster
    decodes = [h for h in handles if h.role == "decode"]
    body = {**BODY, "temperature": 0.9, "seed": 11}
    reference, _ = stream_tokens(url, body)
    with killing_after_puts(url, decodes, signal.SIGSTOP, 100 // BLOCK_SIZE) as paused:
        pieces, finish = stream_tokens(url, body)
    assert paused, "no decode worker had the stream when the pause was due"
    assert finish == "length" and "".join(pieces) == "".join(reference)
    recomputed = resumed_from_checkpoint(handles, paused[0])
    assert recomputed <= BLOCK_SIZE, f"{recomputed} tokens recomputed"
    # Past every lease TTL, then woken: it must free what it held, and hold nothing anywhere.
    time.sleep(PAUSE_CHECKPOINT_TTL_S + 1)
    os.kill(paused[0].pid, signal.SIGCONT)
    wait_clean(handles, PAUSE_CHECKPOINT_TTL_S + 3)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "pause"])
def test_a_decoder_of_megabyte_blocks_resumes_from_its_checkpoint(
    heavy_cluster: tuple[str, list[WorkerHandle]], kv_heavy_model_path: Path, signum: int
) -> None:
    """At real-model KV sizes (2 MiB blocks): the same resume, exactly once, from KV."""
    url, handles = heavy_cluster
    decodes = [h for h in handles if h.role == "decode"]
    body = {**BODY, "model": kv_heavy_model_path.name, "max_tokens": 200, "temperature": 0}
    reference, _ = stream_tokens(url, body)
    faulted: list[WorkerHandle] = []
    try:
        with killing_after_puts(url, decodes, signum, 80 // BLOCK_SIZE) as faulted:
            pieces, finish = stream_tokens(url, body)
        assert faulted, "no decode worker had the stream when the fault was due"
        assert finish == "length" and "".join(pieces) == "".join(reference)
        recomputed = resumed_from_checkpoint(handles, faulted[0])
        assert recomputed <= BLOCK_SIZE, f"{recomputed} tokens recomputed"
        # The writer's puts of single 2 MiB blocks rode its replication link: the holder
        # (the other decode worker) says so (the writer is dead or stopped).
        survivor = next(h for h in decodes if h is not faulted[0])
        held = metrics(survivor.url).get(
            "pdserve_worker_checkpoint_link_puts_received_total{result=held}", 0
        )
        assert held > 0, "the holder received no put over a link"
        if signum == signal.SIGSTOP:
            time.sleep(PAUSE_CHECKPOINT_TTL_S + 1)  # past every lease, then woken
    finally:
        for h in faulted:
            if signum == signal.SIGSTOP:
                os.kill(h.pid, signal.SIGCONT)
            else:
                h.proc.wait(5)
    wait_clean(handles, PAUSE_CHECKPOINT_TTL_S + 3)


def test_holder_death_never_fails_the_request(
    cluster3: tuple[str, list[WorkerHandle]],
) -> None:
    url, handles = cluster3
    decodes = [h for h in handles if h.role == "decode"]
    body = {**BODY, "temperature": 0}
    reference, _ = stream_tokens(url, body)
    killed: list[WorkerHandle] = []

    def kill_the_holder(num_chunks: int) -> None:
        if num_chunks != 60 or killed:
            return
        for h in decodes:
            if metrics(h.url).get("pdserve_worker_checkpoint_owners", 0) > 0:
                os.kill(h.pid, signal.SIGKILL)
                h.proc.wait(5)
                killed.append(h)
                return

    pieces, finish = stream_tokens(url, body, kill_the_holder)
    assert killed, "no worker held a checkpoint when the kill was due"
    assert finish == "length" and "".join(pieces) == "".join(reference)
    # Whichever call meets the dead holder first says so: a control call (PeerCallError) or
    # the put's KV connection (a transfer error); each is counted under its error type.
    prefix = "pdserve_worker_checkpoint_stream_failures_total"
    failures = [
        sum(v for k, v in metrics(h.url).items() if k.startswith(prefix))
        for h in decodes
        if h is not killed[0]
    ]
    assert any(failures), f"the decoder never noticed its holder died: {failures}"
    wait_clean(handles, CHECKPOINT_TTL_S + 2)


def test_a_paused_holder_never_holds_up_the_request(
    cluster3: tuple[str, list[WorkerHandle]],
) -> None:
    """SIGSTOP the holder while puts ride its replication link: the stream goes on and ends
    at once with the fault-free text; after SIGCONT its copy lapses with the owner's lease."""
    url, handles = cluster3
    decodes = [h for h in handles if h.role == "decode"]
    body = {**BODY, "temperature": 0}
    reference, _ = stream_tokens(url, body)
    paused: list[WorkerHandle] = []
    seen: list[float] = []

    def pause_the_holder(num_chunks: int) -> None:
        seen.append(time.monotonic())
        if num_chunks != 60 or paused:
            return
        for h in decodes:
            if metrics(h.url).get("pdserve_worker_checkpoint_owners", 0) > 0:
                os.kill(h.pid, signal.SIGSTOP)
                paused.append(h)
                return

    try:
        pieces, finish = stream_tokens(url, body, pause_the_holder)
        ended = time.monotonic()
        assert paused, "no worker held a checkpoint when the pause was due"
        assert finish == "length" and "".join(pieces) == "".join(reference)
        # What the client sees: no wait at the end (the worker's own release call to the
        # stopped holder goes in the background: tests/unit/checkpoint).
        assert ended - seen[-1] < 2.0, f"the stream's end waited {ended - seen[-1]:.1f} s"
        writer = [h for h in decodes if h is not paused[0]]
        link = sum(
            metrics(h.url).get("pdserve_worker_checkpoint_puts_total{path=link}", 0) for h in writer
        )
        assert link > 0, "no put rode a replication link"
    finally:
        for h in paused:
            os.kill(h.pid, signal.SIGCONT)
    wait_clean(handles, CHECKPOINT_TTL_S + 3)


def test_holder_then_decoder_death_resumes_from_the_prefill_workers_cache(
    cluster3: tuple[str, list[WorkerHandle]],
) -> None:
    """Overlapping faults: the holder dies, then the decoder. The checkpoint is gone, but the
    prompt's KV is still in a prefix cache (the prefill worker's): the resume pulls it from
    there and recomputes only the generated tokens, not the prompt."""
    url, handles = cluster3
    decodes = [h for h in handles if h.role == "decode"]
    body = {**BODY, "temperature": 0.9, "seed": 5}
    reference, _ = stream_tokens(url, body)
    killed: list[WorkerHandle] = []

    def kill_holder_then_decoder(num_chunks: int) -> None:
        if num_chunks == 40 and not killed:
            holder = next(
                (h for h in decodes if metrics(h.url).get("pdserve_worker_checkpoint_owners", 0)),
                None,
            )
            if holder is not None:
                os.kill(holder.pid, signal.SIGKILL)
                holder.proc.wait(5)
                killed.append(holder)
        elif num_chunks == 120 and len(killed) == 1:
            victim = busy_decoder(url, decodes)
            if victim is not None and victim is not killed[0]:
                os.kill(victim.pid, signal.SIGKILL)
                victim.proc.wait(5)
                killed.append(victim)

    pieces, finish = stream_tokens(url, body, kill_holder_then_decoder)
    assert len(killed) == 2, "the holder and then the decoder were due to be killed"
    assert finish == "length" and "".join(pieces) == "".join(reference)
    (survivor,) = [h for h in decodes if h not in killed]
    m = metrics(survivor.url)
    resumes = {k: v for k, v in m.items() if k.startswith("pdserve_worker_checkpoint_resumes")}
    # Its own cache may hold the prompt (it served the reference run): then nothing travels.
    from_cache = sum(v for k, v in resumes.items() if "path=peer_cache," in k or "path=local," in k)
    assert from_cache == 1, resumes
    restored = m["pdserve_worker_checkpoint_resumed_tokens_total"]
    recomputed = m["pdserve_worker_checkpoint_recomputed_tokens_total"]
    # The prompt (more than 48 tokens) came back whole: at least its three full blocks.
    assert recomputed <= restored - 3 * BLOCK_SIZE, f"{recomputed} of {restored} recomputed"
    if "pdserve_worker_checkpoint_resumes_total{path=peer_cache,reason=ok}" in resumes:
        assert m["pdserve_worker_checkpoint_pulled_bytes_total"] > 0
    wait_clean(handles, CHECKPOINT_TTL_S + 2)


def test_the_official_openai_client_sees_the_same_chat_across_a_checkpointed_resume(
    cluster: tuple[str, list[WorkerHandle]],
) -> None:
    """What a user of the `openai` package sees: a streamed, seeded chat completion whose
    decode worker is killed mid-stream resumes from its checkpoint with the same text, the
    same finish reason and the same token count as the fault-free run."""
    from openai_cases import client

    url, handles = cluster
    decodes = [h for h in handles if h.role == "decode"]
    api = client(url)
    kwargs = {
        "model": "tiny-v2",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 300,
        "temperature": 0.8,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }

    def chat() -> tuple[str, str | None, int]:
        text, finish, tokens = "", None, 0
        for chunk in api.chat.completions.create(**kwargs):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    reference = chat()
    # Watched on the workers beside the client: a loaded client reads far behind the decoder.
    with killing_after_puts(url, decodes, signal.SIGKILL, 100 // BLOCK_SIZE) as killed:
        outcome = chat()
    assert killed, "no decode worker had the stream when the kill was due"
    assert outcome == reference and reference[1:] == ("length", 300)
    recomputed = resumed_from_checkpoint(handles, killed[0])
    assert recomputed <= BLOCK_SIZE, f"{recomputed} tokens recomputed"
    wait_clean(handles, CHECKPOINT_TTL_S + 2)


def test_a_tool_call_cut_mid_arguments_resumes_from_its_checkpoint(
    cluster: tuple[str, list[WorkerHandle]],
) -> None:
    """A forced, sampled tool call whose decode worker dies inside the arguments resumes from
    its checkpoint with the same call: the grammar is rebuilt from the tokens and the sampler
    keeps the request's seed, so the arguments continue where they were, valid."""
    from openai_cases import client

    url, handles = cluster
    decodes = [h for h in handles if h.role == "decode"]
    api = client(url)
    note = {"type": "string", "minLength": 400, "maxLength": 420}
    tool = {"type": "function", "function": {"name": "log", "parameters": {
        "type": "object", "properties": {"note": note}, "required": ["note"],
        "additionalProperties": False}}}  # fmt: skip
    kwargs = {
        "model": "tiny-v2",
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "log"}},
        "max_tokens": 600,
        "temperature": 0.8,
        "seed": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def call() -> tuple[str, str, str | None, int]:
        name, arguments, finish, tokens = "", "", None, 0
        for chunk in api.chat.completions.create(**kwargs):
            for c in chunk.choices:
                for piece in c.delta.tool_calls or []:
                    name += piece.function.name or ""
                    arguments += piece.function.arguments or ""
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return name, arguments, finish, tokens

    reference = call()
    assert reference[0] == "log" and reference[2] == "tool_calls"
    assert 400 <= len(json.loads(reference[1])["note"]) <= 420
    # The call is long enough for the watcher below to see two puts inside the note.
    assert reference[3] >= 4 * BLOCK_SIZE, reference[3]
    killed: list[WorkerHandle] = []

    def kill() -> None:
        # Watched on the worker, beside the client rather than inside its reading: on a
        # loaded machine the client reads far behind the decoder, which may have finished
        # the call by the time the client sees any given chunk. Two puts past the start of
        # the stream are at most 3 blocks in, inside the note.
        deadline = time.monotonic() + 30
        while (victim := busy_decoder(url, decodes)) is None:
            assert time.monotonic() < deadline, "no decode worker took the stream"
            time.sleep(0.002)
        after_a_checkpoint(victim, signal.SIGKILL, puts=2)
        victim.proc.wait(5)
        killed.append(victim)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(kill)
        outcome = call()
        watcher.result()
    assert killed, "no decode worker had the stream when the kill was due"
    assert outcome == reference
    recomputed = resumed_from_checkpoint(handles, killed[0])
    assert recomputed <= BLOCK_SIZE, f"{recomputed} tokens recomputed"
    wait_clean(handles, CHECKPOINT_TTL_S + 2)
