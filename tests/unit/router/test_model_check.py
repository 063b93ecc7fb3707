"""The router refuses workers that run another model than its own (invariant: one model)."""

from __future__ import annotations

from pathlib import Path

from pdserve.model.loader import load_model
from pdserve.router.workers.model_check import (
    ROUTER_FIELDS,
    describe,
    model_mismatch,
    router_model_fields,
)


def test_the_routers_fields_equal_a_real_workers_fingerprint(tiny_model_path: Path) -> None:
    fields = router_model_fields(tiny_model_path)
    assert set(fields) == set(ROUTER_FIELDS)
    worker = load_model(str(tiny_model_path)).fingerprint.to_dict()
    assert model_mismatch(fields, worker) == {}


def test_a_differing_tokenizer_or_rope_is_named(tiny_model_path: Path) -> None:
    fields = router_model_fields(tiny_model_path)
    worker = {**load_model(str(tiny_model_path)).fingerprint.to_dict()}
    worker["tokenizer_digest"] = "other"
    worker["rope_theta"] = 500000
    diff = model_mismatch(fields, worker)
    assert set(diff) == {"tokenizer_digest", "rope_theta"}
    assert "rope_theta 10000.0 != 500000" in describe(diff)


def test_the_pool_never_offers_a_worker_of_another_model(tiny_model_path: Path) -> None:
    import asyncio

    from pdserve.protocol.worker_api import WorkerHealth
    from pdserve.router.workers.pool import WorkerPool

    fields = router_model_fields(tiny_model_path)
    ours = load_model(str(tiny_model_path)).fingerprint.to_dict()
    theirs = {**ours, "tokenizer_digest": "another"}

    def health(fingerprint: dict[str, object]) -> WorkerHealth:
        return WorkerHealth(
            worker_id="w", role="both", pid=1, fingerprint=fingerprint,  # type: ignore[arg-type]
            fingerprint_digest=str(fingerprint["tokenizer_digest"]), transfer_address=None,
            max_model_len=2048, block_size=16, num_blocks=10, num_free_blocks=10,
            num_pinned_blocks=0, num_running=0, num_waiting=0, num_active_leases=0,
        )  # fmt: skip

    class Client:
        async def health(self, url: str, timeout_s: float | None = None) -> WorkerHealth:
            return health(ours if url.endswith(":1") else theirs)

        def abandon(self, url: str) -> int:
            return 0

    def check(h: WorkerHealth) -> str | None:
        diff = model_mismatch(fields, h.fingerprint)
        return describe(diff) if diff else None

    pool = WorkerPool(["http://w:1", "http://w:2"], Client(), model_check=check)  # type: ignore[arg-type]
    asyncio.run(pool.poll_once())
    views = {v.url: v.healthy for v in pool.snapshot()}
    assert views == {"http://w:1": True, "http://w:2": False}
    (problem,) = pool.model_problems()
    assert "http://w:2 runs another model: tokenizer_digest" in problem
