"""`ModelConfig`: the shapes and constants of a Llama-family checkpoint, read from its folder.

Parsed once from a Hugging Face `config.json` (plus the eos ids of `generation_config.json`) and
immutable afterwards; everything downstream (weights, forward, fingerprint, KV cache sizing)
reads this object, never the raw JSON. Every field is validated here, so a bad folder fails at
load with the file and field named (`ModelConfigError`), not as a shape error inside a matmul.

Supported: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM, i.e. pre-norm decoders with
RMSNorm, rotate-half RoPE, GQA and a SiLU-gated MLP. RoPE scaling: none, "linear" and "llama3",
given either the transformers<5 way (`rope_scaling` + top-level `rope_theta`) or the
transformers 5 way (`rope_parameters` with `rope_type` and `rope_theta`).

`sliding_window` (Mistral, Qwen2) is ignored on purpose: attention is always full causal. That
is exact for contexts up to the window (4096 or more in the published checkpoints), and the
paged attention kernel has no window mask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ModelConfigError, ModelFileMissing, UnsupportedArchitecture

# The model class of each supported `model_type`; the type picks it when `architectures` is
# absent (a config saved on its own, without a model class).
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES.values())
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. "linear" uses only `factor`; "llama3" uses every field."""

    rope_type: str
    factor: float
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0

    def canonical(self) -> str:
        """Stable text form (sorted JSON of the fields the type uses), for fingerprints."""
        fields: dict[str, object] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            fields["low_freq_factor"] = self.low_freq_factor
            fields["high_freq_factor"] = self.high_freq_factor
            fields["original_max_position_embeddings"] = self.original_max_position_embeddings
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture and shapes of one checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    # GQA: each KV head serves num_heads // num_kv_heads query heads.
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None means plain RoPE ("default").
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    # lm_head shares the embedding matrix (no lm_head.weight in the checkpoint).
    tie_word_embeddings: bool
    # q/k/v projections carry a bias (always for Qwen2, `attention_bias` for Llama/Mistral).
    attention_bias: bool
    # o_proj carries a bias (Llama/Mistral `attention_bias`; never for Qwen2).
    o_proj_bias: bool
    bos_token_id: int | None
    # config.json's eos ids, then generation_config.json's, without repeats.
    eos_token_ids: tuple[int, ...]

    @property
    def rope_type(self) -> str:
        """The RoPE variant: "default", "linear" or "llama3"."""
        return "default" if self.rope_scaling is None else self.rope_scaling.rope_type


def load_config(folder: str | Path) -> ModelConfig:
    """Parse and validate `config.json` (and `generation_config.json` if present) in `folder`."""
    folder = Path(folder)
    raw = read_json_object(folder / CONFIG_FILE, "model config", required=True)
    generation = read_json_object(
        folder / GENERATION_CONFIG_FILE, "generation config", required=False
    )
    return parse_config(raw, generation)


