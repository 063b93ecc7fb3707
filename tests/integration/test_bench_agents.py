"""`pdserve bench agents` end to end on one small cluster: every turn a valid forced call, the
prompt growing by the call and its result, and the affinity cluster's prefix cache holding
every block of what the previous turn computed (the hit rate is a count, not a timing)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(200)
def test_agent_sessions_keep_their_kv(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "agents.json"
    argv = [sys.executable, "-m", "pdserve", "bench", "agents", "--sessions", "2", "--turns",
            "4", "--prefill", "1", "--decode", "1", "--routing", "affinity", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PDSERVE_CACHE": str(tiny_model_path.parent)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    [run] = report["results"]
    turns = run["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    prompts = [t["prompt_tokens"] for t in turns]
    assert all(b > a for a, b in itertools.pairwise(prompts)), prompts
    assert all(t["reusable_tokens"] > 0 for t in turns[1:])
    # One decode worker holds every session: whatever was computed and fits a block is cached.
    assert report["summary"]["hit_rate_affinity_from_turn_3"] >= 0.9, turns
