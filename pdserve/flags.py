"""The engine's flags, shared by several commands (the router's are in `router/flags.py`).

`pdserve worker` declares them; `pdserve up` declares them too and passes
the values on to its children (`cli.forwarded`), so the cluster it starts takes every flag
the separate processes take. Light on purpose (no torch, no aiohttp): `pdserve --help` and
`pdserve status` import it.
"""

from __future__ import annotations

import argparse

from pdserve.config import DEVICES, EngineConfig

_ENGINE_DEFAULTS = EngineConfig()


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's scheduling flags (`pdserve up` takes them too and passes them on)."""
    e = p.add_argument_group("engine")
    e.add_argument(
        "--max-num-batched-tokens", type=int, default=_ENGINE_DEFAULTS.max_num_batched_tokens
    )
    e.add_argument(
        "--max-num-seqs",
        type=int,
        default=_ENGINE_DEFAULTS.max_num_seqs,
        help="requests running at once",
    )
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
    )
    e.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS.enable_prefix_caching,
        help="reuse KV blocks of earlier requests with the same prefix",
    )
    e.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS.enable_chunked_prefill,
        help="split long prompts into chunks that share steps with decoding",
    )
    e.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where the engine runs: auto is CUDA when torch has it and a GPU is visible",
    )
    e.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS.cuda_graphs,
        help="on CUDA, replay decode steps as captured graphs",
    )
    e.add_argument(
        "--kv-host-staging",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS.kv_host_staging,
        help="hand KV off through a host mirror of the cache (always so on a GPU; on the CPU"
        " for tests of that path)",
    )
    e.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=_ENGINE_DEFAULTS.batch_invariant,
        help="bitwise-reproducible logits whatever the batch (costs throughput; see README)",
    )
