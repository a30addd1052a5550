"""Adapter lifecycle units: tiers, LRU, reference counts, eviction, in-place revisions, unload, on-demand loads."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from kubelora.engine.adapters.manager import AdapterManager
from kubelora.engine.adapters.types import AdapterManagerConfig, Residency
from kubelora.engine.adapters.pool import DeviceLoRAPool, spec_bytes
from kubelora.engine.adapters.spec import AdapterLimits
from kubelora.engine.errors import AdapterExists, AdapterUnloading, UnknownAdapter
from kubelora.engine.model.config import LORA_MODULES, load_hf_config, model_config_from_hf


def make_manager(material, max_cpu_loras: int = 8, rows: int = 64,
                 fitting: tuple[str, ...] = ()) -> tuple[AdapterManager, DeviceLoRAPool]:
    """fitting: adapters of the material whose bytes, summed, are the pool's (instead of `rows` rank rows)."""
    model = model_config_from_hf(load_hf_config(material.model_dir), material.model_dir)
    num_bytes = sum(_bytes(model, material, name) for name in fitting) if fitting else None
    pool = DeviceLoRAPool(model, rows, torch.float32, torch.device("cpu"), num_bytes=num_bytes)
    limits = AdapterLimits(max_lora_rank=32, model_names=(model.name,),
                           is_base_model_strict=False)
    return AdapterManager(AdapterManagerConfig(max_cpu_loras=max_cpu_loras), model, pool, limits), pool


def _bytes(model, material, name: str) -> int:
    from kubelora.engine.adapters.peft_reader import read_adapter_spec

    limits = AdapterLimits(max_lora_rank=32, model_names=(model.name,), is_base_model_strict=False)
    return spec_bytes(model, torch.float32, read_adapter_spec(name, material.adapters[name], model, limits))


def wait_until(predicate, timeout: float = 30.0) -> None:  # generous: CI boxes are 2 busy cores
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def placed(manager, revision, protected) -> bool:
    return manager.ensure_device(revision, protected) is Residency.RESIDENT


def tiers(manager) -> dict[str, str]:
    return {info.name: info.tier for info in manager.list()}


def assert_resident_weights(pool: DeviceLoRAPool, revision) -> None:
    view = pool.view(revision.id, revision.spec.scales)
    for module, start in view.row_start.items():
        rank, b_start = view.rank[module], view.b_row(module)
        assert torch.equal(pool.a[module][:, start : start + rank], revision.host.a[module])
        assert torch.equal(pool.b[module][:, b_start : b_start + rank], revision.host.b[module])


def test_load_is_idempotent_and_reports_each_adapter(llama):
    manager, _ = make_manager(llama)
    first = manager.load("a", llama.adapters["r8-all"])
    again = manager.load("a", llama.adapters["r8-all"])
    assert again.revision == first.revision and len(manager.list()) == 1
    assert first.tier == "host" and first.rank == 8 and set(first.targets) == set(LORA_MODULES)
    # float32 pool: device bytes are the staged bytes plus at most one row of alignment per allocation
    assert first.host_bytes > 0 and first.host_bytes <= first.bytes < first.host_bytes * 9 // 8
    attn = manager.load("b", llama.adapters["r4-qv"])
    assert attn.targets == ("q_proj", "v_proj") and attn.bytes < first.bytes
    assert manager.unload("b") and not manager.unload("b")  # idempotent unload


def test_host_lru_evicts_the_least_recently_used_idle_adapter(llama):
    manager, _ = make_manager(llama, max_cpu_loras=2)
    for name in ("a", "b", "c"):
        manager.load(name, llama.adapters["r4-qv"] if name != "b" else llama.adapters["r8-all"])
    assert tiers(manager) == {"a": "known", "b": "host", "c": "host"}
    assert manager.stats().num_host_evictions == 1


def test_host_copy_in_use_is_never_evicted(llama):
    manager, _ = make_manager(llama, max_cpu_loras=1)
    manager.load("a", llama.adapters["r4-qv"])
    revision = manager.acquire("a")
    manager.load("b", llama.adapters["r8-all"])
    manager.load("c", llama.adapters["r16-all-rs"])
    assert tiers(manager)["a"] == "host"
    manager.release(revision)
    manager.load("d", llama.adapters["r4-qv"])
    assert tiers(manager)["a"] == "known"


def test_release_never_goes_negative(llama):
    manager, _ = make_manager(llama)
    manager.load("a", llama.adapters["r4-qv"])
    revision = manager.acquire("a")
    manager.release(revision)
    manager.release(revision)  # a double release is logged and ignored
    assert revision.num_refs == 0
    assert manager.get("a").num_refs == 0


