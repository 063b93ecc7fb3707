"""Fixtures for the model tests: a small tokenizer (trained once) and a small model folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from pdserve.model.tiny import random_weights, write_tokenizer

# Byte-level BPE needs 256 base tokens + 2 specials; a few merges on top.
TEST_TOKENIZER_VOCAB = 300


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with tokenizer.json + tokenizer_config.json of TEST_TOKENIZER_VOCAB tokens."""
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, TEST_TOKENIZER_VOCAB)
    return folder


SMALL_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


@pytest.fixture
def small_folder(tmp_path: Path, tokenizer_dir: Path) -> Path:
    """A complete small Llama HF folder (random weights) that tests may break at will."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    save_file(random_weights(SMALL_CONFIG, seed=0), str(folder / "model.safetensors"))
    return folder
