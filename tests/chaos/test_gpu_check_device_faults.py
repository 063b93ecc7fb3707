"""The GPU check's fault step on the CPU (`--quick`): one prefill and three decode workers; under
a concurrent load decode-0 SIGKILLs itself at its first KV chunk while decode-1 is SIGSTOPped
inside its first KV receive for longer than the lease TTL. Users see every answer identical
to the offline engine's, the killed worker alone is dead, nothing stays pinned, and the pause
really outlasted the lease (measured from the SIGSTOP to the SIGCONT, not assumed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdlab.bench.gpu_check import device_faults


def test_a_kill_and_a_pause_mid_transfer_leave_every_answer_right(tmp_path: Path) -> None:
    args = argparse.Namespace(device="cpu", dtype="float32", quick=True, out=str(tmp_path))
    report = device_faults.run(tmp_path, args)
    assert report["errors"] == []
    assert report["completed_identical"] == report["requests"] == 6
    assert report["dead_workers"] == ["decode-0"]
    assert report["paused_s"] is not None and report["paused_s"] > report["lease_ttl_s"]
    assert report["leaked_blocks"] == 0
    # No allocator on the CPU: the figures are absent, and the step says so.
    assert report["allocator"] == "none (cpu)"
    assert report["passed"] is True
