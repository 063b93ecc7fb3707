"""`pdserve_worker_device_memory_bytes`: a GPU worker's allocator figures at scrape time, one
sample per kind; nothing on the CPU, where torch has no allocator of its own to read."""

from __future__ import annotations

import torch

from pdserve.engine.outputs import EngineStats
from pdserve.model.device import device_memory
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import parse, total
from pdserve.worker.metrics import WorkerCounters, render


def _stats(memory: dict[str, int]) -> EngineStats:
    return EngineStats(64, 50, 3, 4, 1, 2, 1, 0, 0, device_memory=memory)


def test_each_allocator_figure_is_a_sample_of_its_kind() -> None:
    text = render("d-1", _stats({"allocated": 3 << 30, "reserved": 5 << 30}), 0, WorkerCounters())
    samples = parse(text)
    name = m.WORKER_DEVICE_MEMORY.name
    assert total(samples, name, kind="allocated", worker_id="d-1") == 3 << 30
    assert total(samples, name, kind="reserved", worker_id="d-1") == 5 << 30


def test_kv_staged_through_the_host_mirror_is_a_counter_by_direction() -> None:
    stats = EngineStats(64, 50, 3, 4, 1, 2, 1, 0, 0, host_staged_bytes={"out": 6, "in": 4})
    samples = parse(render("p-1", stats, 0, WorkerCounters()))
    name = m.WORKER_KV_HOST_STAGED_BYTES.name
    assert total(samples, name, direction="out", worker_id="p-1") == 6
    assert total(samples, name, direction="in", worker_id="p-1") == 4
    # An unstaged cache (the CPU default) exports no samples rather than zeros.
    assert not [s for s in parse(render("p-1", _stats({}), 0, WorkerCounters())) if s.name == name]


def test_a_cpu_worker_reports_no_device_memory() -> None:
    assert device_memory(torch.device("cpu")) == {}
    samples = parse(render("d-1", _stats({}), 0, WorkerCounters()))
    assert not [s for s in samples if s.name == m.WORKER_DEVICE_MEMORY.name]


def test_the_engine_fills_its_stats_from_its_device() -> None:
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import Engine

    engine = Engine.from_config(EngineConfig(kv_cache_bytes=1 << 20))
    assert engine.stats().device_memory == device_memory(engine.kv_cache.device)