def test_device_eviction_never_removes_protected_adapters(llama):
    manager, pool = make_manager(llama, fitting=("r32-attn", "r16-all-rs"))  # r8-all beside both does not fit
    revisions = {}
    for name in ("r32-attn", "r8-all", "r16-all-rs"):
        manager.load(name, llama.adapters[name])
        revisions[name] = manager.acquire(name)
    big, mid, new = revisions["r32-attn"], revisions["r8-all"], revisions["r16-all-rs"]
    assert placed(manager, big, set()) and placed(manager, mid, {big})
    assert manager.ensure_device(new, {big, mid}) is Residency.NO_ROOM, "both residents are in use"
    assert tiers(manager) == {"r32-attn": "device", "r8-all": "device", "r16-all-rs": "host"}
    assert placed(manager, new, {big})
    assert tiers(manager) == {"r32-attn": "device", "r8-all": "host", "r16-all-rs": "device"}
    assert manager.stats().num_device_evictions == 1
    assert_resident_weights(pool, big)
    assert_resident_weights(pool, new)


def test_device_eviction_prefers_idle_adapters(llama):
    manager, _ = make_manager(llama, fitting=("r32-attn", "r4-qv"))  # r8-all beside both does not fit
    for name in ("r32-attn", "r4-qv", "r8-all"):
        manager.load(name, llama.adapters[name])
    busy = manager.acquire("r4-qv")  # a waiting request holds it (not running: not protected)
    idle = manager.acquire("r8-all")
    assert placed(manager, busy, set()) and placed(manager, idle, set())
    manager.release(idle)
    big = manager.acquire("r32-attn")
    assert placed(manager, big, set())
    assert tiers(manager) == {"r32-attn": "device", "r4-qv": "device", "r8-all": "host"}


def test_compaction_keeps_resident_weights(llama, tmp_path):
    manager, pool = make_manager(llama, fitting=("r4-qv", "r16-all-rs", "r16-all-rs"))
    shutil.copytree(llama.adapters["r16-all-rs"], tmp_path / "r16-copy")
    paths = {"r4-qv": llama.adapters["r4-qv"], "r8-all": llama.adapters["r8-all"],
             "r16-all-rs": llama.adapters["r16-all-rs"], "r16-copy": tmp_path / "r16-copy"}
    revisions = {name: (manager.load(name, path), manager.acquire(name))[1] for name, path in paths.items()}
    for name in ("r4-qv", "r8-all", "r16-all-rs"):
        assert placed(manager, revisions[name], set(revisions.values()) - {revisions["r8-all"]})
    manager.release(revisions["r8-all"])
    manager.unload("r8-all")  # leaves a hole between r4 and r16: the room for r16-copy, not contiguous
    assert pool.free_bytes() == manager.get("r16-copy").bytes
    assert placed(manager, revisions["r16-copy"], set(revisions.values()))
    for name in ("r4-qv", "r16-all-rs", "r16-copy"):
        assert_resident_weights(pool, revisions[name])


def test_in_place_reload_keeps_the_old_revision_for_in_flight_requests(llama, tmp_path):
    manager, _ = make_manager(llama)
    path = tmp_path / "tenant"
    shutil.copytree(llama.adapters["r4-qv"], path)
    v1 = manager.load("tenant", path)
    old = manager.acquire("tenant")
    assert placed(manager, old, set())
    shutil.rmtree(path)
    shutil.copytree(llama.adapters["r8-all"], path)  # new files at the same path: a new revision
    with pytest.raises(AdapterExists):
        manager.load("tenant", path)
    v2 = manager.load("tenant", path, load_inplace=True)
    assert v2.revision != v1.revision and v2.rank == 8
    new = manager.acquire("tenant")
    assert new is not old and old.spec.revision == v1.revision and old.is_on_device
    both = manager.stats()
    manager.release(old)  # the last in-flight request on v1 finishes: v1 is freed
    after = manager.stats()
    assert after.pool_used_bytes == 0 and after.host_bytes == both.host_bytes - v1.host_bytes
    assert not old.is_on_device and old.host is None
    manager.release(new)


def test_unload_stops_admission_drains_then_frees(llama):
    manager, pool = make_manager(llama)
    baseline = manager.stats()
    manager.load("a", llama.adapters["r8-all"])
    revision = manager.acquire("a")
    assert placed(manager, revision, set())
    assert manager.unload("a")
    with pytest.raises(AdapterUnloading):
        manager.acquire("a")
    assert manager.get("a").is_unloading and manager.stats().pool_used_bytes > 0
    manager.release(revision)
    assert manager.get("a") is None
    with pytest.raises(UnknownAdapter):
        manager.acquire("a")
    stats = manager.stats()
    assert (stats.host_bytes, stats.pool_used_bytes) == (baseline.host_bytes, baseline.pool_used_bytes)


