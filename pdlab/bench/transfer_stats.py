"""The arithmetic of `pdserve bench transfer`: medians, rates, ratios, checksum shares, targets.

A measurement is a `Samples`: the seconds of each timed run (warm-up runs are never in it) of
moving `num_bytes`. Its figure is the median run, as GB/s (1e9 bytes per second).

Each KV handoff cell (one transport, one size) is judged against the baseline of its kind,
measured at the same size in the same run:

    tcp          against a raw socket (plain sendall / recv_into between two processes)
    shm, nixl    against memcpy (one large copy in one process)

and carries the checksum's own share of the time on both sides: xxh3 timed alone over the same
bytes, cut the way that side cuts them, divided by that side's transfer time (the sender's
from `send_with_retries` to its Ack; the receiver's from the accepted Begin to the verified
Commit). The headline figures (`headline`) are the ratios at the largest size measured (where
the rate, not per-transfer latency, decides) and the largest checksum share of any cell.

Pure: no I/O, no clock, no processes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from pdserve.advise.flags import at_least, checked
from pdserve.settings import setting

MIB = 1 << 20
# Bytes per element of the KV dtypes the engine has (`model.weights.TORCH_DTYPES`).
ITEMSIZE = {"float32": 4, "bfloat16": 2}


class Baseline(Enum):
    """What a transport's rate is compared with."""

    MEMCPY = "memcpy"
    RAW_SOCKET = "raw_socket"


# transport → (its baseline, the least ratio to it that meets the target)
TARGETS: dict[str, tuple[Baseline, float]] = {
    "tcp": (Baseline.RAW_SOCKET, 0.8),
    "shm": (Baseline.MEMCPY, 0.5),
    "nixl": (Baseline.MEMCPY, 0.5),
    # TCP in mutual TLS (`--tls-*`): encryption and a copy each way, against the raw socket.
    "tls": (Baseline.RAW_SOCKET, 0.25),
}
# The checksum may cost at most this share of a side's transfer time.
MAX_CHECKSUM_SHARE = 0.10


@dataclass(frozen=True, slots=True)
class Samples:
    """The timed runs of one measurement of `num_bytes` (warm-up runs excluded)."""

    num_bytes: int
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.num_bytes < 1:
            raise ValueError(f"Samples: num_bytes must be >= 1, got {self.num_bytes}")
        if not self.seconds or not all(s > 0 for s in self.seconds):
            raise ValueError(f"Samples: need >= 1 run, each > 0 s, got {self.seconds}")

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gbps(self) -> float:
        """The median run's rate in GB/s (1e9 bytes per second)."""
        return self.num_bytes / self.median_s / 1e9


@dataclass(frozen=True, slots=True)
class CpuRuns:
    """CPU seconds per run of each process taking part (no receiver for memcpy)."""

    sender_s: tuple[float, ...]
    receiver_s: tuple[float, ...] = ()

    def per_gb(self, num_bytes: int) -> tuple[float | None, float | None]:
        """(sender, receiver) median CPU seconds per 1e9 bytes."""
        return _per_gb(self.sender_s, num_bytes), _per_gb(self.receiver_s, num_bytes)

    def busiest_per_gb(self, num_bytes: int) -> float | None:
        """The busier process's: what bounds the rate when each process has a core."""
        values = [v for v in self.per_gb(num_bytes) if v is not None]
        return max(values) if values else None


