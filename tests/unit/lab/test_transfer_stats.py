"""`pdserve bench transfer` arithmetic: medians, ratios per baseline, checksum shares, targets,
the JSON names, and the flags (one line naming the bad one)."""

from __future__ import annotations

import pytest

from pdlab.bench.command import build_parser
from pdlab.bench.transfer_command import config_from_args, parts_from_args
from pdlab.bench.transfer_stats import (
    MIB,
    CpuRuns,
    HandoffCell,
    LayoutSpec,
    Samples,
    TransferReport,
    headline,
    render_table,
    report_json,
)
from pdserve.cli import main

LAYOUT = LayoutSpec(num_layers=32, num_kv_heads=4, head_dim=128, dtype="bfloat16", block_size=16)


def s(num_bytes: int, *seconds: float) -> Samples:
    return Samples(num_bytes, seconds)


def cell(
    transport: str, n: int, sent: float, baseline: Samples, hashed: float = 0.001
) -> HandoffCell:
    return HandoffCell(
        transport,
        sender=s(n, sent, sent * 2, sent / 2),
        receiver=s(n, sent * 0.8),
        sender_checksum=s(n, hashed),
        receiver_checksum=s(n, hashed / 2),
        baseline=baseline,
        cpu=CpuRuns((0.1, 0.3, 0.2), (0.4,)),
        baseline_cpu=CpuRuns((0.1,), (0.2,)),
    )


def report() -> TransferReport:
    r = TransferReport(LAYOUT, 4 * MIB, 3, 1, (MIB, 128 * MIB))
    for n, copy_s, socket_s in ((MIB, 0.0001, 0.001), (128 * MIB, 0.02, 0.1)):
        r.memcpy[n] = s(n, copy_s)
        r.raw_socket[n] = s(n, socket_s)
        r.cells.append(cell("tcp", n, socket_s * 1.25, r.raw_socket[n], hashed=socket_s / 10))
        r.cells.append(cell("shm", n, copy_s * 4, r.memcpy[n], hashed=copy_s))
    r.unavailable["nixl"] = "not importable"
    return r


def test_samples_take_the_median_run_and_rate_in_decimal_gigabytes() -> None:
    x = s(2_000_000_000, 4.0, 1.0, 2.0)
    assert x.median_s == 2.0 and x.gbps == 1.0
    with pytest.raises(ValueError):
        Samples(10, ())
    with pytest.raises(ValueError):
        Samples(10, (0.0,))


def test_layout_is_the_kv_caches_own_and_sizes_must_be_whole_blocks() -> None:
    assert LAYOUT.block_bytes == MIB  # 32 x 2 x 16 x 4 x 128 x 2 bytes
    assert LAYOUT.num_blocks(1024 * MIB) == 1024
    with pytest.raises(ValueError, match="whole number"):
        LAYOUT.num_blocks(MIB + 1)
    with pytest.raises(ValueError):
        LayoutSpec(1, 1, 1, "float16", 16)


def test_each_transport_is_judged_against_its_own_baseline_and_shares_per_side() -> None:
    c = cell("tcp", 128 * MIB, 0.125, s(128 * MIB, 0.1), hashed=0.025)
    assert c.ratio == pytest.approx(0.8)  # median 0.125 s against the raw socket's 0.1 s
    assert c.sender_checksum_share == pytest.approx(0.2)  # 0.025 / 0.125
    assert c.receiver_checksum_share == pytest.approx(0.0125 / 0.1)  # 0.1: the receiver's own
    assert c.checksum_share == pytest.approx(0.2)
    assert c.sender_cpu_s_per_gb == pytest.approx(0.2 / (128 * MIB) * 1e9)
    # With a core per process: the baseline's busier side (0.2 s) over the handoff's (0.4 s).
    assert c.cpu_ratio == pytest.approx(0.5)


def test_headline_ratios_are_taken_at_the_largest_size_and_the_share_is_the_worst_cell() -> None:
    r = report()
    top = headline(r)
    assert top.at_bytes == 128 * MIB
    assert top.ratios["tcp"] == pytest.approx(0.8)
    assert top.ratios["shm"] == pytest.approx(0.25)
    assert top.ratios["nixl"] is None
    assert top.checksum_share == pytest.approx(0.25)  # shm at 128 MiB: 0.02 / 0.08
    verdicts = {t.name: t.met for t in top.targets}
    assert verdicts == {
        "tcp_ratio_vs_raw_socket": True,
        "shm_ratio_vs_memcpy": False,
        "nixl_ratio_vs_memcpy": None,
        "tls_ratio_vs_raw_socket": None,
        "checksum_share": False,
    }


def test_json_names_the_ratios_per_transport_and_keeps_every_run() -> None:
    doc = report_json(report())
    assert doc["tcp_ratio_vs_raw_socket"] == pytest.approx(0.8)
    assert doc["shm_ratio_vs_memcpy"] == pytest.approx(0.25)
    assert doc["nixl_ratio_vs_memcpy"] is None
    assert doc["checksum_share"] == pytest.approx(0.25)
    assert doc["unavailable"] == {"nixl": "not importable"}
    assert doc["tcp_cpu_ratio_vs_raw_socket"] == pytest.approx(0.5)
    handoffs = doc["handoffs"]
    assert isinstance(handoffs, list) and len(handoffs) == 4
    first = handoffs[0]
    assert first["baseline"] == "raw_socket" and len(first["sender"]["seconds"]) == 3


def test_table_shows_rates_ratios_shares_and_why_a_transport_is_missing() -> None:
    r = report()
    r.failed["shm"] = "failed at 1 bytes: PeerClosed: gone"
    text = render_table(r)
    assert "tcp handoff" in text and "(0.80x)" in text
    assert "unavailable: not importable" in text
    assert "FAILED: failed at 1 bytes" in text
    assert "shm_ratio_vs_memcpy" in text and "MISSED" in text


def parse(*flags: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["transfer", *flags])


def test_flags_reach_the_config() -> None:
    c = config_from_args(
        parse("--sizes-kib", "2048,1024,1024", "--transports", "shm,tcp", "--runs", "2")
    )
    assert c.sizes == (MIB, 2 * MIB)
    assert c.transports == ("shm", "tcp") and c.num_runs == 2
    assert parts_from_args(parse("--parts", "handoff,kv")) == ("kv", "handoff")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--sizes-kib", "abc"], "--sizes-kib"),
        (["--sizes-kib", "1000"], "--sizes-kib"),  # not whole 1 MiB blocks
        (["--transports", "tcp,rdma"], "--transports"),
        (["--runs", "0"], "--runs"),
        (["--frame-kib", "100000"], "--frame-kib"),
        (["--dtype", "float16"], "--dtype"),
        (["--parts", "kv,gpu"], "--parts"),
        (["--handoff-prompt-tokens", "4"], "--handoff-prompt-tokens"),
    ],
)
def test_a_bad_flag_exits_2_naming_it(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "transfer", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1
