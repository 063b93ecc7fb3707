"""What a KV transport is expected to move, and when a transfer counts as far below it.

Shared by the workers (their per-peer rates from real transfers) and the router (the probe it
runs over every prefill/decode pair when one of them joins): one verdict for both. Pure.
"""

from __future__ import annotations

# Expected GB/s of a transfer between two processes on one host, measured here (README §
# Transports): TCP loopback 2-4, shared memory ~5, NIXL over UCX cma 5-10. Across hosts the
# link decides; these are floors for "far below", not targets.
EXPECTED_GBPS: dict[str, float] = {"tcp": 2.0, "shm": 4.0, "nixl": 4.0}
SLOW_FRACTION = 0.1
# Smaller transfers are dominated by per-transfer latency, not the link: no rate verdict.
MIN_BYTES_FOR_RATE = 16 << 20


def expected_gbps(transport: str) -> float:
    """The rate `transport` should reach (an unknown one is held to TCP's)."""
    return EXPECTED_GBPS.get(transport, EXPECTED_GBPS["tcp"])


def is_slow(transport: str, num_bytes: int, seconds: float) -> bool:
    """True for a transfer big enough to judge that ran far below its transport's rate."""
    if num_bytes < MIN_BYTES_FOR_RATE or seconds <= 0:
        return False
    return num_bytes / seconds / 1e9 < SLOW_FRACTION * expected_gbps(transport)
