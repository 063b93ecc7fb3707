"""`--device`: auto, cpu and cuda resolve as documented, an explicit cuda that cannot be had is
an error naming why, and the fingerprint keeps CPU and CUDA KV apart without changing what
older (CPU-only) builds send."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.config import ModelLoadConfig
from pdserve.errors import ConfigError
from pdserve.model.device import resolve_device
from pdserve.model.fingerprint import Fingerprint
from pdserve.model.loader import load_model


def gpu() -> tuple[bool, str]:
    return True, ""


def no_gpu() -> tuple[bool, str]:
    return False, "this torch build (x) has no CUDA"


def test_auto_is_cuda_only_where_a_gpu_is_usable() -> None:
    assert resolve_device("auto", cuda_state=gpu) == torch.device("cuda", 0)
    assert resolve_device("auto", cuda_state=no_gpu) == torch.device("cpu")
    assert resolve_device("cpu", cuda_state=gpu) == torch.device("cpu")


def test_an_explicit_cuda_without_a_gpu_fails_naming_why() -> None:
    with pytest.raises(ConfigError, match=r"device: cuda was asked for, but this torch build"):
        resolve_device("cuda", cuda_state=no_gpu)


def test_float16_is_served_on_cuda_only() -> None:
    assert resolve_device("cuda", "float16", cuda_state=gpu).type == "cuda"
    with pytest.raises(ConfigError, match=r"dtype: 'float16' is not served on cpu"):
        resolve_device("auto", "float16", cuda_state=no_gpu)


def test_unknown_devices_are_refused_at_config_time() -> None:
    with pytest.raises(ConfigError, match="device: 'tpu'"):
        ModelLoadConfig(device="tpu")
    with pytest.raises(ConfigError, match="device: 'gpu'"):
        resolve_device("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
def test_loading_on_cuda_without_a_gpu_fails_before_reading_weights(tiny_model_path: Path) -> None:
    with pytest.raises(ConfigError, match="device: cuda"):
        load_model(tiny_model_path, device="cuda")


def test_the_fingerprint_separates_device_kinds(tiny_model_path: Path) -> None:
    cpu = load_model(tiny_model_path, device="cpu").fingerprint
    assert cpu.device == "cpu"
    wire = cpu.to_dict()
    # A CPU engine's wire form and digest are what builds before the field sent and expect.
    assert "device" not in wire
    assert Fingerprint.from_dict(wire) == cpu
    cuda = Fingerprint(**{**{f: getattr(cpu, f) for f in cpu.__slots__}, "device": "cuda"})
    assert cuda.digest != cpu.digest
    assert set(cpu.diff(cuda)) == {"device"}
    assert Fingerprint.from_dict(cuda.to_dict()) == cuda
