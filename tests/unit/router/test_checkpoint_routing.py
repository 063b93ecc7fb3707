"""The router's half of decode checkpoints: each decode leg names a holder (another decode
worker, never itself, the least loaded), a migration tells the resuming worker where the
checkpoint is and names a new holder for its own leg; with checkpoints off nothing of it is
sent. (A migration tries the holder first: `checkpoint_plan.resume_on`, unit-tested.)"""

from __future__ import annotations

from pathlib import Path

from fake_worker import FakeWorker
from router_harness import completion, router, run

from pdserve.protocol.worker_api import DecodeRequest, GenerateRequest
from pdserve.router.config import RecoveryConfig

TOKENS = [300, 301, 302, 303, 304, 305, 306, 307]


def test_a_migration_names_its_checkpoint_and_a_new_holder(tiny_model_path: Path) -> None:
    prefill = FakeWorker("prefill", TOKENS)
    dying = FakeWorker("decode", TOKENS, cut_after_tokens=2)
    holder = FakeWorker("decode", TOKENS, num_running=3)
    spare = FakeWorker("decode", TOKENS, num_running=1)
    recovery = RecoveryConfig(checkpoint="every-2", checkpoint_lease_ttl_s=7.0)

    async def body() -> None:
        workers = [prefill, dying, holder, spare]
        async with router(tiny_model_path, workers, recovery=recovery) as client:
            resp = await client.post("/v1/completions", json=completion(6))
            assert resp.status == 200, await resp.json()
            urls = {w.url for w in workers}
            spare_url, holder_url, prefill_url = spare.url, holder.url, prefill.url
        assert len(urls) == 4
        (decode,) = dying.bodies
        assert isinstance(decode, DecodeRequest) and decode.checkpoint is not None
        # The least-loaded other decode worker holds the first leg's checkpoint.
        assert decode.checkpoint.holder_url == spare_url
        assert (decode.checkpoint.policy, decode.checkpoint.lease_ttl_s) == ("every-2", 7.0)
        (resumed,) = spare.bodies
        assert isinstance(resumed, GenerateRequest) and len(resumed.output_token_ids) == 3
        assert resumed.checkpoint_from is not None
        assert resumed.checkpoint_from.holder_url == spare_url  # it resumes on its own copy
        # The prefill worker computed the prompt's KV: its prefix cache is a source too.
        assert resumed.checkpoint_from.cache_urls == [prefill_url]
        # The resumed leg needs a new holder: never the worker it runs on.
        assert resumed.checkpoint is not None and resumed.checkpoint.holder_url == holder_url
        assert not holder.bodies

    run(body)


def test_with_checkpoints_off_no_plan_and_no_source_travel(tiny_model_path: Path) -> None:
    prefill = FakeWorker("prefill", TOKENS)
    dying = FakeWorker("decode", TOKENS, cut_after_tokens=2)
    survivor = FakeWorker("decode", TOKENS)

    async def body() -> None:
        async with router(tiny_model_path, [prefill, dying, survivor]) as client:
            resp = await client.post("/v1/completions", json=completion(6))
            assert resp.status == 200, await resp.json()
        bodies = [*dying.bodies, *survivor.bodies]
        assert len(bodies) == 2
        assert all(b.checkpoint is None for b in bodies)
        assert all(b.checkpoint_from is None for b in survivor.bodies)  # type: ignore[union-attr]

    run(body)
