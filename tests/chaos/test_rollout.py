"""A rollout without a second cluster (issue 30 D3): two prefill and two decode workers of one
checkpoint replaced, one at a time, by workers of another (other weights, same model), under
load, behind one router and one served model name.

Each replaced worker drains (SIGTERM) and a worker of the new checkpoint starts at its address.
The router serves each fingerprint group as a revision: new requests go to the newest revision
that has both roles ready, a request stays in the revision that computed its first token, and
KV never crosses revisions. Asserted: no request fails, every answer is one checkpoint's own
offline answer (a request whose prefill and decode ran in different checkpoints would match
neither), both revisions served during the rollout and only the new one at its end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rolling import FixedWorkers, SteadyLoad
from test_decode_death import health
from waiting import until_sync
from worker_proc import router_process, wait_ready, worker_processes

from pdserve import LLM, SamplingParams
from pdserve.model.tiny import build_tiny_model

pytestmark = pytest.mark.slow

NUM_CLIENTS = 3
PROMPTS = [f"Chapter {i}: the lighthouse keeper" for i in range(4)]


def body(i: int) -> dict[str, object]:
    return {"model": "tiny-v2", "prompt": PROMPTS[i % 4], "max_tokens": 16, "ignore_eos": True,
            "temperature": 0.7, "seed": 40 + i % 4}  # fmt: skip


def offline(model: Path) -> list[str]:
    llm = LLM(str(model), kv_cache_bytes=64 << 20)
    outs = llm.generate(
        [body(i)["prompt"] for i in range(4)],  # type: ignore[misc]
        [
            SamplingParams(max_tokens=16, temperature=0.7, seed=40 + i, ignore_eos=True)
            for i in range(4)
        ],
    )
    return [o.text for o in outs]


def test_a_worker_by_worker_rollout_under_load_fails_nothing_and_never_mixes_revisions(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    new_model = build_tiny_model(tmp_path / "new" / tiny_model_path.name, seed=12345)
    expected = {"old": offline(tiny_model_path), "new": offline(new_model)}
    assert expected["old"] != expected["new"]
    with worker_processes() as handles:
        workers = FixedWorkers(tmp_path, handles, lambda role: ("--drain-timeout-s", "20"))
        running = {name: workers.start(name, tiny_model_path) for name in workers.specs}
        for handle in running.values():
            wait_ready(handle)
        with (
            router_process(tmp_path, tiny_model_path, [h.url for h in running.values()]) as url,
            SteadyLoad(url, body, NUM_CLIENTS).running() as load,
        ):
            # Prefill first: the new revision is ready only once it has both roles.
            for name in ("prefill-0", "decode-0", "prefill-1", "decode-1"):
                before = load.count()
                until_sync(lambda b=before: load.count() >= b + 3, timeout_s=60)
                old = running[name]
                old.terminate()
                assert old.proc.wait(30) == 0, old.log()[-2000:]
                running[name] = wait_ready(workers.start(name, new_model))
                until_sync(
                    lambda n=name: any(
                        w["worker_id"] == n and w["healthy"]
                        for w in health(url)["workers"]  # type: ignore[attr-defined]
                    ),
                    timeout_s=10,
                )
            done = load.count()
            until_sync(lambda: load.count() >= done + 6, timeout_s=60)
    which = []
    for i, got in load.outcomes:
        assert not isinstance(got, BaseException), (i, got)
        revision = [r for r, texts in expected.items() if "".join(got) == texts[i % 4]]
        assert revision, (i, got, expected)  # one checkpoint's own answer, never a mix
        which.append(revision[0])
    assert "old" in which and "new" in which
    assert which[-NUM_CLIENTS:] == ["new"] * NUM_CLIENTS
