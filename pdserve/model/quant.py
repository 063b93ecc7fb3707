"""Weight-only int8 quantization of linear layers (per output channel, symmetric).

Each row r of a weight W [out, in] is stored as int8 q[r] = round(W[r] / s[r]) with
s[r] = max|W[r]| / 127, so q is in [-127, 127] and |W - q * s| <= s / 2 elementwise. Activations
stay in the model dtype: the forward casts q to the activation dtype, multiplies, and applies
the (float32) scale to the output (y = (x @ q.T) * s, which equals x @ (q * s).T because s is
per output row). Embeddings and norms are never quantized; a tied lm_head stays in the model
dtype because it is the embedding matrix.

Quantization is part of the fingerprint: an int8 engine's KV differs from a float engine's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Largest int8 magnitude used: symmetric, so -128 is never produced.
_QMAX = 127.0


class Int8Linear(nn.Module):
    """A linear layer holding an int8 weight and a per-output-row scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        # [out] one scale per output channel; an all-zero row keeps scale 1 (q is then 0).
        absmax = w.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax / _QMAX, torch.ones_like(absmax))
        # [out, in] int8 in [-127, 127]
        q = torch.round(w / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
        self.weight_int8: torch.Tensor
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight_int8", q)
        # float32 even in a bfloat16 model: a bf16 scale would add ~0.4% error per row.
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] this layer computes with (q * scale)."""
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        # int8 values are exact in bfloat16 too (8 significant bits), so only x @ q rounds.
        y = (F.linear(x, self.weight_int8.to(x.dtype)) * self.scale).to(x.dtype)  # [..., out]
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y


def quantize_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` inside `module` with an `Int8Linear`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child.weight, child.bias))
            count += 1
        else:
            count += quantize_linears(child)
    return count
