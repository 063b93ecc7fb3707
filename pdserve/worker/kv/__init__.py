"""A worker's part in KV handoffs: the decode side's reservations and receiver (`inbox`), the
prefill side's pushes (`outbox`), which transport a pair uses (`transports`, `connections`), the
value canary, prefix-cache events, and per-transport figures."""
