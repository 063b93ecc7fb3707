"""Keeping a local cluster's processes up: child processes, restart policy, the supervisor."""
