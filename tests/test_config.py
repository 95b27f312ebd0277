"""Every ContinuousBatchingConfig field of the seed: same name and default, honoured or resolved to an
effective value the manager reports, invalid values refused by name, deprecated ones warned about."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from transformers import ContinuousBatchingConfig as HFConfig
from transformers import GenerationConfig

import cluster
from cluster.config import LOCKSTEP_FIELDS, ContinuousBatchingConfig, load_preset, resolve_config
from tests.conftest import REPO
from tests.workloads import mixed_prompts


def resolved(**fields):
    return resolve_config(ContinuousBatchingConfig(**fields), device_kind="cpu", max_model_len=1024,
                          kv_bytes_per_token=4096, free_bytes=8 << 30, flash_available=False)


def test_same_fields_and_defaults_as_transformers():
    ours = {f.name: f.default for f in dataclasses.fields(ContinuousBatchingConfig) if f.name not in LOCKSTEP_FIELDS}
    theirs = {f.name: f.default for f in dataclasses.fields(HFConfig)}
    assert set(ours) == set(theirs)
    assert {k: v for k, v in ours.items() if v is not dataclasses.MISSING} == \
        {k: v for k, v in theirs.items() if v is not dataclasses.MISSING}


def test_transformers_config_is_accepted():
    hf = HFConfig(page_size=32, max_batch_tokens=77, scheduler_type="prefill_first")
    ours = ContinuousBatchingConfig.from_any(hf)
    assert (ours.page_size, ours.max_batch_tokens, ours.scheduler_type) == (32, 77, "prefill_first")


@pytest.mark.parametrize("field,value", [
    ("page_size", 0), ("num_blocks", -1), ("max_batch_tokens", 0), ("max_memory_percent", 1.5),
    ("max_requests_per_batch", 0), ("max_blocks_per_request", -2), ("q_padding_interval_size", -1),
    ("kv_padding_interval_size", -8), ("default_compile_level", 7), ("scheduler_type", "lifo"),
    ("safety_margin", 1.0), ("seed", "x"), ("use_cuda_graph", "yes"), ("cpu_offload_space", -1.0),
    ("cpu_offload_space_safety_threshold", 2.0), ("max_queue_size", -1), ("cpu_group_timeout", 0),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ContinuousBatchingConfig(**{field: value})


@pytest.mark.parametrize("field,value,now", [
    ("block_size", 64, ("page_size", 64)), ("use_default_compile_configs", True, ("default_compile_level", 3)),
    ("max_cached_graphs", 8, None),
])
def test_deprecated_fields_warn(field, value, now):
    with pytest.warns(DeprecationWarning, match=field):
        cfg = ContinuousBatchingConfig(**{field: value})
    if now:
        assert getattr(cfg, now[0]) == now[1]


def test_sizes_and_paddings_resolve():
    rc = resolved(page_size=16, num_blocks=50, max_batch_tokens=96, max_requests_per_batch=12,
                  q_padding_interval_size=8, kv_padding_interval_size=32, max_blocks_per_request=20,
                  safety_margin=0.1, scheduler_type="prefill_first", allow_block_sharing=False)
    assert (rc.page_size, rc.num_blocks, rc.max_batch_tokens, rc.max_requests_per_batch) == (16, 50, 96, 12)
    assert (rc.q_padding, rc.kv_padding, rc.scheduler_type, rc.allow_block_sharing) == (8, 32, "prefill_first", False)
    assert rc.max_model_len == 320  # 20 blocks of 16 tokens
    assert rc.safety_margin == 0.1


def test_the_cpu_pads_an_eager_forwards_queries_less_than_a_compiled_ones():
    # a 5-token speculative verify runs 8 rows eagerly; a compiled varlen forward keeps 32 (fewer shapes to compile)
    assert resolved().q_padding == 8
    assert resolved(default_compile_level=1).q_padding == 32
    assert resolved(default_compile_level=1, q_padding_interval_size=16).q_padding == 16


def test_cache_sized_from_memory_when_num_blocks_is_none():
    default = resolved(page_size=16)
    assert default.num_blocks * 16 * 4096 <= 1 << 30
    by_percent = resolved(page_size=16, max_memory_percent=0.001)
    assert by_percent.num_blocks == int((8 << 30) * 0.001) // (16 * 4096)


def test_hardware_fields_resolve_with_notes():
    rc = resolved(use_cuda_graph=True, default_compile_level=2)
    assert rc.use_cuda_graph == (False, False) and rc.attention == "paged_sdpa"
    text = " ".join(rc.notes)
    for word in ("use_cuda_graph", "compile"):
        assert word in text


def on_cuda(flash_available=True, dtype="bfloat16", head_dim=128, triton_available=False, **fields):
    return resolve_config(ContinuousBatchingConfig(**fields), device_kind="cuda", max_model_len=4096,
                          kv_bytes_per_token=4096, free_bytes=8 << 30, flash_available=flash_available,
                          dtype=dtype, head_dim=head_dim, triton_available=triton_available)


def path_note(rc) -> str:
    """The one note that names the attention path."""
    (note,) = [n for n in rc.notes if n.startswith("attention -> ")]
    return note


def test_flash_only_for_half_precision_small_heads_and_256_pages():
    import torch

    for dtype in ("float16", "bfloat16", torch.float16, torch.bfloat16):
        rc = on_cuda(dtype=dtype, page_size=256)
        assert rc.attention == "flash_attn" and rc.paged_kernels
        assert path_note(rc).startswith("attention -> flash_attn")
    assert on_cuda(page_size=512, head_dim=256).attention == "flash_attn"
    refused = {"float32": on_cuda(dtype=torch.float32, page_size=256),
               "head_dim": on_cuda(head_dim=512, page_size=256),
               "page_size": on_cuda(page_size=128),
               "importable": on_cuda(flash_available=False, page_size=256),
               "unknown": on_cuda(dtype=None, page_size=256),
               "auto_switch_to_flash": on_cuda(page_size=256, auto_switch_to_flash=False)}
    for why, rc in refused.items():
        assert rc.attention == "paged_sdpa" and not rc.paged_kernels, why  # no Triton either
        assert "flash-attn" in path_note(rc) and "Triton is not importable" in path_note(rc), why
        assert why.split("_")[0] in path_note(rc) or why == "unknown", why
    assert "unknown dtype" in path_note(refused["unknown"])
    # the CPU never runs flash-attn or Triton, and says nothing about either
    cpu = resolve_config(ContinuousBatchingConfig(page_size=256), device_kind="cpu", max_model_len=1024,
                         kv_bytes_per_token=4096, free_bytes=None, flash_available=True, dtype="bfloat16",
                         head_dim=64, triton_available=True)
    assert cpu.attention == "paged_sdpa" and not any("flash" in n or "Triton" in n for n in cpu.notes)


def test_triton_paged_where_flash_cannot_serve():
    """CUDA without flash-attn (or where it does not fit) takes the Triton kernel where Triton imports: float32
    included, any page size; flash-attn stays the first choice; paged SDPA where neither serves."""
    import torch

    assert on_cuda(page_size=256, triton_available=True).attention == "flash_attn"
    for kw in ({"flash_available": False}, {"dtype": torch.float32}, {"page_size": 16},
               {"auto_switch_to_flash": False}, {"flash_available": False, "dtype": "float16", "head_dim": 80}):
        rc = on_cuda(triton_available=True, **{"page_size": 256, **kw})
        assert rc.attention == "triton_paged" and rc.paged_kernels, kw
        assert path_note(rc).startswith("attention -> triton_paged: flash-attn"), kw
    assert "float32" in path_note(on_cuda(dtype=torch.float32, triton_available=True))
    for kw in ({"head_dim": 512}, {"dtype": None}, {"dtype": torch.float64}):
        rc = on_cuda(triton_available=True, flash_available=False, **kw)
        assert rc.attention == "paged_sdpa" and "the Triton kernel needs" in path_note(rc), kw


def test_cuda_graphs_resolve_to_decode_only_with_a_note():
    assert on_cuda().use_cuda_graph == (False, True)  # None: decode graphs where there is a GPU
    assert on_cuda(use_cuda_graph=True).use_cuda_graph == (False, True)
    assert on_cuda(use_cuda_graph=(True, False)).use_cuda_graph == (False, False)
    assert on_cuda(use_cuda_graph=False).use_cuda_graph == (False, False)
    assert not any("use_cuda_graph" in n for n in on_cuda(use_cuda_graph=False).notes)
    text = " ".join(on_cuda(use_cuda_graph=True).notes)
    assert "use_cuda_graph" in text and "decode" in text
    assert resolved().use_cuda_graph == (False, False)


def test_manager_reports_effective_config(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(
        page_size=16, num_blocks=40, use_cuda_graph=True))
    assert m.effective_config.num_blocks == 40 and m.effective_config.use_cuda_graph == (False, False)
    assert m.runner.cache.k[0].shape[0] == 41 * 16  # 40 pages and the scratch block
    assert m.switch_to_cb_friendly_attn() == "paged_sdpa"
    m.destroy()


def test_max_requests_per_batch_caps_a_step(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    prompts = mixed_prompts(2048)[:6]
    steps = {}
    for cap in (1, 6):
        model.generate_batch(prompts, max_new_tokens=4, continuous_batching_config=ContinuousBatchingConfig(
            page_size=16, max_requests_per_batch=cap, allow_block_sharing=False))
        steps[cap] = model.last_stats["step"]
        assert model.last_stats["attention"] == "paged_sdpa"  # the path stats() names
    assert steps[1] > 3 * steps[6]


def test_per_request_processors(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    prompt = mixed_prompts(2048)[5]
    on = ContinuousBatchingConfig(per_request_processors=True, seed=3)
    with model.continuous_batching_context_manager(continuous_batching_config=on) as m:
        greedy = m.add_request(prompt, max_new_tokens=12)
        hot = m.add_request(prompt, max_new_tokens=12, do_sample=True, temperature=5.0)
        tokens = {r: m.get_result(r, timeout=60).generated_tokens for r in (greedy, hot)}
    assert tokens[greedy] != tokens[hot]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with model.continuous_batching_context_manager() as m:
            ignored = m.add_request(prompt, max_new_tokens=12, do_sample=True, temperature=5.0)
            assert m.get_result(ignored, timeout=60).generated_tokens == tokens[greedy]
    assert any("per_request_processors" in str(w.message) for w in caught)


def test_unsupported_processors_dropped_or_refused(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    gen = GenerationConfig(max_new_tokens=4, num_beams=2)
    with pytest.warns(UserWarning, match="num_beams"):
        out = model.generate_batch([[5, 6, 7]], generation_config=gen)
    assert len(out["req_0"].generated_tokens) == 4
    with pytest.raises(ValueError, match="num_beams"):
        model.generate_batch([[5, 6, 7]], generation_config=gen,
                             continuous_batching_config=ContinuousBatchingConfig(drop_unsupported_processors=False))


@pytest.mark.slow
def test_record_timestamps(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    out = model.generate_batch([[5, 6, 7]], max_new_tokens=5, record_timestamps=True)["req_0"]
    assert len(out.timestamps) == 5 and out.timestamps == sorted(out.timestamps)
    assert out.lifespan[0] <= out.timestamps[0] and out.lifespan[1] >= out.timestamps[-1]


def test_presets_load():
    for name in ("tiny-cpu", "small-cpu", "h100-tp8"):
        cfg = load_preset(REPO / "configs" / f"{name}.toml")
        assert cfg.page_size > 0


def test_a_transformers_config_with_block_size_only_keeps_its_page_size():
    """transformers before `page_size` existed named it `block_size`: from_any must not fall back to 256."""
    from types import SimpleNamespace

    from cluster.config import ContinuousBatchingConfig

    old = SimpleNamespace(block_size=32, num_blocks=64, max_batch_tokens=128)
    cfg = ContinuousBatchingConfig.from_any(old)
    assert cfg.page_size == 32 and cfg.num_blocks == 64 and cfg.max_batch_tokens == 128
