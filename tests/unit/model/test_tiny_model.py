"""The embedded tiny model: bit-identical across builds and processes, and a real HF folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import prefill_logits, relative_error

import pdserve
from pdserve.model.loader import load_model
from pdserve.model.tiny import TINY_VERSION, build_tiny_model

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_dims_and_size(tiny_model_path: Path) -> None:
    model = load_model(tiny_model_path)
    c = model.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        256,
        4,
        4,
        2,
        64,
    )
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (768, 2048, 2048)
    assert model.tokenizer.vocab_size == 2048
    assert sorted(p.name for p in tiny_model_path.iterdir()) == FILES
    assert sum(p.stat().st_size for p in tiny_model_path.iterdir()) < 20 * 2**20
    assert tiny_model_path.name == f"tiny-v{TINY_VERSION}"


def test_same_seed_same_bytes_in_process_and_across_processes(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    # Two concurrent processes race to build the default model into one fresh cache: both
    # succeed, and the surviving folder is byte-identical to in-process builds.
    repo_root = Path(pdserve.__file__).resolve().parent.parent
    pythonpath = os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": pythonpath}
    code = "from pdserve.model.tiny import default_model_path; print(default_model_path())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs[0] == outputs[1] == str(tmp_path / "cache" / f"tiny-v{TINY_VERSION}")
    assert sorted(os.listdir(tmp_path / "cache")) == [f"tiny-v{TINY_VERSION}"]  # no temp left
    expected = _files(a)
    assert _files(b) == expected
    assert _files(Path(outputs[0])) == expected
    assert _files(tiny_model_path) == expected
    assert load_model(a).fingerprint.digest == load_model(Path(outputs[0])).fingerprint.digest


def test_other_seed_other_weights(tmp_path: Path, tiny_model_path: Path) -> None:
    other = load_model(build_tiny_model(tmp_path / "s1", seed=1)).fingerprint
    assert set(load_model(tiny_model_path).fingerprint.diff(other)) == {"weights_digest"}


def test_transformers_loads_it_with_equal_logits(tiny_model_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    model = load_model(tiny_model_path)
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    assert relative_error(prefill_logits(model.module, [prompt], 16), theirs) < 1e-4
