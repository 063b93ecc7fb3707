"""Decode checkpoints: a decoding request's KV replicated to a holder, so that a migration
resumes from it instead of recomputing (`holder.py` the interface, `host_tier.py` the bounded
host-memory holder on a worker; when blocks are sent is `protocol/checkpoint_policy.py`)."""