@dataclass(frozen=True, slots=True)
class HandoffCell:
    """One transport at one size: the handoff, both sides' checksum time, the baseline."""

    transport: str
    # The sender's wall time per run: send_with_retries from its start to the commit's Ack.
    sender: Samples
    # The receiver's time per run: Begin accepted to Commit verified.
    receiver: Samples
    # xxh3 alone over the same bytes, as each side cuts them (sender: frames; receiver:
    # the pieces it lands).
    sender_checksum: Samples
    receiver_checksum: Samples
    # The baseline of this transport's kind at the same size.
    baseline: Samples
    # Attempts after the first, over every run (a healthy link has none).
    num_retries: int = 0
    # CPU seconds of each process per run, the handoff's and its baseline's: what they cost
    # apart from waiting for a core on a machine whose cores are shared.
    cpu: CpuRuns | None = None
    baseline_cpu: CpuRuns | None = None

    @property
    def num_bytes(self) -> int:
        return self.sender.num_bytes

    @property
    def ratio(self) -> float:
        """The handoff's rate over its baseline's."""
        return self.sender.gbps / self.baseline.gbps

    @property
    def sender_checksum_share(self) -> float:
        return self.sender_checksum.median_s / self.sender.median_s

    @property
    def receiver_checksum_share(self) -> float:
        return self.receiver_checksum.median_s / self.receiver.median_s

    @property
    def sender_cpu_s_per_gb(self) -> float | None:
        return None if self.cpu is None else self.cpu.per_gb(self.num_bytes)[0]

    @property
    def receiver_cpu_s_per_gb(self) -> float | None:
        return None if self.cpu is None else self.cpu.per_gb(self.num_bytes)[1]

    @property
    def cpu_ratio(self) -> float | None:
        """The ratio the handoff would reach with a core per process: the baseline's busiest
        process's CPU per byte over the handoff's."""
        if self.cpu is None or self.baseline_cpu is None:
            return None
        own = self.cpu.busiest_per_gb(self.num_bytes)
        base = self.baseline_cpu.busiest_per_gb(self.num_bytes)
        return None if not own or base is None else base / own

    @property
    def checksum_share(self) -> float:
        """The larger of the two sides' shares."""
        return max(self.sender_checksum_share, self.receiver_checksum_share)


def _per_gb(seconds: tuple[float, ...], num_bytes: int) -> float | None:
    """Median seconds per 1e9 bytes; None without runs."""
    return statistics.median(seconds) / num_bytes * 1e9 if seconds else None


@dataclass(frozen=True, slots=True)
class Target:
    """One target and whether this run met it."""

    name: str
    value: float | None
    bound: float
    # True: value must be >= bound; False: <= bound.
    at_least: bool

    @property
    def met(self) -> bool | None:
        """None when nothing was measured (the transport is unavailable)."""
        if self.value is None:
            return None
        return self.value >= self.bound if self.at_least else self.value <= self.bound


@dataclass(frozen=True, slots=True)
class Headline:
    """The figures the JSON carries at its top level, and the targets they are held to."""

    # The size the ratios are taken at (the largest measured).
    at_bytes: int
    ratios: dict[str, float | None]
    checksum_share: float | None
    targets: tuple[Target, ...]


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """The paged KV layout the handoffs move (`engine.kv_cache.KVCache`'s own)."""

    # Default: a 7-8B GQA model's KV (32 layers, 4 KV heads of 128, bfloat16, as Qwen2-7B has
    # 28 layers of): 64 KiB per token, 1 MiB per 16-token block.
    num_layers: int = checked(32, at_least(1), name="layers", help="KV layout: layers")
    num_kv_heads: int = checked(4, at_least(1), name="kv-heads", help="KV layout: KV heads")
    head_dim: int = checked(128, at_least(1), help="KV layout: head dim")
    dtype: str = setting("bfloat16", help="KV layout: float32 or bfloat16")
    block_size: int = checked(16, at_least(1), help="tokens per KV block")

    def __post_init__(self) -> None:
        values = (self.num_layers, self.num_kv_heads, self.head_dim, self.block_size)
        if min(values) < 1 or self.dtype not in ITEMSIZE:
            raise ValueError(
                f"LayoutSpec: shapes must be >= 1 and dtype one of {', '.join(ITEMSIZE)},"
                f" got {self}"
            )

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """One block across every layer, K and V."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        ) * self.itemsize

    def num_blocks(self, num_bytes: int) -> int:
        """Blocks holding `num_bytes` of KV; ValueError unless that is a whole number >= 1."""
        num_blocks, rest = divmod(num_bytes, self.block_bytes)
        if num_blocks < 1 or rest:
            raise ValueError(
                f"{num_bytes} bytes is not a whole number of {self.block_bytes}-byte blocks"
            )
        return num_blocks


@dataclass(slots=True)
class TransferReport:
    """Everything one `pdserve bench transfer` run measured of the KV data plane."""

    layout: LayoutSpec
    frame_bytes: int
    num_runs: int
    num_warmup: int
    sizes: tuple[int, ...]
    # Baselines per size.
    memcpy: dict[int, Samples] = field(default_factory=dict)
    raw_socket: dict[int, Samples] = field(default_factory=dict)
    memcpy_cpu: dict[int, CpuRuns] = field(default_factory=dict)
    raw_socket_cpu: dict[int, CpuRuns] = field(default_factory=dict)
    cells: list[HandoffCell] = field(default_factory=list)
    # transport → why it was not measured (not installed, cannot serve here).
    unavailable: dict[str, str] = field(default_factory=dict)
    # transport → the error that stopped its measurement part-way.
    failed: dict[str, str] = field(default_factory=dict)

    def baseline(self, kind: Baseline, num_bytes: int) -> Samples:
        return (self.memcpy if kind is Baseline.MEMCPY else self.raw_socket)[num_bytes]

    def baseline_cpu(self, kind: Baseline, num_bytes: int) -> CpuRuns | None:
        return (self.memcpy_cpu if kind is Baseline.MEMCPY else self.raw_socket_cpu).get(num_bytes)

    def cell(self, transport: str, num_bytes: int) -> HandoffCell | None:
        return next(
            (c for c in self.cells if c.transport == transport and c.num_bytes == num_bytes),
            None,
        )


def ratio_key(transport: str) -> str:
    """The JSON name of a transport's ratio, e.g. `tcp_ratio_vs_raw_socket`."""
    return f"{transport}_ratio_vs_{TARGETS[transport][0].value}"


