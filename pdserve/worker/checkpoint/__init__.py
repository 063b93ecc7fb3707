"""A worker's part in decode checkpoints: replicating a decoding request's KV to a holder
(`stream`, `link`, `sender`), holding others' (`store`, `link_server`, `routes`), and resuming
a migrated request from the nearest copy (`resume`, `prefix_source`)."""
