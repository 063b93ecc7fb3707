"""Every malformed request the soak sends gets what its table says: 400 naming the param, and
no worker is called (the router refuses it before any placement)."""

from __future__ import annotations

import json
from pathlib import Path

from fake_worker import FakeWorker
from router_harness import router, run

from pdlab.soak.plan import Malformed, malformed_case
from pdlab.soak.reference import PATHS


def test_each_malformed_request_is_refused_naming_its_param(tiny_model_path: Path) -> None:
    prefill, decode = FakeWorker("prefill", [5, 6]), FakeWorker("both", [5, 6])
    answers: dict[Malformed, tuple[int, str, str | None, str | None]] = {}

    async def body() -> None:
        async with router(tiny_model_path, [prefill, decode]) as client:
            for kind in Malformed:
                case = malformed_case(kind, tiny_model_path.name, max_model_len=2048)
                resp = await client.post(
                    PATHS[case.api], data=case.body, headers={"Content-Type": "application/json"}
                )
                error = json.loads(await resp.text())["error"]
                answers[kind] = (resp.status, error["type"], error["param"], case.param)

    run(body)
    for kind, (status, type_, param, expected) in answers.items():
        assert (status, type_, param) == (400, "invalid_request_error", expected), kind
    assert prefill.paths() == [] and decode.paths() == []
