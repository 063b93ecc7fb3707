"""The GPU check's runner: steps in order, each one's JSON written as it ends, a failing step
recorded without stopping the next, the budget honoured, a rerun keeping earlier steps; and the
roofline's arithmetic (bandwidth table, bytes a decode step reads)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdlab.bench.command import build_parser
from pdlab.bench.gpu_check import STEPS, run
from pdlab.bench.gpu_check.roofline import peak_bandwidth, weight_bytes_per_step


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    argv = ["gpu-check", "--device", "cpu", "--quick", "--out", str(tmp_path / "out"), *extra]
    return build_parser().parse_args(argv)


def _fake_steps(monkeypatch: pytest.MonkeyPatch, calls: list[str], fail: str = "") -> None:
    def lookup(name: str) -> Any:
        def step(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
            calls.append(name)
            # What earlier steps wrote is already on disk when the next one starts.
            done = json.loads((Path(args.out) / "gpu_check.json").read_text())["steps"]
            if name == fail:
                raise RuntimeError(f"{name} broke")
            return {"passed": True, "steps_on_disk": list(done)}

        return step

    monkeypatch.setattr(run, "step_function", lookup)


def test_every_step_runs_in_order_and_is_on_disk_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _fake_steps(monkeypatch, calls)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu_check.json").write_text(json.dumps({"steps": {}}))
    assert run.run_gpu_check(_args(tmp_path)) == 0
    assert calls == list(STEPS)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["passed"] is True and list(report["steps"]) == list(STEPS)
    assert report["steps"]["roofline"]["steps_on_disk"] == ["parity"]
    assert report["environment"]["device"] == "cpu"
    for i, name in enumerate(STEPS):
        assert json.loads((tmp_path / "out" / f"{i + 1:02d}-{name}.json").read_text())["passed"]


def test_a_failing_step_is_recorded_and_the_next_one_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _fake_steps(monkeypatch, calls, fail="roofline")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu_check.json").write_text(json.dumps({"steps": {}}))
    assert run.run_gpu_check(_args(tmp_path)) == 1
    assert calls == list(STEPS)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    failed = report["steps"]["roofline"]
    assert failed["passed"] is False and failed["error"] == "RuntimeError: roofline broke"
    assert report["passed"] is False


def test_no_step_starts_after_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _fake_steps(monkeypatch, calls)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu_check.json").write_text(json.dumps({"steps": {}}))
    assert run.run_gpu_check(_args(tmp_path, "--budget-s", "0")) == 1
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert calls == []
    assert all(r["skipped"].startswith("budget") for r in report["steps"].values())


def test_a_rerun_of_one_step_keeps_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _fake_steps(monkeypatch, calls, fail="parity")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu_check.json").write_text(json.dumps({"steps": {}}))
    assert run.run_gpu_check(_args(tmp_path)) == 1
    _fake_steps(monkeypatch, calls)
    calls.clear()
    assert run.run_gpu_check(_args(tmp_path, "--step", "parity")) == 0
    assert calls == ["parity"]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert list(report["steps"]) == list(STEPS) and report["passed"] is True


def test_an_unknown_step_is_refused_by_the_parser(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _args(tmp_path, "--step", "roofline2")


@pytest.mark.parametrize(
    ("name", "tb_s"),
    [
        ("NVIDIA H200", 4.8),
        ("NVIDIA H100 80GB HBM3", 3.35),
        ("NVIDIA H100 PCIe", 2.0),
        ("NVIDIA H100 NVL", 3.9),
        ("NVIDIA A100-SXM4-80GB", 2.039),
    ],
)
def test_published_bandwidth_by_device_name(name: str, tb_s: float) -> None:
    assert peak_bandwidth(name) == pytest.approx(tb_s * 1e12)


def test_an_unknown_device_has_no_published_bandwidth() -> None:
    assert peak_bandwidth("cpu") is None and peak_bandwidth("NVIDIA GeForce RTX 4090") is None


class _Tiny(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(100, 8, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)
        self.lm_head = None if tied else torch.nn.Linear(8, 100, bias=False, dtype=torch.bfloat16)


def test_a_decode_step_reads_a_tied_embedding_once_and_an_untied_one_not_at_all() -> None:
    # Tied: the embedding matrix is the LM head, read in full. Untied: only the head is.
    assert weight_bytes_per_step(_Tiny(tied=True), tied=True) == (800 + 64) * 2
    assert weight_bytes_per_step(_Tiny(tied=False), tied=False) == (64 + 800) * 2


def test_the_llama_1b_shape_reads_about_2_47_gb_per_step() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdlab.bench.model_shapes import SHAPES

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES["llama-3.2-1b"])).to(torch.bfloat16)
    read = weight_bytes_per_step(model.model, tied=True)
    # 1.236e9 parameters of 2 bytes: 515 µs at an H200's 4.8 TB/s (the issue's figure).
    assert read == pytest.approx(2.47e9, rel=0.01)
    assert read / 4.8e12 * 1e6 == pytest.approx(515, rel=0.01)
