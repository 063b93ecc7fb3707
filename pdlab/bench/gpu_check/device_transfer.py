"""GPU check step: KV blocks between two processes on one device, with no host staging.

A second process (the exporter, this module run as a script) fills a KV-cache-shaped tensor
(1 MiB blocks of bfloat16 on a GPU: 16 layers x K/V x 16 tokens x 8 heads x 128), checksums
every block on the device (`kv_checksum`) and exports the tensor (`kv_ipc`: CUDA IPC; on the
CPU the memfd stand-in). This process maps it, copies 32 MiB and 1 GiB of blocks device to
device into its own cache at other block ids, checksums what landed on the device and compares;
it times the copy against an in-process device copy of the same size, and the checksum kernel.
The copy is timed twice: blocks that are consecutive on both sides (one copy) and the same
number from scattered source ids (one gather kernel). Then two checks that must fail the
comparison: one flipped byte in a landed block, and a block the exporter overwrote after
offering it (a sender that reused a block past its lease). On a GPU it also holds the checksum
kernel to its numpy reference on odd lengths, a misaligned view and a list of blocks: the CPU
tests could run the kernel only in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdlab.bench.engine import sync
from pdserve.engine.kv_checksum import TILE_WORDS, block_checksums, device_checksum
from pdserve.engine.kv_ipc import IpcHandle, copy_blocks, export_handle, map_peer
from pdserve.transfer import arena

# One block: layers x (K, V) x tokens x KV heads x head_dim.
BLOCK_SHAPE = (16, 2, 16, 8, 128)
QUICK_BLOCK_SHAPE = (2, 2, 16, 8, 128)
_LINE_TIMEOUT_S = 120.0


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _new_cache(
    num_blocks: int, block_shape: tuple[int, ...], dtype: str, device: str
) -> tuple[torch.Tensor, arena.Arena | None]:
    """A cache tensor the exporter can share: on the CPU it lives in an exported arena."""
    torch_dtype = getattr(torch, dtype)
    shape = (num_blocks, *block_shape)
    if device != "cpu":
        return torch.empty(shape, dtype=torch_dtype, device=device), None
    count = int(torch.Size(shape).numel())
    itemsize = torch.empty(0, dtype=torch_dtype).element_size()
    held = arena.export(count * itemsize)
    return torch.frombuffer(held.map, dtype=torch_dtype, count=count).view(shape), held


def exporter(argv: list[str]) -> None:
    """The second process: fill, checksum and export a cache, then serve overwrite / exit."""
    p = argparse.ArgumentParser()
    p.add_argument("--device", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--block-shape", required=True)
    a = p.parse_args(argv)
    block_shape = tuple(int(x) for x in a.block_shape.split(","))
    cache, _held = _new_cache(a.blocks, block_shape, a.dtype, a.device)
    gen = torch.Generator(device=a.device).manual_seed(0)
    cache.copy_(torch.randn(cache.shape, generator=gen, device=a.device).to(cache.dtype))
    sync(cache.device)
    sums = block_checksums(cache, list(range(a.blocks)))
    print(json.dumps({"handle": export_handle(cache).to_json(), "checksums": sums}), flush=True)
    for line in sys.stdin:
        op = json.loads(line)
        if op["op"] == "exit":
            break
        cache[op["block"]].add_(1)  # the sender reuses a block it had offered
        sync(cache.device)
        print(json.dumps({"ok": True}), flush=True)


def _read_line(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    """The exporter's next JSON line, or RuntimeError naming what was awaited."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], _LINE_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"device_transfer: the exporter sent no {what} (exit {proc.poll()})")
    doc: dict[str, Any] = json.loads(line)
    return doc


def _send(proc: subprocess.Popen[str], op: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(op) + "\n")
    proc.stdin.flush()


