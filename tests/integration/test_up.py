"""`pdserve up` as a user runs it: one command starts router and workers, a completion works
end to end, `pdserve status` shows the cluster, and SIGTERM leaves no process and no port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; its parent (`up`) reaps it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


@pytest.fixture
def cluster(tiny_model_path: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    port = free_port()
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path)}
    # The tiny model is already built in the session cache; point the cluster at it.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            str(port),
            "--model",
            str(tiny_model_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        line = ""
        while time.monotonic() < deadline and "pdserve is up at" not in line:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line and proc.poll() is not None:
                raise AssertionError(
                    f"pdserve up exited: {proc.stderr.read() if proc.stderr else ''}"
                )
        assert "pdserve is up at" in line
        curl = proc.stdout.readline() if proc.stdout else ""
        yield f"http://127.0.0.1:{port}", proc, curl, tmp_path / "up.json", env
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_up_serves_status_and_stops_cleanly(cluster, tiny_model_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, proc, curl, state_file, env = cluster
    assert curl.startswith(f"curl {url}/v1/completions")
    body = {
        "model": tiny_model_path.name,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 0,
    }
    out = post(f"{url}/v1/completions", body)
    text = out["choices"][0]["text"]  # type: ignore[index]
    reference = (
        LLM(str(tiny_model_path))
        .generate(["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0.0))[0]
        .text
    )
    assert text == reference  # disaggregated output equals colocated

    status = subprocess.run(
        [sys.executable, "-m", "pdserve", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["mode"] == "disagg"
    assert info["router_pid"] in [c["pid"] for c in json.loads(state_file.read_text())["children"]]
    roles = sorted(w["role"] for w in info["workers"])
    assert roles == ["both", "prefill"]
    assert len({w["fingerprint"] for w in info["workers"]}) == 1
    assert all(w["num_pinned_blocks"] == 0 for w in info["workers"])  # nothing leaked

    children = [c["pid"] for c in json.loads(state_file.read_text())["children"]]
    assert len(children) == 3 and all(pid_alive(p) for p in children)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not any(pid_alive(p) for p in children)
    with socket.socket() as s:
        # SO_REUSEADDR ignores TIME_WAIT leftovers but still fails if anything listens.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))  # the port is free again
    assert not state_file.exists()
