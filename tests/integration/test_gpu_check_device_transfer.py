"""The GPU check's device-transfer step on the CPU (`--quick`): a second process exports a
KV-shaped cache, this one maps it, copies blocks to other ids and checks them by checksum; a
flipped byte and a block the exporter reused after offering it are both caught, and the
exporter is gone afterwards. (On the CPU the mapping is the memfd stand-in for CUDA IPC.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdlab.bench.gpu_check import device_transfer


def test_blocks_cross_checked_and_both_faults_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    popen = device_transfer.subprocess.Popen

    def spy(*a: object, **k: object) -> object:
        proc = popen(*a, **k)  # type: ignore[call-overload]
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(device_transfer.subprocess, "Popen", spy)
    args = argparse.Namespace(device="cpu", dtype="float32", quick=True, out=str(tmp_path))
    report = device_transfer.run(tmp_path, args)
    assert report["mechanism"] == "memfd (CPU stand-in)"
    assert [r["bytes"] for r in report["sizes"]] == [4 << 20, 32 << 20]
    for row in report["sizes"]:
        assert row["checksums_match"], row
        assert min(row[k] for k in row if k.endswith("gb_per_s")) > 0, row
    assert report["kernel_matches_reference"] is None  # checked on a GPU only
    assert report["corruption_detected"] and report["stale_block_detected"]
    assert report["exporter_exit"] == 0 and report["passed"]
    # Waited for and reaped: no process, not even a zombie, is left under its pid.
    assert len(started) == 1 and not Path(f"/proc/{started[0]}").exists()
