"""Shared fixtures: the tiny default model, built once per test session into a temp cache;
and the test cluster's secret, in the environment of every process a test starts.

Routers started by tests probe no KV pairs (`PDSERVE_KV_PROBE_MIB=0`): the probes' throwaway
KV would consume the fault plans that count KV sends, and on a machine running two test
processes at once their rate verdicts say more about the CPU than about the link. The
attestation tests ask for probes on their command line (which wins over the environment)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster_auth import TEST_SECRET

from pdserve.auth.secret import ENV_VAR

os.environ[ENV_VAR] = TEST_SECRET
os.environ.setdefault("PDSERVE_KV_PROBE_MIB", "0")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, built into a session-private cache directory."""
    from pdserve.model.tiny import default_model_path

    cache = tmp_path_factory.mktemp("pdserve-cache")
    old = os.environ.get("PDSERVE_CACHE")
    os.environ["PDSERVE_CACHE"] = str(cache)
    try:
        return default_model_path()
    finally:
        if old is None:
            os.environ.pop("PDSERVE_CACHE", None)
        else:
            os.environ["PDSERVE_CACHE"] = old


@pytest.fixture(scope="session")
def kv_heavy_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-layout checkpoint with real-model KV: head_dim 128, 32 KV heads, 4 layers
    (2 MiB per 16-token block in float32), small weights; saved by transformers."""
    from checkpoints import kv_heavy_config, save_hf_checkpoint

    folder = tmp_path_factory.mktemp("kv-heavy") / "kv-heavy"
    save_hf_checkpoint(folder, kv_heavy_config(), tiny_model_path, seed=7)
    return folder