def _measure(
    proc: subprocess.Popen[str],
    handle: IpcHandle,
    sent: list[int],
    sizes: list[int],
    block_shape: tuple[int, ...],
    args: argparse.Namespace,
) -> tuple[list[dict[str, Any]], bool, bool]:
    """(a row per size, corruption detected, stale block detected); the peer's mapping is
    dropped when this returns."""
    device = torch.device(args.device)
    src = map_peer(handle)
    num_blocks, block_bytes = src.shape[0], src[0].numel() * src.element_size()
    repeats = 3 if args.quick else 5
    # Landed at other block ids (shifted by one): a block's checksum does not depend on where
    # it lives.
    dst = torch.empty((num_blocks + 1, *block_shape), dtype=src.dtype, device=device)
    # The baseline's source: the same bytes, this process's own memory (written: on the CPU,
    # untouched pages would read as the zero page and flatter the baseline).
    local = src.clone()
    rows = []
    for size in sizes:
        n = size // block_bytes
        ids, landed = list(range(n)), list(range(1, n + 1))
        scattered = random.Random(n).sample(range(num_blocks), n)

        def ipc_copy(ids: list[int] = ids, landed: list[int] = landed) -> None:
            copy_blocks(src, ids, dst, landed)

        def ipc_gather(scattered: list[int] = scattered, landed: list[int] = landed) -> None:
            copy_blocks(src, scattered, dst, landed)

        def local_copy(n: int = n) -> None:
            dst[1 : n + 1].copy_(local[:n])

        def checksum(landed: list[int] = landed) -> list[int]:
            return block_checksums(dst, landed)

        gather_s = _timed(ipc_gather, device, repeats)
        gathered_match = checksum() == [sent[b] for b in scattered]
        ipc_s = _timed(ipc_copy, device, repeats)
        local_s = _timed(local_copy, device, repeats)
        ipc_copy()
        sync(device)
        check_s = _timed(checksum, device, repeats)
        rows.append(
            {
                "bytes": n * block_bytes,
                "blocks": n,
                "ipc_gb_per_s": n * block_bytes / ipc_s / 1e9,
                "ipc_scattered_gb_per_s": n * block_bytes / gather_s / 1e9,
                "local_copy_gb_per_s": n * block_bytes / local_s / 1e9,
                "ipc_vs_local": local_s / ipc_s,
                "checksum_gb_per_s": n * block_bytes / check_s / 1e9,
                "checksums_match": checksum() == sent[:n] and gathered_match,
            }
        )
    # One flipped byte in landed block 3 (dst id 4): that block's checksum changes, no other.
    before = block_checksums(dst, [1, 2, 3, 4, 5])
    half = block_bytes // 2
    dst[4].view(-1).view(torch.uint8)[half : half + 1].bitwise_xor_(1)
    after = block_checksums(dst, [1, 2, 3, 4, 5])
    corruption = [b != a for b, a in zip(before, after, strict=True)] == [0, 0, 0, 1, 0]
    # The exporter reuses block 0 after offering it; a copy made now must be refused.
    _send(proc, {"op": "overwrite", "block": 0})
    _read_line(proc, "overwrite acknowledgement")
    copy_blocks(src, [0], dst, [1])
    stale = block_checksums(dst, [1])[0] != sent[0]
    return rows, corruption, stale


def _kernel_matches_reference(device: torch.device) -> bool | None:
    """The checksum kernel against its numpy reference on this device (None on the CPU, where
    only the interpreter runs it: the unit tests' job)."""
    if device.type != "cuda":
        return None
    gen = torch.Generator(device=device).manual_seed(1)
    same = []
    for n in (1, 7, 8, 4099, 3 * TILE_WORDS * 8 + 5, 1 << 20):
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=gen)
        for t in (raw, raw[3:]):  # the second view starts mid-word
            same.append(device_checksum(t, "triton") == device_checksum(t, "reference"))
    cache = torch.randn((40, *QUICK_BLOCK_SHAPE), device=device, generator=gen).bfloat16()
    ids = [39, 0, 5, 5, 17]
    same.append(block_checksums(cache, ids, "triton") == block_checksums(cache, ids, "reference"))
    return all(same)


def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Copy over IPC at two sizes, checksum on the device, and the two refusals."""
    block_shape = QUICK_BLOCK_SHAPE if args.quick else BLOCK_SHAPE
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    block_bytes = int(torch.Size(block_shape).numel()) * itemsize
    sizes = [4 << 20, 32 << 20] if args.quick else [32 << 20, 1 << 30]
    cmd = [sys.executable, "-m", "pdlab.bench.gpu_check.device_transfer", "--device"]
    cmd += [args.device, "--dtype", args.dtype, "--blocks", str(max(sizes) // block_bytes)]
    cmd += ["--block-shape", ",".join(map(str, block_shape))]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        offer = _read_line(proc, "handle")
        handle = IpcHandle.from_json(offer["handle"])
        sent: list[int] = offer["checksums"]
        rows, corruption, stale = _measure(proc, handle, sent, sizes, block_shape, args)
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # the mapping is gone: tell the exporter's side
        _send(proc, {"op": "exit"})
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _print(handle.kind, rows)
    match = all(r["checksums_match"] for r in rows)
    kernel_ok = _kernel_matches_reference(torch.device(args.device))
    return {
        "mechanism": "cuda_ipc" if handle.kind == "cuda" else "memfd (CPU stand-in)",
        "block_bytes": block_bytes,
        "sizes": rows,
        "checksums_match": match,
        "corruption_detected": corruption,
        "stale_block_detected": stale,
        "kernel_matches_reference": kernel_ok,
        "exporter_exit": proc.returncode,
        "passed": match
        and corruption
        and stale
        and kernel_ok is not False
        and proc.returncode == 0,
    }


def _print(kind: str, rows: list[dict[str, Any]]) -> None:
    print(f"KV between two processes ({kind}), device-side checksums")
    print(
        f"{'MiB':>8}{'ipc GB/s':>10}{'scattered':>11}{'local GB/s':>12}{'ratio':>8}"
        f"{'cksum GB/s':>12}{'match':>7}"
    )
    for r in rows:
        print(
            f"{r['bytes'] >> 20:>8}{r['ipc_gb_per_s']:>10.1f}{r['ipc_scattered_gb_per_s']:>11.1f}"
            f"{r['local_copy_gb_per_s']:>12.1f}"
            f"{r['ipc_vs_local']:>8.2f}{r['checksum_gb_per_s']:>12.1f}"
            f"{'yes' if r['checksums_match'] else 'NO':>7}"
        )


if __name__ == "__main__":
    exporter(sys.argv[1:])