def headline(report: TransferReport) -> Headline:
    """Ratios at the largest size, the largest checksum share, and every target's verdict."""
    at_bytes = max(report.sizes)
    ratios: dict[str, float | None] = {}
    targets: list[Target] = []
    for transport, (_, bound) in TARGETS.items():
        cell = report.cell(transport, at_bytes)
        ratios[transport] = None if cell is None else cell.ratio
        targets.append(Target(ratio_key(transport), ratios[transport], bound, at_least=True))
    shares = [c.checksum_share for c in report.cells]
    share = max(shares) if shares else None
    targets.append(Target("checksum_share", share, MAX_CHECKSUM_SHARE, at_least=False))
    return Headline(at_bytes, ratios, share, tuple(targets))


def _samples_json(samples: Samples) -> dict[str, object]:
    return {
        "num_bytes": samples.num_bytes,
        "median_s": samples.median_s,
        "gbps": samples.gbps,
        "seconds": list(samples.seconds),
    }


def _baseline_json(samples: Samples, cpu: CpuRuns | None) -> dict[str, object]:
    doc = _samples_json(samples)
    sender, receiver = (None, None) if cpu is None else cpu.per_gb(samples.num_bytes)
    doc["sender_cpu_s_per_gb"] = sender
    doc["receiver_cpu_s_per_gb"] = receiver
    return doc


def report_json(report: TransferReport) -> dict[str, object]:
    """The `--json` document: headline ratios and share on top, then every measurement."""
    top = headline(report)
    layout = report.layout
    doc: dict[str, object] = {ratio_key(t): top.ratios[t] for t in TARGETS}
    doc["checksum_share"] = top.checksum_share
    for transport, (kind, _) in TARGETS.items():
        cell = report.cell(transport, top.at_bytes)
        ratio = None if cell is None else cell.cpu_ratio
        doc[f"{transport}_cpu_ratio_vs_{kind.value}"] = ratio
    doc["ratios_at_bytes"] = top.at_bytes
    doc["targets"] = [
        {"name": t.name, "value": t.value, "bound": t.bound, "at_least": t.at_least, "met": t.met}
        for t in top.targets
    ]
    doc["layout"] = {
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "block_size": layout.block_size,
        "block_bytes": layout.block_bytes,
    }
    doc["frame_bytes"] = report.frame_bytes
    doc["num_runs"] = report.num_runs
    doc["num_warmup"] = report.num_warmup
    doc["baselines"] = {
        "memcpy": [
            _baseline_json(report.memcpy[n], report.memcpy_cpu.get(n))
            for n in report.sizes
            if n in report.memcpy
        ],
        "raw_socket": [
            _baseline_json(report.raw_socket[n], report.raw_socket_cpu.get(n))
            for n in report.sizes
            if n in report.raw_socket
        ],
    }
    doc["handoffs"] = [
        {
            "transport": c.transport,
            "num_bytes": c.num_bytes,
            "sender": _samples_json(c.sender),
            "receiver": _samples_json(c.receiver),
            "baseline": TARGETS[c.transport][0].value,
            "ratio": c.ratio,
            "sender_checksum": _samples_json(c.sender_checksum),
            "receiver_checksum": _samples_json(c.receiver_checksum),
            "sender_checksum_share": c.sender_checksum_share,
            "receiver_checksum_share": c.receiver_checksum_share,
            "num_retries": c.num_retries,
            "sender_cpu_s_per_gb": c.sender_cpu_s_per_gb,
            "receiver_cpu_s_per_gb": c.receiver_cpu_s_per_gb,
            "cpu_ratio": c.cpu_ratio,
        }
        for c in report.cells
    ]
    doc["unavailable"] = dict(report.unavailable)
    doc["failed"] = dict(report.failed)
    return doc


