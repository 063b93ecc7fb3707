"""The router's pair probe, per KV transport, on this machine.

One `pdserve up` cluster per transport (1 prefill + 1 decode worker, both forced to that
transport, the KV-heavy checkpoint: 2 MiB blocks), started side by side; each router probes its
pair when the workers join (`router/workers/pair_probes.py`). Prints the rate each probe
measured and the verdict, and writes them as JSON.

    python benchmarks/kv_pair_probe.py [--json FILE] [--probe-mib 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from pdlab.bench.kv_heavy_model import build_kv_heavy_checkpoint
from pdlab.bench.local_clusters import local_clusters
from pdserve.protocol.kv_rates import SLOW_FRACTION, expected_gbps
from pdserve.supervise.launcher import UpConfig

TRANSPORTS = ("tcp", "shm", "nixl")


def probed_pairs(router: str, timeout_s: float = 120.0) -> list[dict[str, object]]:
    """The router's probed pairs, once it has one."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{router}/health", timeout=10) as resp:
            pairs = json.loads(resp.read())["kv_pairs"]
        if pairs:
            return list(pairs)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{router}: no pair probed in {timeout_s} s")
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--probe-mib", type=int, default=32, help="the router's --kv-probe-mib")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_kv_heavy_checkpoint(Path(tmp) / "kv-heavy")
        configs = {
            t: UpConfig(
                num_prefill=1,
                num_decode=1,
                model=str(model),
                port=18400 + 10 * i,
                state_file=Path(tmp) / f"{t}.state.json",
                worker_args=("--kv-transport", t),
                router_args=(f"--kv-probe-mib={args.probe_mib}",),
            )
            for i, t in enumerate(TRANSPORTS)
        }
        rows = []
        with local_clusters(configs) as clusters:
            for transport, endpoints in clusters.items():
                for pair in probed_pairs(endpoints.routers[0]):
                    rows.append({"asked": transport, **pair})
    print(f"{'transport':<10}{'GB/s':>8}{'floor GB/s':>12}  verdict")
    for r in rows:
        floor = SLOW_FRACTION * expected_gbps(str(r["transport"]))
        print(f"{r['transport']!s:<10}{float(r['gbps']):>8.2f}{floor:>12.2f}  {r['verdict']}")  # type: ignore[arg-type]
    if args.json is not None:
        args.json.write_text(
            json.dumps({"probe_mib": args.probe_mib, "pairs": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
