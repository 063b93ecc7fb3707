"""What the outside-client tests share: the clients' venvs, and a `pdserve up` (disaggregated)
per module, started from a `--config` file and stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from clients_support import SERVED, free_port


@pytest.fixture(scope="module")
def up(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pdserve up --config FILE` (1 prefill, 1 decode, disaggregated); its router URL."""
    workdir = tmp_path_factory.mktemp("outside-clients")
    config = workdir / "pdserve.yaml"
    config.write_text(
        f"served_model_name: [{SERVED}, {tiny_model_path.name}]\n"
        "mode: disagg\n"
        "max_num_seqs: 16\n"
        "max_model_len: 1024\n"
        "enable_prefix_caching: true\n"
        "routing: affinity\n"
        "max_migrations: 2\n"
    )
    port = free_port()
    argv = [sys.executable, "-m", "pdserve", "up", "--config", str(config),
            "--model", str(tiny_model_path), "--port", str(port)]  # fmt: skip
    env = {**os.environ, "PDSERVE_CACHE": str(workdir)}
    log = (workdir / "up.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (workdir / "up.log").read_text()
            assert time.monotonic() < deadline, "pdserve up not ready in 180 s"
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