def _size_label(num_bytes: int) -> str:
    if num_bytes >= MIB and num_bytes % MIB == 0:
        return f"{num_bytes // MIB} MiB"
    return f"{num_bytes / MIB:.2f} MiB"


def _row(label: str, cells: Sequence[str], width: int) -> str:
    return label.ljust(24) + "".join(c.rjust(width) for c in cells)


def render_table(report: TransferReport) -> str:
    """The human-readable result: GB/s per size, ratios, checksum shares, verdicts."""
    layout = report.layout
    width = 20
    sizes = report.sizes
    lines = [
        f"KV layout: {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
        f"{layout.head_dim} ({layout.dtype}), {layout.block_size}-token blocks of "
        f"{_size_label(layout.block_bytes)}; frames of {_size_label(report.frame_bytes)}",
        f"GB/s (1e9 B/s), median of {report.num_runs} runs after {report.num_warmup} warm-up",
        _row("", [_size_label(n) for n in sizes], width),
        _row("memcpy", [_gbps(report.memcpy.get(n)) for n in sizes], width),
        _row("  cpu s/GB", [_cpu(report.memcpy_cpu.get(n), n) for n in sizes], width),
        _row("raw socket", [_gbps(report.raw_socket.get(n)) for n in sizes], width),
        _row("  cpu s/GB send/recv", [_cpu(report.raw_socket_cpu.get(n), n) for n in sizes], width),
    ]
    for transport in TARGETS:
        if transport in report.unavailable:
            lines.append(
                f"{transport + ' handoff':<24}unavailable: {report.unavailable[transport]}"
            )
            continue
        row, shares, cpu = [], [], []
        for n in sizes:
            cell = report.cell(transport, n)
            if cell is None:
                row.append("-")
                shares.append("-")
                cpu.append("-")
                continue
            retried = f" r{cell.num_retries}" if cell.num_retries else ""
            row.append(f"{cell.sender.gbps:.2f} ({cell.ratio:.2f}x){retried}")
            shares.append(f"{cell.sender_checksum_share:.0%}/{cell.receiver_checksum_share:.0%}")
            cpu_ratio = "" if cell.cpu_ratio is None else f" ({cell.cpu_ratio:.2f}x)"
            cpu.append(
                f"{_num(cell.sender_cpu_s_per_gb)}/{_num(cell.receiver_cpu_s_per_gb)}{cpu_ratio}"
            )
        if any(r != "-" for r in row):
            lines.append(_row(f"{transport} handoff", row, width))
            lines.append(_row("  checksum send/recv", shares, width))
            lines.append(_row("  cpu s/GB send/recv", cpu, width))
        if transport in report.failed:
            lines.append(f"{transport + ' handoff':<24}FAILED: {report.failed[transport]}")
    top = headline(report)
    lines.append(f"targets at {_size_label(top.at_bytes)}:")
    for t in top.targets:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t.met]
        value = "-" if t.value is None else f"{t.value:.2f}"
        sign = ">=" if t.at_least else "<="
        lines.append(f"  {t.name:<28}{value:>8}  ({sign} {t.bound:g})  {verdict}")
    return "\n".join(lines)


def _cpu(runs: CpuRuns | None, num_bytes: int) -> str:
    if runs is None:
        return "-"
    sender, receiver = runs.per_gb(num_bytes)
    return _num(sender) if receiver is None else f"{_num(sender)}/{_num(receiver)}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _gbps(samples: Samples | None) -> str:
    return "-" if samples is None else f"{samples.gbps:.2f}"
