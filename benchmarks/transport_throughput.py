"""Retired: the transport benchmark is now `pdserve bench transfer` (KV handoffs per transport
between two processes, against memcpy and a raw socket, checksums on). This script only runs
that command's `kv` part, passing its arguments through:

    .venv/bin/python benchmarks/transport_throughput.py [--sizes-kib 1024,16384] [--json FILE]
"""

from __future__ import annotations

import sys

from pdserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "transfer", "--parts", "kv", *sys.argv[1:]]))