def test_hundred_load_unload_cycles_return_memory_to_baseline(llama):
    manager, pool = make_manager(llama, rows=40)
    manager.load("resident", llama.adapters["r4-qv"])
    baseline = manager.stats()
    names = list(llama.adapters)
    for i in range(100):
        name = names[i % len(names)]
        manager.load(f"cycle-{i % 3}", llama.adapters[name])
        revision = manager.acquire(f"cycle-{i % 3}")
        assert placed(manager, revision, set())
        if i % 2:
            manager.unload(f"cycle-{i % 3}")  # unload while in flight: freed on release
            manager.release(revision)
        else:
            manager.release(revision)
            manager.unload(f"cycle-{i % 3}")
    stats = manager.stats()
    assert (stats.host_bytes, stats.pool_used_bytes) == (baseline.host_bytes, baseline.pool_used_bytes)
    assert [a.name for a in manager.list()] == ["resident"]
    assert pool.free_bytes() == pool.total_bytes  # "resident" stays on the host tier


def test_known_adapter_is_loaded_on_demand_off_thread(llama):
    manager, _ = make_manager(llama)
    info = manager.load("lazy", llama.adapters["r16-all-rs"], preload=False)
    assert info.tier == "known" and info.host_bytes == 0 and info.rank == 16
    revision = manager.acquire("lazy")  # the request's arrival starts the load on the loader thread
    wait_until(lambda: manager.get("lazy").tier == "host")
    assert placed(manager, revision, set())
    assert manager.get("lazy").tier == "device"
    assert manager.stats().num_loads == 1


def test_adapter_evicted_from_host_is_reloaded_from_its_source(llama, monkeypatch):
    import threading

    from kubelora.engine.adapters import manager as manager_module

    manager, _ = make_manager(llama, max_cpu_loras=1)
    manager.load("a", llama.adapters["r4-qv"])
    manager.load("b", llama.adapters["r8-all"])
    assert tiers(manager) == {"a": "known", "b": "host"}
    read, go = manager_module.read_adapter_weights, threading.Event()
    monkeypatch.setattr(manager_module, "read_adapter_weights", lambda *args: go.wait(10) and read(*args))
    revision = manager.acquire("a")  # the reload starts on the loader thread and waits for `go`
    assert manager.ensure_device(revision, set()) is Residency.LOADING  # the scheduler skips it this step
    go.set()
    wait_until(lambda: revision.host is not None)
    assert placed(manager, revision, set())


def test_failed_on_demand_load_is_reported_once_then_retried(llama, tmp_path):
    manager, _ = make_manager(llama)
    path = tmp_path / "flaky"
    shutil.copytree(llama.adapters["r4-qv"], path)
    manager.load("flaky", path, preload=False)
    weights = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").unlink()
    revision = manager.acquire("flaky")
    wait_until(lambda: not manager.get("flaky").is_loading)
    error = manager.take_load_error(revision)
    assert "flaky" in error and "adapter_model.safetensors" in error
    assert manager.take_load_error(revision) is None
    assert manager.get("flaky").last_error == error
    (path / "adapter_model.safetensors").write_bytes(weights)
    assert not placed(manager, revision, set())  # retries
    wait_until(lambda: manager.get("flaky").tier == "host")
    assert placed(manager, revision, set())


def test_changed_files_fail_the_on_demand_load(llama, tmp_path):
    manager, _ = make_manager(llama)
    path = tmp_path / "moving"
    shutil.copytree(llama.adapters["r4-qv"], path)
    manager.load("moving", path, preload=False)
    config = path / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 8', '"lora_alpha": 9'))
    revision = manager.acquire("moving")
    wait_until(lambda: not manager.get("moving").is_loading)
    assert "load_inplace" in manager.take_load_error(revision)


def test_prefetch_fills_free_rows_only_most_recent_first(llama):
    """Idle prefetch places host-tier adapters into free rows (most recently used first), evicts nothing, and
    leaves what does not fit on the host; a prefetched adapter is evicted like any idle resident."""
    manager, pool = make_manager(llama, fitting=("r32-attn", "r16-all-rs"))
    for name in ("r32-attn", "r8-all", "r16-all-rs"):
        manager.load(name, llama.adapters[name])
    busy = manager.acquire("r32-attn")
    assert placed(manager, busy, set())
    assert manager.prefetch_device(1) == 1  # the most recently loaded first: r16-all-rs
    assert tiers(manager) == {"r32-attn": "device", "r8-all": "host", "r16-all-rs": "device"}
    assert manager.prefetch_device(4) == 0  # r8-all does not fit beside both
    assert tiers(manager)["r8-all"] == "host" and manager.stats().num_device_evictions == 0
    prefetched = manager.acquire("r16-all-rs")
    assert_resident_weights(pool, prefetched)
    manager.release(prefetched)
    mid = manager.acquire("r8-all")
    assert placed(manager, mid, {busy})  # the prefetched, idle r16-all-rs makes room
    assert tiers(manager) == {"r32-attn": "device", "r8-all": "device", "r16-all-rs": "host"}
