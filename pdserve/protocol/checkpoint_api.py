"""The control-plane bodies of decode checkpoints (`pdserve/checkpoint/`), as typed models.

    router -> D    DecodeRequest.checkpoint / GenerateRequest.checkpoint: CheckpointPlan
                   (where to replicate this request's KV, and how often)
    router -> D2   GenerateRequest.checkpoint_from: CheckpointSource (where the last one is)
    D -> H         POST /checkpoint/put     CheckpointPut      -> Reservation (the holder's
                                                                  KV endpoints, as a handoff's)
                   POST /checkpoint/renew   CheckpointOwner    -> CheckpointRenewed
                   POST /checkpoint/release CheckpointOwner    -> CheckpointReleased
    D2 -> H        POST /checkpoint/lookup  CheckpointLookup   -> CheckpointFound
                   POST /checkpoint/send    CheckpointSend     -> CheckpointSent
    D2 -> any      POST /cache/lookup       CheckpointLookup   -> CheckpointFound
                   POST /cache/send         CheckpointSend     -> CheckpointSent
                   (the same two calls answered from a worker's prefix cache: any worker,
                   the request's prefill worker included, `worker/checkpoint/prefix_source.py`)

Blocks are named by their tokens (the holder derives the chained hashes itself, so a key can
never disagree with the tokens it claims); the KV bytes travel over the KV transports with
the transfer protocol's checksums, fingerprint check and leases, never in these bodies.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pdserve.protocol.worker_api import (
    MAX_LEASE_TTL_S,
    CheckpointPlan,
    CheckpointSource,
    SignedReservation,
)

__all__ = ["CheckpointPlan", "CheckpointSource"]

HASH_LIMIT = 1 << 64


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class CheckpointPut(_Model):
    """Room for blocks of `owner` after `parent_hash` (0: from the first block)."""

    owner: str
    fingerprint_digest: str
    parent_hash: int = Field(ge=0, lt=HASH_LIMIT)
    # Tokens covered up to the end of the first block: (its index + 1) * block_size.
    first_version: int = Field(ge=1)
    # The tokens of each block (block_size each).
    block_tokens: list[list[int]] = Field(min_length=1)
    lease_ttl_s: float = Field(default=30.0, gt=0, le=MAX_LEASE_TTL_S)


class CheckpointOwner(_Model):
    owner: str
    # A renewal extends the owner's lease by this.
    lease_ttl_s: float = Field(default=30.0, gt=0, le=MAX_LEASE_TTL_S)


class CheckpointRenewed(_Model):
    owner: str
    lease_ttl_s: float
    num_blocks: int


class CheckpointReleased(_Model):
    owner: str
    num_freed_blocks: int


class CheckpointLookup(_Model):
    """Which leading full blocks of `token_ids` the holder has, valid for this fingerprint."""

    token_ids: list[int]
    fingerprint_digest: str
    # Only a prefix whose last block carries the writer's value digest (the canary).
    require_value_digest: bool = False


class CheckpointFound(_Model):
    num_blocks: int
    # The holder's instance: a resuming worker that is the holder itself reads its own tier.
    holder_id: str = ""
    # Tokens those blocks cover.
    version: int


class CheckpointSend(_Model):
    """Send the blocks of `token_ids` (whole blocks) to the signed reservation."""

    token_ids: list[int] = Field(min_length=1)
    fingerprint_digest: str
    reservation: SignedReservation
    # The resumed request takes the blocks over under its own lease (None: only read them).
    adopt_owner: str | None = None
    lease_ttl_s: float = Field(default=30.0, gt=0, le=MAX_LEASE_TTL_S)


class CheckpointSent(_Model):
    num_blocks: int
    num_bytes: int
    seconds: float
