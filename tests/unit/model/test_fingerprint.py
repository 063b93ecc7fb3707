"""Fingerprint: every field counts, diff names exactly what differs, the wire form round-trips."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve.errors import ConfigError, FingerprintMismatch
from pdserve.model.fingerprint import Fingerprint
from pdserve.model.kv_layout import KV_LAYOUT_VERSION
from pdserve.model.loader import load_model

BASE = Fingerprint(
    architecture="LlamaForCausalLM",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=2048,
    weights_digest="aa" * 16,
    tokenizer_digest="bb" * 16,
    rope_type="default",
    rope_theta=10000.0,
    rope_scaling="none",
    dtype="float32",
    quantization="none",
    kv_block_size=16,
)


def _changed(value: object) -> object:
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, float):
        return value * 2
    assert isinstance(value, int)
    return value + 1


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Fingerprint)])
def test_each_field_changes_digest_and_diff_names_only_it(field: str) -> None:
    other = dataclasses.replace(BASE, **{field: _changed(getattr(BASE, field))})
    assert other.digest != BASE.digest
    assert set(BASE.diff(other)) == {field}
    assert BASE.diff(other)[field] == (getattr(BASE, field), getattr(other, field))
    with pytest.raises(FingerprintMismatch, match=field) as info:
        BASE.check_compatible(other, context="worker d0")
    assert set(info.value.fields) == {field}
    assert "worker d0" in str(info.value)


def test_digest_is_stable_and_equal_fields_are_compatible() -> None:
    copy = dataclasses.replace(BASE)
    assert copy.digest == BASE.digest
    assert len(BASE.digest) == 32 and int(BASE.digest, 16) >= 0
    assert BASE.diff(copy) == {}
    BASE.check_compatible(copy)
    assert BASE.kv_layout_version == KV_LAYOUT_VERSION


def test_wire_round_trip_and_validation() -> None:
    wire = json.loads(json.dumps(BASE.to_dict()))
    assert wire["digest"] == BASE.digest
    assert Fingerprint.from_dict(wire) == BASE
    with pytest.raises(ConfigError, match="digest"):
        Fingerprint.from_dict({**wire, "digest": "0" * 32})
    with pytest.raises(ConfigError, match="kv_block_size"):
        Fingerprint.from_dict({k: v for k, v in wire.items() if k != "kv_block_size"})
    with pytest.raises(ConfigError, match="num_layers"):
        Fingerprint.from_dict({**wire, "num_layers": "4"})
    with pytest.raises(ConfigError, match="unknown"):
        Fingerprint.from_dict({**wire, "extra": 1})
    # A float field may arrive as a JSON integer.
    no_digest = {k: v for k, v in wire.items() if k != "digest"}
    assert Fingerprint.from_dict({**no_digest, "rope_theta": 10000}) == BASE


def test_loaded_model_settings_change_fingerprint(tiny_model_path: Path, tmp_path: Path) -> None:
    base = load_model(tiny_model_path).fingerprint
    assert base.diff(load_model(tiny_model_path, kv_block_size=32).fingerprint) == {
        "kv_block_size": (16, 32)
    }
    assert set(base.diff(load_model(tiny_model_path, dtype="bfloat16").fingerprint)) == {"dtype"}
    # Different rope scaling, same weights.
    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_model_path, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(config))
    assert set(base.diff(load_model(scaled).fingerprint)) == {"rope_type", "rope_scaling"}
    # Different weights: one element nudged.
    tensors = load_file(str(scaled / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["model.norm.weight"][0] += 1e-3
    save_file(tensors, str(scaled / "model.safetensors"), metadata={"format": "pt"})
    (scaled / "config.json").write_text((tiny_model_path / "config.json").read_text())
    assert set(base.diff(load_model(scaled).fingerprint)) == {"weights_digest"}
