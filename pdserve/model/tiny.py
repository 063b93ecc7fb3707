"""The embedded default model: a tiny random Llama built on first use, identical everywhere.

`build_tiny_model(out_dir, seed)` writes a complete Hugging Face folder (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json) in the
LlamaForCausalLM layout, so the same loader, forward and tests serve it and real checkpoints.
Its weights are random (the text it generates is noise), but deterministic: the tokenizer is a
byte-level BPE trained on `corpus.txt` shipped in the package, weights come from a seeded
`torch.Generator` in sorted name order, and every file is written with sorted keys and fixed
metadata. Same seed -> the same bytes and the same fingerprint in every process, which lets a
prefill and a decode worker started separately agree without sharing files.

`default_model_path()` builds it once into a cache directory ($PDSERVE_CACHE, else
~/.cache/pdserve) as `tiny-v<TINY_VERSION>`; it builds in a temporary sibling and renames it
into place, so concurrent processes never see a half-written folder (the loser of the race
discards its copy). Bump TINY_VERSION whenever the output bytes change.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.model.config import parse_config

if TYPE_CHECKING:
    import torch

TINY_VERSION = 2
DEFAULT_SEED = 0
BOS, EOS = "<s>", "</s>"
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}
# Role markers in plain text: the BPE learns them as ordinary pieces. Tools (transformers'
# `tools=`) and calls are written Hermes-style, `<tool_call>` JSON `</tool_call>`, which the
# router's default --tool-call-parser reads; messages without tools render as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nYou may call these functions. To call one, answer with"
    ' <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call>\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call>\n{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_text() -> str:
    """The English training text shipped as package data."""
    return resources.files("pdserve.model").joinpath("corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int = 2048) -> HFTokenizer:
    """A byte-level BPE with `<s>`=0 and `</s>`=1, trained on the shipped corpus.

    Every byte is in the base alphabet, so any text encodes (no unknown token). Training is
    deterministic for a given `tokenizers` version (checked across processes by the tests).
    """
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    return tokenizer


def write_tokenizer(out_dir: str | Path, vocab_size: int = 2048) -> None:
    """Write tokenizer.json and tokenizer_config.json (BOS added, chat template) to out_dir."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(train_tokenizer(vocab_size).to_str(), encoding="utf-8")
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for an HF Llama config dict, in sorted-name generation order.

    Linear weights are N(0, 1/fan_in) so activations keep unit scale through the layers and
    the logits spread enough for greedy decoding to have clear winners; embeddings are N(0, 1);
    norm weights are 1.
    """
    # torch only when weights are made: a router that finds the model cached never loads it.
    import torch

    from pdserve.model.weights import expected_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(expected_shapes(parse_config(config)).items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
            continue
        std = 1.0 if name == "model.embed_tokens.weight" else shape[-1] ** -0.5
        tensors[name] = torch.randn(shape, generator=generator) * std
    return tensors


def build_tiny_model(out_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """Write the tiny model's HF folder into out_dir (created if needed); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", TINY_CONFIG)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": TINY_CONFIG["bos_token_id"], "eos_token_id": TINY_CONFIG["eos_token_id"]},
    )
    write_tokenizer(out, TINY_CONFIG["vocab_size"])
    from safetensors.torch import save_file

    from pdserve.model.weights import SINGLE_FILE

    tensors = random_weights(TINY_CONFIG, seed)
    # Fixed metadata; safetensors orders the header and data itself, independent of dict order.
    save_file(dict(sorted(tensors.items())), str(out / SINGLE_FILE), metadata={"format": "pt"})
    for path in out.iterdir():
        # Readable by every user of a shared cache (safetensors writes the file as 0600).
        path.chmod(0o644)
    return out


def cache_dir() -> Path:
    """$PDSERVE_CACHE, else ~/.cache/pdserve."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


def default_model_path() -> Path:
    """The embedded default model's folder, built atomically on first use."""
    base = cache_dir()
    final = base / f"tiny-v{TINY_VERSION}"
    if final.is_dir():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-v{TINY_VERSION}-", dir=base))
    try:
        build_tiny_model(tmp, DEFAULT_SEED)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its (identical) copy first.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
