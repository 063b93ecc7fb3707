"""`pdserve up` as a user runs it: one command starts router and workers, a completion works
end to end, `pdserve status` shows the cluster, and SIGTERM leaves no process and no port; with
two routers (static or etcd membership), a killed worker and a killed router come back at their
addresses, rejoin, serve the same text, and `pdserve status` shows their restarts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.auth.secret import ENV_VAR


def free_port(count: int = 2) -> int:
    """A loopback port P with P .. P+count-1 all free now (`--routers N` uses P+i)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            for i in range(1, count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port + i))
        except OSError:
            continue
        return port


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


# The keys `up` takes from its environment and hands to its routers (issue 31: never argv).
API_KEY = "api-key-of-the-up-test"
ADMIN_KEY = "admin-key-of-the-up-test"


def post(url: str, body: dict[str, object], key: str | None = API_KEY) -> dict[str, object]:
    headers = {"Content-Type": "application/json"}
    headers |= {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


@pytest.fixture
def cluster(tiny_model_path: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    port = free_port()
    # As a user starts it (`make run`): no cluster secret in the environment, `up` makes one.
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PDSERVE_CACHE"] = str(tmp_path)
    env |= {"PDSERVE_API_KEY": API_KEY, "PDSERVE_ADMIN_KEY": ADMIN_KEY}
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
        yield f"http://127.0.0.1:{port}", proc, line + curl, tmp_path / "up.json", env
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_up_serves_status_and_stops_cleanly(cluster, tiny_model_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, proc, printed, state_file, env = cluster
    curl = printed.splitlines()[-1]
    assert curl.startswith(f"curl {url}/v1/completions")
    assert "$PDSERVE_API_KEY" in curl
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
    # The keys work, and are on no command line (of up or its children) and in no output.
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(f"{url}/v1/completions", body, key=None)
    assert refused.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(f"{url}/admin/mode", {"mode": "colocated"}, key=API_KEY)
    assert refused.value.code == 401  # the API key is not the admin key
    for pid in (proc.pid, *children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert API_KEY.encode() not in cmdline and ADMIN_KEY.encode() not in cmdline, pid
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    for text in (printed, out, err):
        assert API_KEY not in text and ADMIN_KEY not in text
    assert not any(pid_alive(p) for p in children)
    with socket.socket() as s:
        # SO_REUSEADDR ignores TIME_WAIT leftovers but still fails if anything listens.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))  # the port is free again
    assert not state_file.exists()


def _children(state_file: Path) -> dict[str, dict[str, object]]:
    return {c["name"]: c for c in json.loads(state_file.read_text())["children"]}


def _wait(what: str, done: object, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("membership", ["etcd", "static"])
def test_up_restarts_what_dies_and_status_shows_it(
    tiny_model_path: Path, tmp_path: Path, membership: str
) -> None:
    if membership == "etcd" and shutil.which("etcd") is None:
        pytest.skip("etcd is not on PATH (etcd-server)")
    port = free_port()
    # As a user starts it (`make run`): no cluster secret in the environment, `up` makes one.
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["PDSERVE_CACHE"] = str(tmp_path)
    state_file = tmp_path / "up.json"
    args = [sys.executable, "-m", "pdserve", "up", "--prefill", "1", "--decode", "2"]
    args += ["--routers", "2", "--port", str(port), "--model", str(tiny_model_path)]
    args += ["--etcd"] if membership == "etcd" else []
    errors = tmp_path / "up.stderr"
    with errors.open("w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    seen: set[int] = set()
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "pdserve is up at" in line, errors.read_text()
        routers = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        assert all(r in line for r in routers)
        assert ("membership etcd etcd://" in line) == (membership == "etcd")
        before = _children(state_file)
        names = ["decode-0", "decode-1", "prefill-0", "router-0", "router-1"]
        assert sorted(before) == sorted([*names, "etcd"] if membership == "etcd" else names)
        seen |= {int(c["pid"]) for c in before.values()}  # type: ignore[call-overload]
        body = {"model": tiny_model_path.name, "prompt": "The quick brown fox", "max_tokens": 8}
        body["temperature"] = 0
        reference = post(f"{routers[0]}/v1/completions", body)["choices"][0]["text"]  # type: ignore[index]

        # A worker and a router die; both come back at their addresses and serve again.
        for name in ("decode-0", "router-1"):
            os.kill(int(before[name]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        _wait(
            "both restarted",
            lambda: all(
                _children(state_file)[n]["state"] == "running"
                and _children(state_file)[n]["num_restarts"] == 1
                for n in ("decode-0", "router-1")
            ),
        )
        after = _children(state_file)
        seen |= {int(c["pid"]) for c in after.values() if c["pid"]}  # type: ignore[call-overload]
        assert after["decode-0"]["url"] == before["decode-0"]["url"]
        assert after["decode-0"]["last_exit"] == "killed by signal 9"

        def rejoined() -> bool:
            workers = json.loads(urllib.request.urlopen(f"{routers[1]}/health", timeout=5).read())
            return all(w["healthy"] for w in workers["workers"]) and len(workers["workers"]) == 3

        _wait("decode-0 back in router-1's pool", rejoined)
        for router in routers:
            assert post(f"{router}/v1/completions", body)["choices"][0]["text"] == reference  # type: ignore[index]

        status = subprocess.run(
            [sys.executable, "-m", "pdserve", "status", "--url", routers[1]],
            capture_output=True, text=True, env=env, timeout=30, check=False,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        rows = {ln.split()[0]: ln.split() for ln in status.stdout.splitlines() if ln.strip()}
        assert rows["decode-0"][1:3] == ["worker", "running"] and rows["decode-0"][4] == "1"
        assert rows["router-1"][4] == "1" and rows["prefill-0"][4] == "0"
        assert "killed by signal 9" in status.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not any(pid_alive(p) for p in seen)
        # What `up` told the operator about the deaths.
        assert "decode-0 (pid" in errors.read_text() and "restarted (pid" in errors.read_text()
    finally:
        if proc.poll() is None:  # `up` stops its children by PID on SIGTERM
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
