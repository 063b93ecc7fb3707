"""Weight-only int8: the layer's arithmetic, and the whole tiny model against float32.

Tolerances, reasoned: a row with n Gaussian weights has absmax ≈ 3σ (n = 256..768), so the
rounding step is ≈ 3σ/127 and the per-weight error is uniform with std ≈ 0.007σ: each matmul
output moves by ≈ 0.7% of its scale. Through 4 layers and the LM head that compounds to ≈ 2%
of the largest logit (measured 1.6-1.9%), so the test allows 5%. Teacher-forced argmax agreement
(measured 95-96% over 256 positions) only flips where the top-2 margin is below that error; the
bound 85% tolerates other prompts yet fails for any real bug (a wrong scale or transposed row
gives near-random agreement, ~1/2048).
"""

from __future__ import annotations

from pathlib import Path

import torch
from model_helpers import prefill_logits, relative_error
from torch import nn

from pdserve.model.loader import load_model
from pdserve.model.quant import Int8Linear, quantize_linears
from pdserve.model.tiny import corpus_text


def test_int8_linear_rounds_each_row_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=g)
    weight[3] = 0.0  # an all-zero row must not divide by zero
    bias = torch.randn(48, generator=g)
    layer = Int8Linear(weight, bias)
    assert layer.weight_int8.dtype == torch.int8
    assert int(layer.weight_int8.abs().max()) == 127
    assert torch.equal(
        layer.scale, torch.where(weight.abs().amax(1) > 0, weight.abs().amax(1) / 127, 1.0)
    )
    err = (layer.dequantized() - weight).abs()
    assert bool((err <= layer.scale[:, None] / 2 + 1e-7).all())
    x = torch.randn(5, 32, generator=g)
    expected = x @ layer.dequantized().T + bias
    assert torch.allclose(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_quantize_linears_replaces_only_linear_layers() -> None:
    module = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    assert quantize_linears(module) == 2
    assert isinstance(module[0], nn.Embedding)
    assert isinstance(module[1], Int8Linear)
    assert isinstance(module[2][0], Int8Linear)


def test_int8_model_logits_and_greedy_close_to_float(tiny_model_path: Path) -> None:
    full = load_model(tiny_model_path)
    int8 = load_model(tiny_model_path, quantization="int8")
    layer = int8.module.layers[0]
    assert isinstance(layer.qkv_proj, Int8Linear)
    assert isinstance(int8.module.lm_head, Int8Linear)
    assert isinstance(int8.module.embed_tokens, nn.Embedding)
    prompt = full.tokenizer.encode(corpus_text()[:2000])[:256]
    a = prefill_logits(full.module, [prompt], block_size=16)
    b = prefill_logits(int8.module, [prompt], block_size=16)
    assert relative_error(b, a) < 0.05
    agreement = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    assert agreement >= 0.85
    assert int8.fingerprint.quantization == "int8"
    assert full.fingerprint.diff(int8.fingerprint) == {"quantization": ("none", "int8")}