def parse_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a `ModelConfig` from already-decoded config and generation-config JSON objects."""
    f = _Fields(CONFIG_FILE, raw)
    architecture = _architecture(raw)
    hidden_size = f.pos_int("hidden_size")
    num_heads = f.pos_int("num_attention_heads")
    num_kv_heads = f.pos_int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            CONFIG_FILE,
            "num_key_value_heads",
            f"{num_kv_heads} does not divide num_attention_heads={num_heads}",
        )
    head_dim = f.pos_int("head_dim", default=0) or hidden_size // num_heads
    if head_dim % 2 or (raw.get("head_dim") is None and hidden_size % num_heads):
        raise ModelConfigError(
            CONFIG_FILE, "head_dim", f"{head_dim} must be even and divide hidden_size exactly"
        )
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelConfigError(CONFIG_FILE, "hidden_act", f"{hidden_act!r} (only 'silu')")
    if raw.get("mlp_bias"):
        raise ModelConfigError(CONFIG_FILE, "mlp_bias", "MLP biases are not supported")
    qwen2 = architecture == "Qwen2ForCausalLM"
    bias_flag = f.boolean("attention_bias", default=False)
    max_pos = f.pos_int("max_position_embeddings")
    rope_theta, rope_scaling = _rope(f, raw, max_pos)
    gen = _Fields(GENERATION_CONFIG_FILE, generation or {})
    eos = _dedupe(f.token_ids("eos_token_id") + gen.token_ids("eos_token_id"))
    bos = f.token_ids("bos_token_id") or gen.token_ids("bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=f.pos_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=f.pos_int("intermediate_size"),
        num_layers=f.pos_int("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.pos_float("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=f.boolean("tie_word_embeddings", default=False),
        attention_bias=qwen2 or bias_flag,
        o_proj_bias=bias_flag and not qwen2,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos,
    )


def read_json_object(path: Path, what: str, required: bool) -> dict[str, Any]:
    """A model-folder JSON file as a dict; {} when absent and optional, typed errors otherwise."""
    if not path.is_file():
        if required:
            raise ModelFileMissing(str(path), what)
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(path.name, "<file>", f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(path.name, "<file>", "top level is not a JSON object")
    return data


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs is None:
        model_type = raw.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ModelConfigError(
                CONFIG_FILE, "architectures", "missing, and model_type does not name a model"
            )
        return _MODEL_TYPES[model_type]
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise ModelConfigError(CONFIG_FILE, "architectures", f"expected one name, got {archs!r}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(CONFIG_FILE, archs[0], SUPPORTED_ARCHITECTURES)
    return archs[0]


def _rope(f: _Fields, raw: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
    key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ModelConfigError(CONFIG_FILE, key, f"expected an object, got {params!r}")
    p = _Fields(CONFIG_FILE, params, prefix=f"{key}.")
    theta = p.pos_float("rope_theta", default=0.0) or f.pos_float("rope_theta", default=10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelConfigError(CONFIG_FILE, "partial_rotary_factor", f"{partial!r} (only 1.0)")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", p.pos_float("factor"))
    if rope_type == "llama3":
        low = p.pos_float("low_freq_factor")
        high = p.pos_float("high_freq_factor")
        if high <= low:
            raise ModelConfigError(
                CONFIG_FILE, f"{key}.high_freq_factor", f"{high} must exceed low_freq_factor={low}"
            )
        original = p.pos_int("original_max_position_embeddings", default=max_pos)
        return theta, RopeScaling("llama3", p.pos_float("factor"), low, high, original)
    raise ModelConfigError(
        CONFIG_FILE, f"{key}.rope_type", f"{rope_type!r} (supported: default, linear, llama3)"
    )


def _dedupe(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


class _Fields:
    """Typed access to a JSON object; every failure names the file and the (dotted) field."""

    def __init__(self, file: str, raw: dict[str, Any], prefix: str = "") -> None:
        self.file = file
        self.raw = raw
        self.prefix = prefix

    def _fail(self, name: str, detail: str) -> ModelConfigError:
        return ModelConfigError(self.file, self.prefix + name, detail)

    def _positive(
        self, name: str, default: float | None, kinds: tuple[type[float], ...], what: str
    ) -> float:
        """A present value must be one of `kinds` and > 0; absent, `default` (None: required)."""
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise self._fail(name, "missing")
            return default
        # bool is an int subclass: `true` is not a layer count.
        if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
            raise self._fail(name, f"expected {what}, got {value!r}")
        return value

    def pos_int(self, name: str, default: int | None = None) -> int:
        """A positive integer; absent, `default` is returned (None: required)."""
        return int(self._positive(name, default, (int,), "a positive integer"))

    def pos_float(self, name: str, default: float | None = None) -> float:
        """A positive number; absent, `default` is returned (None: required)."""
        return float(self._positive(name, default, (int, float), "a positive number"))

    def boolean(self, name: str, default: bool) -> bool:
        """true/false; absent (or null), `default`."""
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(name, f"expected true or false, got {value!r}")
        return value

    def token_ids(self, name: str) -> tuple[int, ...]:
        """One token id or a list of them; absent, ()."""
        value = self.raw.get(name)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise self._fail(name, f"expected a token id or a list of them, got {value!r}")
        return tuple(values)
