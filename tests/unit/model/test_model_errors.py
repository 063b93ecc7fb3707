"""Broken model folders: each fault gives its typed error, naming the file and the field/tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_helpers import prefill_logits
from safetensors.torch import load_file, save_file

from pdserve.errors import (
    ConfigError,
    ModelConfigError,
    ModelError,
    ModelFileMissing,
    UnsupportedArchitecture,
    WeightShapeMismatch,
)
from pdserve.model.loader import load_model


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def _edit_weights(folder: Path, **changes: torch.Tensor | None) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, str(folder / "model.safetensors"))


def test_small_folder_loads(small_folder: Path) -> None:
    model = load_model(small_folder)
    assert model.config.num_layers == 2
    assert model.eos_token_ids == (1,)
    assert model.path == small_folder


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("config.json", ModelFileMissing),
        ("tokenizer.json", ModelFileMissing),
        ("model.safetensors", ModelFileMissing),
    ],
)
def test_missing_file(small_folder: Path, name: str, error: type[ModelError]) -> None:
    (small_folder / name).unlink()
    with pytest.raises(error, match=name.replace(".", r"\.")) as info:
        load_model(small_folder)
    assert str(small_folder / name) in str(info.value)


def test_unsupported_architecture(small_folder: Path) -> None:
    _edit_config(small_folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture, match=r"config\.json.*GPT2LMHeadModel"):
        load_model(small_folder)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"vocab_size": -3}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"eos_token_id": "</s>"}, "eos_token_id"),
    ],
)
def test_bad_config_field(small_folder: Path, changes: dict[str, object], field: str) -> None:
    _edit_config(small_folder, **changes)
    with pytest.raises(ModelConfigError, match=rf"config\.json: field '[\w.]*{field}'") as info:
        load_model(small_folder)
    assert info.value.file == "config.json"


def test_config_not_json(small_folder: Path) -> None:
    (small_folder / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        load_model(small_folder)


def test_wrong_tensor_shape(small_folder: Path) -> None:
    _edit_weights(small_folder, model__layers__1__mlp__up_proj__weight=torch.zeros(65, 32))
    with pytest.raises(WeightShapeMismatch) as info:
        load_model(small_folder)
    message = str(info.value)
    assert "model.safetensors" in message
    assert "model.layers.1.mlp.up_proj.weight" in message
    assert "[65, 32]" in message and "[64, 32]" in message


def test_missing_tensor(small_folder: Path) -> None:
    _edit_weights(small_folder, model__norm__weight=None)
    with pytest.raises(
        ModelConfigError, match=r"model\.safetensors.*'model\.norm\.weight'.*missing"
    ):
        load_model(small_folder)


def test_unexpected_tensor(small_folder: Path) -> None:
    _edit_weights(small_folder, model__layers__2__input_layernorm__weight=torch.ones(32))
    with pytest.raises(ModelConfigError, match=r"model\.layers\.2\.input_layernorm\.weight"):
        load_model(small_folder)


def test_corrupt_safetensors(small_folder: Path) -> None:
    (small_folder / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!")
    with pytest.raises(ModelConfigError, match=r"model\.safetensors"):
        load_model(small_folder)


def test_tokenizer_larger_than_vocab(small_folder: Path) -> None:
    _edit_config(small_folder, vocab_size=100)
    with pytest.raises(ModelConfigError, match=r"tokenizer\.json.*vocab_size=100"):
        load_model(small_folder)


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        ({"dtype": "float16"}, "float16"),
        ({"quantization": "int4"}, "int4"),
        ({"kv_block_size": 0}, "0"),
    ],
)
def test_bad_load_arguments(small_folder: Path, kwargs: dict[str, object], value: str) -> None:
    with pytest.raises(ConfigError, match=value):
        load_model(small_folder, **kwargs)  # type: ignore[arg-type]


def _shard(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors").unlink()
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_equals_single_file(small_folder: Path) -> None:
    single = load_model(small_folder)
    _shard(small_folder)
    sharded = load_model(small_folder)
    assert sharded.fingerprint == single.fingerprint
    prompt = [[3, 4, 5, 6, 7]]
    assert torch.equal(
        prefill_logits(single.module, prompt, 4), prefill_logits(sharded.module, prompt, 4)
    )
    (small_folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFileMissing, match=r"model-00002-of-00002\.safetensors"):
        load_model(small_folder)


def test_tied_checkpoint_may_carry_lm_head(small_folder: Path) -> None:
    _edit_config(small_folder, tie_word_embeddings=True)
    model = load_model(small_folder)  # lm_head.weight present but ignored
    assert model.module.lm_head is None
