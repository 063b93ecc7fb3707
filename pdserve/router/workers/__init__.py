"""The router's view of its workers: the pool (membership, health, in-flight counts), the typed
control-API client, health deadlines, KV event feeds and the model check."""
