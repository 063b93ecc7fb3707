"""The router refuses workers that run another model than its own (invariant: one model)."""

from __future__ import annotations

from pathlib import Path

from pdserve.model.loader import load_model
from pdserve.router.model_check import ROUTER_FIELDS, describe, model_mismatch, router_model_fields


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
