"""Sharing a KV cache tensor with a peer process: the handle's wire form, the CPU stand-in
(a memfd arena mapped read-only), block copies by runs, and errors that say what is wrong.
(CUDA IPC itself needs a GPU: `make gpu-check`, step `device_transfer`.)"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv_ipc import (
    IpcHandle,
    IpcUnavailable,
    copy_blocks,
    export_handle,
    map_peer,
    runs,
)
from pdserve.transfer import arena


def _shared_cache(shape: tuple[int, ...]) -> tuple[torch.Tensor, arena.Arena]:
    count = int(torch.Size(shape).numel())
    held = arena.export(count * 4)
    cache = torch.frombuffer(held.map, dtype=torch.float32, count=count).view(shape)
    cache.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    return cache, held


def test_a_peer_maps_the_cache_and_reads_what_the_owner_wrote() -> None:
    cache, _held = _shared_cache((6, 2, 4, 8))
    handle = IpcHandle.from_json(export_handle(cache).to_json())
    assert handle.kind == "memfd" and handle.shape == (6, 2, 4, 8)
    peer = map_peer(handle)
    assert torch.equal(peer, cache)
    cache[3] += 1  # the owner's later writes are visible: it is the same memory
    assert torch.equal(peer[3], cache[3])


def test_copied_blocks_land_at_the_destination_ids() -> None:
    cache, _held = _shared_cache((6, 2, 4, 8))
    peer = map_peer(export_handle(cache))
    dst = torch.zeros(8, 2, 4, 8)
    copy_blocks(peer, [0, 1, 2, 5], dst, [3, 4, 5, 0])
    for s, d in [(0, 3), (1, 4), (2, 5), (5, 0)]:
        assert torch.equal(dst[d], cache[s])
    assert not dst[1].any() and not dst[2].any()


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=20))
def test_runs_cover_every_pair_in_order(pairs: list[tuple[int, int]]) -> None:
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    got = runs(src, dst)
    assert [(s + i, d + i) for s, d, n in got for i in range(n)] == pairs
    # Maximal: two neighbouring runs could not have been one.
    for (s1, d1, n1), (s2, d2, _) in itertools.pairwise(got):
        assert not (s1 + n1 == s2 and d1 + n1 == d2)


def test_a_cpu_tensor_outside_an_arena_cannot_be_exported() -> None:
    with pytest.raises(IpcUnavailable, match="exported arena"):
        export_handle(torch.zeros(4, 4))


def test_a_cuda_handle_without_a_gpu_is_refused_naming_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    handle = IpcHandle("cuda", "float32", (2, 2), cuda=(0, b"\1" * 64, 16, 0, b"", 0, b"", False))
    with pytest.raises(IpcUnavailable, match="no GPU"):
        map_peer(handle)


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"kind": "memfd"}, "malformed"),
        ({**IpcHandle("memfd", "float32", (2,)).to_json(), "shape": ["x"]}, "malformed"),
        ({**IpcHandle("memfd", "float32", (2,)).to_json(), "cuda": [0, "zz"]}, "malformed"),
    ],
)
def test_a_malformed_handle_is_refused(doc: dict[str, object], match: str) -> None:
    with pytest.raises(IpcUnavailable, match=match):
        IpcHandle.from_json(doc)


@pytest.mark.parametrize(
    ("handle", "match"),
    [
        (IpcHandle("memfd", "floaty", (2,)), "not a torch dtype"),
        (IpcHandle("rdma", "float32", (2,)), "unknown kind"),
        (IpcHandle("memfd", "float32", (2,), pid=2**22 + 7, fd=3, arena_bytes=8), "cannot open"),
    ],
)
def test_a_handle_that_cannot_be_mapped_says_why(handle: IpcHandle, match: str) -> None:
    with pytest.raises(IpcUnavailable, match=match):
        map_peer(handle)


def test_a_handle_past_its_arena_is_refused() -> None:
    cache, _held = _shared_cache((2, 4))
    good = export_handle(cache)
    bad = IpcHandle("memfd", "float32", (4, 4), pid=good.pid, fd=good.fd, arena_bytes=32)
    with pytest.raises(IpcUnavailable, match="runs past its arena"):
        map_peer(bad)


def test_blocks_of_another_shape_are_not_copied() -> None:
    with pytest.raises(ValueError, match="copy_blocks"):
        copy_blocks(torch.zeros(2, 4), [0], torch.zeros(2, 8), [0])
    with pytest.raises(ValueError, match="2 source blocks, 1 destinations"):
        copy_blocks(torch.zeros(2, 4), [0, 1], torch.zeros(2, 4), [0])


@settings(max_examples=50, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 11), st.integers(0, 11)), max_size=12, unique_by=lambda p: p[1]
    )
)
def test_copies_land_where_asked_whatever_the_runs(pairs: list[tuple[int, int]]) -> None:
    # Few runs: a slice copy each; many: one gather (into a run of ids, or then a scatter).
    src = torch.randn(12, 3, 2, generator=torch.Generator().manual_seed(len(pairs)))
    dst = torch.zeros(12, 3, 2)
    src_ids, dst_ids = [s for s, _ in pairs], [d for _, d in pairs]
    copies = copy_blocks(src, src_ids, dst, dst_ids)
    assert copies == (len(runs(src_ids, dst_ids)) if len(runs(src_ids, dst_ids)) <= 8 else 1)
    untouched = set(range(12)) - set(dst_ids)
    assert all(torch.equal(dst[d], src[s]) for s, d in pairs)
    assert not any(dst[d].any() for d in untouched)


def test_scattered_sources_into_one_run_of_destinations_are_one_gather() -> None:
    src = torch.randn(20, 4)
    order = [17, 3, 9, 0, 12, 5, 19, 1, 8, 14]
    dst = torch.zeros(12, 4)
    assert copy_blocks(src, order, dst, list(range(2, 12))) == 1
    assert torch.equal(dst[2:], src[order]) and not dst[:2].any()


def test_blocks_outside_either_cache_or_on_two_devices_are_refused() -> None:
    with pytest.raises(ValueError, match=r"source block 4 outside 0\.\.3"):
        copy_blocks(torch.zeros(4, 2), [1, 4], torch.zeros(8, 2), [0, 1])
    with pytest.raises(ValueError, match="destination block -1 outside"):
        copy_blocks(torch.zeros(4, 2), [1], torch.zeros(8, 2), [-1])
    with pytest.raises(IpcUnavailable, match="source on meta, destination on cpu"):
        copy_blocks(torch.zeros(4, 2, device="meta"), [0], torch.zeros(4, 2), [0])
