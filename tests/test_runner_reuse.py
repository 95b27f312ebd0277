"""One runner across generate_batch calls (KV cache, static buffers, compiled forwards and decode graphs kept while
the config is equal), decode graphs captured only up to the batch a call can fill, and the CUDA graph pool's
bound in the KV sizing (worker/memory.py). Graphs are captured by the CPU stand-in (`graphs.EagerStandIn`)."""

from __future__ import annotations

import types

import pytest
import torch

import cluster
from tests.conftest import hf_greedy
from cluster.config import ContinuousBatchingConfig, resolve_config
from worker.graphs import EagerStandIn, decode_buckets
from worker.memory import graph_pool_bytes, hidden_peak_bytes, propose_num_blocks

CFG = {"page_size": 16, "num_blocks": 64, "max_requests_per_batch": 8, "max_blocks_per_request": 8}
PROMPTS = [[3, 17, 29, 41, 5], [9, 8, 7], [100, 101, 102, 103, 104, 105, 106]]
NEW = 6


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("qwen3")


@pytest.fixture
def model(model_dir):
    m = cluster.load(model_dir)
    m.graph_factory = EagerStandIn
    return m


def run(model, prompts, **cfg) -> tuple[list[list[int]], object]:
    out = model.generate_batch(prompts, continuous_batching_config={**CFG, **cfg}, max_new_tokens=NEW)
    return [o.generated_tokens for o in out.values()], model._idle[1]


def test_a_second_call_with_the_same_config_captures_nothing(model, model_dir):
    first, runner = run(model, PROMPTS)
    assert first == hf_greedy(model_dir, PROMPTS, NEW)
    stats = runner.graph_stats
    assert stats["captured_buckets"] == [1, 2, 4] and stats["captures"] == 3 and stats["replays"] > 0
    replays, cache = stats["replays"], runner.cache.k[0]

    again, same = run(model, PROMPTS)
    assert same is runner and runner.cache.k[0] is cache  # the same runner, KV cache and graphs
    assert again == first
    assert stats["captures"] == 3 and stats["replays"] > replays  # replayed, nothing captured again

    _, other = run(model, PROMPTS, page_size=32)  # another config: another runner, the old one let go
    assert other is not runner and other.graph_stats["captures"] == 3
    model.release_idle_runner()
    assert model._idle is None


def test_graphs_are_captured_up_to_the_batch_a_call_can_fill(model, model_dir):
    _, runner = run(model, PROMPTS[:1])
    assert runner.graph_stats["captured_buckets"] == [1]  # one prompt: one row, whatever max_requests_per_batch
    prompts = PROMPTS + [[5, 6, 7, 8], [11, 12]]  # five: up to the bucket of 8
    got, again = run(model, prompts)
    assert again is runner and got == hf_greedy(model_dir, prompts, NEW)
    assert runner.graph_stats["captured_buckets"] == [1, 2, 4, 8] and runner.graph_stats["captures"] == 4
    _, runner = run(model, PROMPTS, num_blocks=2)  # two pages: no step ever holds more than two sequences
    assert runner.graph_stats["captured_buckets"] == [1, 2]


def test_a_manager_that_failed_leaves_no_runner_to_reuse(model):
    _, runner = run(model, PROMPTS[:1])
    manager = model.init_continuous_batching(continuous_batching_config=CFG)
    assert manager.runner is runner and model._idle is None  # taken: no second manager can have it
    manager.loop_error = RuntimeError("the loop died")
    manager.destroy()
    assert model._idle is None


def test_the_graph_pool_bound_holds_every_bucket_output(model):
    _, runner = run(model, PROMPTS + [[5, 6, 7, 8], [11, 12]])
    cfg, itemsize = model.config, model.dtype.itemsize
    buckets = runner.graph_stats["captured_buckets"]
    held = runner.graph_stats["output_bytes"]  # what the stand-in's captures keep alive, as a CUDA pool would
    assert held == sum(buckets) * cfg.vocab_size * itemsize
    bound = graph_pool_bytes(buckets, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, itemsize)
    assert held < bound == held + hidden_peak_bytes(max(buckets), cfg.hidden_size, cfg.intermediate_size, itemsize)


def test_the_kv_sizing_leaves_a_real_vocabularys_graph_pool_free():
    # a Qwen3-8B-like rank in bfloat16 with decode graphs up to 1024 rows: their outputs alone take 622 MB
    cfg = types.SimpleNamespace(hidden_size=4096, intermediate_size=12288, vocab_size=151936)
    rc = resolve_config(ContinuousBatchingConfig(page_size=16, max_batch_tokens=2048, max_requests_per_batch=1024,
                                                 num_blocks=1, use_cuda_graph=True), device_kind="cuda",
                        max_model_len=4096, kv_bytes_per_token=1 << 17, free_bytes=None, flash_available=False)
    _, parts = propose_num_blocks(rc, cfg, 1, torch.bfloat16, "cuda:0", 1 << 17, object(),
                                  measure=lambda _: (80 << 30, 80 << 30))
    outputs = sum(decode_buckets(1024)) * 151936 * 2
    assert outputs > 590 << 20  # 622 MB
    assert parts["graph_pool"] >= outputs  # before: the largest bucket's activations only, about 25 MB
