"""The KV cache layout's version: part of the build fingerprint, so that engines whose blocks
are laid out differently never exchange KV. The layout itself is drawn in `attention.py`.

Torch-free, so that the fingerprint (which the router compares) needs no torch.
"""

from __future__ import annotations

# 1: [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim], block-major.
KV_LAYOUT_VERSION = 1
