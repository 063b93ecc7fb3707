"""`pdserve chaos`: fault scenarios against real local clusters, each judged by what clients saw."""
