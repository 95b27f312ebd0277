"""KV cache sizing on CUDA, driven on the CPU with numbers: every overhead counted, safety_margin and
max_memory_percent honoured, free memory measured after the allocator's cached blocks are released, and a
second manager of the same model getting the same cache as the first (not what the first left over)."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig

from cluster.config import ContinuousBatchingConfig, resolve_config
from worker.memory import (CacheLedger, MemoryInputs, activation_peak_bytes, measure_free_bytes, plan_kv_blocks,
                           propose_num_blocks, static_buffer_bytes)
from worker.runner import StaticBuffers

GiB = 1 << 30
MiB = 1 << 20
PAGE = 16
PER_TOKEN = 64 * 1024  # K+V bytes per token, all layers: one page is 1 MiB


def inputs(**kw) -> MemoryInputs:
    base = dict(free_bytes=10 * GiB, kv_bytes_per_token=PER_TOKEN, page_size=PAGE, max_memory_percent=1.0)
    base.update(kw)
    return MemoryInputs(**base)


def test_every_overhead_comes_off_the_budget():
    blocks, parts = plan_kv_blocks(inputs())
    assert blocks == 10 * 1024 and parts["page_bytes"] == MiB
    overheads = dict(static_bytes=100 * MiB, graph_pool_bytes=200 * MiB, activation_bytes=300 * MiB,
                     attention_workspace_bytes=400 * MiB)
    for name, size in overheads.items():
        assert plan_kv_blocks(inputs(**{name: size}))[0] == 10 * 1024 - size // MiB, name
    blocks, parts = plan_kv_blocks(inputs(**overheads))
    assert blocks == 10 * 1024 - 1000
    assert (parts["static"], parts["graph_pool"], parts["activations"], parts["attention_workspace"]) == (
        100 * MiB, 200 * MiB, 300 * MiB, 400 * MiB)
    assert parts["kv_cache"] == blocks * MiB <= parts["available"] - 1000 * MiB


def test_safety_margin_and_max_memory_percent_are_honoured():
    assert plan_kv_blocks(inputs(safety_margin=0.25))[0] == 10 * 1024 * 3 // 4
    assert plan_kv_blocks(inputs(max_memory_percent=0.5))[0] == 5 * 1024
    assert plan_kv_blocks(inputs(max_memory_percent=None))[0] == int(10 * GiB * 0.9) // MiB  # transformers' 0.9
    blocks, parts = plan_kv_blocks(inputs(max_memory_percent=0.5, safety_margin=0.5, static_bytes=1 * GiB))
    assert blocks == (5 * GiB - 1 * GiB) // 2 // MiB and parts["safety_margin"] == 2 * GiB


def test_cap_and_not_even_one_page():
    assert plan_kv_blocks(inputs(max_blocks=77))[0] == 77
    with pytest.raises(MemoryError, match="no KV page fits"):
        plan_kv_blocks(inputs(free_bytes=GiB, activation_bytes=GiB))
    with pytest.raises(ValueError, match="safety_margin"):
        plan_kv_blocks(inputs(safety_margin=1.0))


def test_free_memory_is_measured_after_the_cached_blocks_are_released(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("synchronize", d)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))

    def mem_get_info(device=None):
        calls.append(("mem_get_info", device))
        return 7 * GiB, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert measure_free_bytes("cuda:1") == (7 * GiB, 80 * GiB)
    names = [c[0] for c in calls]
    assert names.index("empty_cache") < names.index("mem_get_info")
    # empty_cache acts on the current device: it is set to the measured one first
    assert calls[names.index("set_device")][1] == torch.device("cuda", 1)
    assert names.index("set_device") < names.index("empty_cache")
    assert calls[names.index("mem_get_info")][1] == torch.device("cuda", 1)
    calls.clear()
    free, total = measure_free_bytes("cpu")
    assert calls == [] and 0 < free <= total


def small_rc(graphs: bool = False, max_model_len: int = 4096):
    rc = resolve_config(ContinuousBatchingConfig(page_size=PAGE, max_batch_tokens=256, max_requests_per_batch=8,
                                                 num_blocks=1), device_kind="cuda", max_model_len=max_model_len,
                        kv_bytes_per_token=PER_TOKEN, free_bytes=None, flash_available=False)
    rc.use_cuda_graph = (graphs, graphs)
    return rc


def test_static_buffers_and_graph_pool_are_counted():
    rc = small_rc()
    real = StaticBuffers(rc, torch.device("cpu")).buffers.values()
    assert static_buffer_bytes(rc) == sum(t.numel() * t.element_size() for t in real) > 0
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, vocab_size=1000)
    fake = FakeGPU(total=80 * GiB, model=0)
    kw = dict(owner=object(), ledger=CacheLedger(), measure=fake.measure)
    off = propose_num_blocks(rc, cfg, 1, torch.bfloat16, "cuda:0", PER_TOKEN, **kw)[1]
    on = propose_num_blocks(small_rc(graphs=True), cfg, 1, torch.bfloat16, "cuda:0", PER_TOKEN, **kw)[1]
    assert off["graph_pool"] == 0 < on["graph_pool"]
    assert off["static"] == static_buffer_bytes(rc)
    assert off["activations"] == activation_peak_bytes(rc.max_tokens_padded, 256, 512, 1000, 8, 2) > 0


class FakeGPU:
    """A device whose free memory is its total less the model and every cache still allocated on it."""

    def __init__(self, total: int, model: int):
        self.total, self.model = total, model
        self.caches: list[FakeCache] = []

    def measure(self, device) -> tuple[int, int]:
        live = sum(c.nbytes for c in self.caches if _holds_tensors(c))
        return self.total - self.model - live, self.total

    def allocate(self, blocks: int) -> "FakeCache":
        cache = FakeCache(blocks * PAGE * PER_TOKEN)
        self.caches.append(cache)
        return cache


def _holds_tensors(cache) -> bool:
    try:
        iter(cache.k)
        return True
    except RuntimeError:
        return False


class FakeCache:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.k, self.v = ["layer0"], ["layer0"]


def size(gpu: FakeGPU, ledger: CacheLedger, owner: object) -> int:
    rc = small_rc(max_model_len=1 << 15)  # caps the cache at 8 x 2048 pages: above what these GPUs hold
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, vocab_size=1000)
    return propose_num_blocks(rc, cfg, 1, torch.bfloat16, "cuda:0", PER_TOKEN, owner, ledger=ledger,
                              measure=gpu.measure)[0]


def build_manager_cache(gpu: FakeGPU, ledger: CacheLedger, owner: object) -> tuple[int, FakeCache]:
    """What build_runner does: size, release the owner's earlier caches, allocate, enter the new one."""
    blocks = size(gpu, ledger, owner)
    ledger.release_all("cuda:0", owner)
    cache = gpu.allocate(blocks)
    ledger.hold(cache, "cuda:0", owner, cache.nbytes)
    return blocks, cache


