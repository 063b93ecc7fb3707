"""Outside clients, unmodified, against `pdserve up` (disaggregated): guidellm (the vLLM
project's benchmark) and aiperf (NVIDIA's), each a short streamed benchmark of chat and of
completions, every request succeeding.

The clients live in their own venvs (`make client-venvs`: .venv-clients/{guidellm,aiperf}),
never in pdserve's. Offline: guidellm reads the tiny model's tokenizer folder; aiperf's offline
mode only resolves Hugging Face cache entries, so the folder is laid out as one
(hub/models--pdserve--tiny-v2/snapshots/<rev>). `make test` sets PDSERVE_REQUIRE_CLIENTS=1:
there a missing venv fails the test instead of skipping it.

The cluster (conftest.py's `up`) is started with a `--config` YAML file (served model names,
engine and routing flags), which `pdserve up` passes on to its router and workers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from clients_support import SERVED, client_bin

NUM_REQUESTS = 16


def hf_cache_with(tokenizer_dir: Path, home: Path) -> str:
    """Lay `tokenizer_dir` out as a Hugging Face cache entry under `home`; its repo id."""
    rev = "0" * 40
    entry = home / "hub" / "models--pdserve--tiny-v2"
    snapshot = entry / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(rev)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tokenizer_dir / name, snapshot / name)
    return "pdserve/tiny-v2"


def offline_env(home: Path) -> dict[str, str]:
    return {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_streams_every_request(
    up: str, tiny_model_path: Path, tmp_path: Path, request_format: str
) -> None:
    guidellm = client_bin("guidellm", "guidellm")
    report = tmp_path / "guidellm.json"
    backend = (
        f"kind=openai_http,target={up},model={SERVED},request_format={request_format},stream=true"
    )
    argv = [str(guidellm), "run", "--backend", backend,
            "--tokenizer", f"kind=huggingface_auto,model={tiny_model_path}",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
            "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
            "--output", f"kind=json,path={report}", "--disable-console-interactive"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env=offline_env(tmp_path / "hf"), check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    requests = json.loads(report.read_text())["benchmarks"][0]["requests"]
    errors = [r.get("error") for r in requests["errored"]]
    assert (len(requests["successful"]), errors, len(requests["incomplete"])) == (
        NUM_REQUESTS, [], 0)  # fmt: skip
    for r in requests["successful"]:
        assert r["output_tokens"] == 16 and r["info"]["timings"]["token_iterations"] > 1


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_aiperf_streams_every_request(
    up: str, tiny_model_path: Path, tmp_path: Path, endpoint: str
) -> None:
    aiperf = client_bin("aiperf", "aiperf")
    home = tmp_path / "hf"
    repo = hf_cache_with(tiny_model_path, home)
    out = tmp_path / "aiperf"
    argv = [str(aiperf), "profile", "--model", SERVED, "--url", up, "--endpoint-type", endpoint,
            "--streaming", "--tokenizer", repo, "--concurrency", "4",
            "--request-count", str(NUM_REQUESTS), "--synthetic-input-tokens-mean", "64",
            "--output-tokens-mean", "16", "--extra-inputs", "ignore_eos:true",
            "--output-artifact-dir", str(out), "--ui", "none", "--no-server-metrics",
            "--no-gpu-telemetry"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env=offline_env(home), check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["is_complete"]
    assert summary["request_count"]["avg"] == NUM_REQUESTS
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == NUM_REQUESTS
    assert all(r.get("error") is None for r in records)
    assert all(r["metrics"]["usage_completion_tokens"]["value"] == 16 for r in records)
