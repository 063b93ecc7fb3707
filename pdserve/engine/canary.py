"""The KV canary: checking received KV by value before trusting it (invariant 8).

Checksums prove the bytes arrived as sent; they cannot prove the decode side reads the right
blocks with a compatible model. So both sides compute the same thing from the KV: the logits of
the last prompt position, recomputed by a one-token forward over the KV cached for every
earlier position. The prefill side computes it right after its prefill (before anything can
damage the held KV) and sends a compact `ValueDigest` in the transfer's Commit; the decode side
computes it from the blocks it received (and any of its own cached prefix blocks) before its
first token and compares. A stale or shifted block table, a model difference the fingerprint
missed (RoPE scaling, quantization), or KV damaged before its checksum was taken all change
those logits.

The forward writes the recomputed position's K/V into the cache's scratch block (a copy of the
request's last block), never into blocks a request owns: other requests sharing a prefix block
must not see a single bit change.

Comparison (`compare`): equal logits hashes are an exact match (the same build on the same KV
computes bit-identical float32 logits). Otherwise the logits at the sender's top-k ids must
agree within a tolerance for the KV dtype, and no other token may beat the sender's best by
more than it: KV the decode side computed itself (its own prefix cache) may differ in the last
bits from the prefill side's, which is harmless; a wrong block, a different model or a flipped
exponent bit moves logits by orders of magnitude more.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import torch
import xxhash

from pdserve.errors import ProtocolError

TOP_K = 8
_HEADER = struct.Struct("<BBIQ")  # version, k, position, logits hash
_VERSION = 1


class CanaryMatch(enum.Enum):
    """How a recomputed digest compares with the sender's."""

    EXACT = "exact"  # bit-identical logits
    TOLERANCE = "tolerance"  # within the dtype's tolerance
    MISMATCH = "mismatch"


# (relative, absolute) tolerance on logits, by KV dtype.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-3, 1e-3),
    "bfloat16": (2e-2, 5e-2),
    "float16": (1e-2, 2e-2),
}


@dataclass(frozen=True, slots=True)
class ValueDigest:
    """The last prompt position's logits, compactly: top-k ids and values, and a hash of all."""

    position: int
    top_ids: tuple[int, ...]
    top_logits: tuple[float, ...]  # float32 values, in descending order
    logits_hash: int  # xxh3_64 of the whole float32 logits vector

    @classmethod
    def of_logits(cls, logits: torch.Tensor, position: int, k: int = TOP_K) -> ValueDigest:
        """The digest of one logits row ([vocab], any float dtype; compared as float32)."""
        row = logits.detach().float().contiguous().view(-1).cpu()
        values, ids = torch.topk(row, min(k, row.numel()))
        return cls(
            position,
            tuple(int(i) for i in ids.tolist()),
            tuple(float(v) for v in values.tolist()),
            xxhash.xxh3_64_intdigest(row.numpy().tobytes()),
        )

    def encode(self) -> bytes:
        """Wire form: header, then k u32 ids and k float32 values."""
        k = len(self.top_ids)
        return (
            _HEADER.pack(_VERSION, k, self.position, self.logits_hash)
            + struct.pack(f"<{k}I", *self.top_ids)
            + struct.pack(f"<{k}f", *self.top_logits)
        )

    @classmethod
    def decode(cls, raw: bytes) -> ValueDigest:
        """Parse `encode`'s bytes; ProtocolError naming what is wrong."""
        if len(raw) < _HEADER.size:
            raise ProtocolError(f"value digest: {len(raw)} bytes, need {_HEADER.size}")
        version, k, position, logits_hash = _HEADER.unpack_from(raw)
        if version != _VERSION:
            raise ProtocolError(f"value digest: version {version}, this build reads {_VERSION}")
        if not 1 <= k <= 32 or len(raw) != _HEADER.size + 8 * k:
            raise ProtocolError(f"value digest: k={k} with {len(raw)} bytes")
        ids = struct.unpack_from(f"<{k}I", raw, _HEADER.size)
        values = struct.unpack_from(f"<{k}f", raw, _HEADER.size + 4 * k)
        return cls(position, tuple(ids), tuple(values), logits_hash)


@dataclass(frozen=True, slots=True)
class CanaryVerdict:
    """The outcome of one comparison, with what differed when it failed."""

    match: CanaryMatch
    detail: str = ""


def compare(
    expected: ValueDigest, logits: torch.Tensor, position: int, dtype: str
) -> CanaryVerdict:
    """Compare the sender's digest with logits recomputed here for `position`."""
    if position != expected.position:
        return CanaryVerdict(
            CanaryMatch.MISMATCH,
            f"digest is for position {expected.position}, recomputed {position}",
        )
    row = logits.detach().float().contiguous().view(-1).cpu()
    if xxhash.xxh3_64_intdigest(row.numpy().tobytes()) == expected.logits_hash:
        return CanaryVerdict(CanaryMatch.EXACT)
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
    if max(expected.top_ids) >= row.numel():
        return CanaryVerdict(CanaryMatch.MISMATCH, f"token id outside a {row.numel()}-token vocab")
    worst = 0.0
    for token, want in zip(expected.top_ids, expected.top_logits, strict=True):
        got = float(row[token])
        excess = abs(got - want) - (atol + rtol * abs(want))
        if excess > 0:
            return CanaryVerdict(
                CanaryMatch.MISMATCH,
                f"logit of token {token} at position {position}: sender {want:.6g}, here "
                f"{got:.6g} (tolerance {atol + rtol * abs(want):.3g} for {dtype})",
            )
        worst = max(worst, abs(got - want))
    best_here = float(row.max())
    best_there = expected.top_logits[0]
    if best_here - best_there > atol + rtol * abs(best_there):
        token = int(row.argmax())
        return CanaryVerdict(
            CanaryMatch.MISMATCH,
            f"token {token} scores {best_here:.6g} here, above the sender's best {best_there:.6g}",
        )
    return CanaryVerdict(CanaryMatch.TOLERANCE, f"max logit difference {worst:.3g}")