def test_second_manager_gets_the_same_cache_while_the_first_is_still_live():
    gpu, ledger, model = FakeGPU(total=12 * GiB, model=2 * GiB), CacheLedger(), object()
    first, cache1 = build_manager_cache(gpu, ledger, model)
    assert 5000 < first < 8 * 2048
    # without adding back the first cache, the second manager would get about a tenth of it
    assert size(gpu, CacheLedger(), model) < first // 5
    second, cache2 = build_manager_cache(gpu, ledger, model)
    assert second == first
    with pytest.raises(RuntimeError, match="released to a newer manager"):
        list(cache1.k)  # the replaced manager's cache refuses to be used instead of serving garbage
    assert ledger.held("cuda:0", model) == cache2.nbytes
    third, _ = build_manager_cache(gpu, ledger, model)
    assert third == first


def test_second_manager_gets_the_same_cache_after_the_first_was_destroyed():
    gpu, ledger, model = FakeGPU(total=12 * GiB, model=2 * GiB), CacheLedger(), object()
    first, cache = build_manager_cache(gpu, ledger, model)
    gpu.caches.remove(cache)
    del cache
    gc.collect()
    assert ledger.held("cuda:0", model) == 0  # the entry left with the cache: its bytes are free again
    assert build_manager_cache(gpu, ledger, model)[0] == first


def test_another_models_cache_is_neither_counted_nor_released():
    gpu, ledger = FakeGPU(total=12 * GiB, model=2 * GiB), CacheLedger()
    a, b = object(), object()
    _, cache_a = build_manager_cache(gpu, ledger, a)
    blocks_b, _ = build_manager_cache(gpu, ledger, b)
    assert blocks_b < 1000  # b really has only what a left
    assert list(cache_a.k) == ["layer0"]  # a's cache untouched
    assert ledger.held("cuda:0", a) == cache_a.nbytes and ledger.held("cuda:1", a) == 0
