"""DeepSeek-V3 (deepseek_v3) in this process, beside what tests/test_moe.py runs on its default checkpoint (every
TP=1 scenario, offload, routing statistics, both expert layouts; tests/test_moe_parity.py: TP=2): the MLA variant
without q_lora_rank and with rotary not interleaved, token-identical to transformers in one batch that chunks,
shares prefixes and preempts; the pages hold the latent only, and the page budget counts that; a checkpoint's
multi-token-prediction layers are skipped; what it refuses; attention biases."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import cluster
from cluster.config import ContinuousBatchingConfig, resolve_config
from cluster.errors import UnsupportedModel
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy
from tests.workloads import NEW_TOKENS, mixed_prompts, shared_prefix_prompts
from worker.kv_cache import kv_bytes_per_token
from worker.memory import tensor_bytes

PLAIN_Q = {"q_lora_rank": None, "rope_interleave": False}  # q_proj instead of q_a/q_b; rotate-half rotary


@pytest.mark.slow  # about 6 s on the shared 2 cores (the checkpoint made, transformers' tokens cached)
def test_plain_q_variant_matches_transformers(make_checkpoint):
    """One batch that chunks its prefills (prompts longer than max_batch_tokens), shares prefixes (two families of
    two) and preempts (a cache of 24 pages), on the variant with q_proj and non-interleaved rotary."""
    model_dir = make_checkpoint("deepseek_v3", **PLAIN_Q)
    model = cluster.load(model_dir)
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_proj") and not hasattr(attn, "q_b_proj") and not attn.interleaved
    shared, mixed = shared_prefix_prompts(model.config.vocab_size), mixed_prompts(model.config.vocab_size)
    prompts = shared[0:2] + shared[8:10] + [mixed[11], mixed[15]]  # 101 to 300 tokens
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, continuous_batching_config=cluster.
                               ContinuousBatchingConfig(page_size=16, num_blocks=24, max_batch_tokens=128,
                                                        allow_block_sharing=True))
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)
    assert all(o.status == RequestStatus.FINISHED for o in out.values())
    stats = model.last_stats
    assert stats["prefix_hit_blocks"] > 0 and stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0


@pytest.mark.parametrize("q_lora_rank", [64, None])
def test_attention_biases_as_transformers(q_lora_rank, make_checkpoint, tmp_path):
    """`attention_bias`: biases on q_a_proj and kv_a_proj_with_mqa (one fused replicated product here) and on
    o_proj, none on q_proj, q_b_proj, kv_b_proj; random (transformers initialises them to zeros), token-identical."""
    model_dir = tmp_path / "biased"
    shutil.copytree(make_checkpoint("deepseek_v3", attention_bias=True, q_lora_rank=q_lora_rank), model_dir)
    tensors, gen = load_file(str(model_dir / "model.safetensors")), torch.Generator().manual_seed(0)
    biases = sorted(n for n in tensors if n.endswith("proj.bias") or n.endswith("mqa.bias"))
    assert {n.split(".")[-2] for n in biases} == {"kv_a_proj_with_mqa", "o_proj"} | (
        {"q_a_proj"} if q_lora_rank else set())
    for name in biases:
        tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.5
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[5, 9, 200, 1000, 17, 4] * 5, [7, 8, 9]]
    out = cluster.load(model_dir).generate_batch(prompts, max_new_tokens=8)
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts, 8)


def test_pages_hold_the_latent_and_the_budget_counts_it(make_checkpoint):
    """One cached row a token and layer, [latent | rope key] (kv_lora_rank + qk_rope_head_dim = 48 floats), no
    value tensors: 768 bytes a token over the 4 layers where per-head K and V would take 5120; the runner's cache is
    exactly that many bytes a slot, and the same memory budget gives 6.7 times the pages."""
    model_dir = make_checkpoint("deepseek_v3")
    model = cluster.load(model_dir)
    c = model.config
    q_heads, kv_heads, width = model.model.kv_layout()
    assert (q_heads, kv_heads, width) == (c.num_attention_heads, 1, c.kv_lora_rank + c.qk_rope_head_dim)
    per_token = kv_bytes_per_token(c.num_hidden_layers, kv_heads, width, torch.float32, model.model.kv_values)
    expanded = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim
                                                              + c.v_head_dim) * 4
    assert (per_token, expanded) == (768, 5120)
    cb = ContinuousBatchingConfig(page_size=16, max_batch_tokens=64)
    model.generate_batch([[5, 6, 7]], max_new_tokens=2, continuous_batching_config=cb)
    _, runner, rc = model._idle
    cache = runner.cache
    assert cache.v is cache.k and cache.k[0].shape == ((rc.num_blocks + 1) * 16, 1, width)
    assert tensor_bytes(cache.tensors()) == (rc.num_blocks + 1) * 16 * per_token

    def pages(per: int) -> int:
        return resolve_config(ContinuousBatchingConfig(page_size=16, max_requests_per_batch=64),
                              device_kind="cpu", max_model_len=1 << 20, kv_bytes_per_token=per,
                              free_bytes=1 << 28, flash_available=False).num_blocks

    assert pages(per_token) > 6 * pages(expanded)


def test_multi_token_prediction_layers_are_skipped(make_checkpoint, tmp_path):
    """A checkpoint with an MTP module (layer num_hidden_layers: its own enorm, hnorm, eh_proj, shared head and a
    whole decoder layer, as DeepSeek-V3 publishes layer 61) loads to exactly the weights of the one without it;
    the model's state_dict() names exactly the base checkpoint's tensors (MLA's fused q_a/kv_a parts under their
    own names), with their values."""
    base = make_checkpoint("deepseek_v3")
    with_mtp = tmp_path / "mtp"
    shutil.copytree(base, with_mtp)
    tensors = load_file(str(base / "model.safetensors"))
    n, hidden = json.loads((base / "config.json").read_text())["num_hidden_layers"], 256
    mtp = {name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): t.clone() + 1.0
           for name, t in tensors.items() if name.startswith(f"model.layers.{n - 1}.")}
    mtp |= {f"model.layers.{n}.{k}": torch.ones(hidden) for k in ("enorm.weight", "hnorm.weight",
                                                                  "shared_head.norm.weight")}
    mtp |= {f"model.layers.{n}.eh_proj.weight": torch.ones(hidden, 2 * hidden),
            f"model.layers.{n}.shared_head.head.weight": torch.ones(2048, hidden)}
    save_file(tensors | mtp, str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
    plain, loaded = cluster.load(base), cluster.load(with_mtp)
    assert len(loaded.model.layers) == n
    for (name, a), (_, b) in zip(plain.model.named_parameters(), loaded.model.named_parameters()):
        assert torch.equal(a, b), name
    state = loaded.state_dict()
    assert set(state) == set(tensors) and all(torch.equal(state[name], t) for name, t in tensors.items())


def test_deepseek_v3_refuses_by_name():
    from transformers import DeepseekV3Config

    from worker.models import check_supported

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, hidden_act="gelu")
    with pytest.raises(UnsupportedModel, match="hidden_act 'gelu' is not supported"):
        check_supported(config)


def test_heads_that_do_not_split_are_refused():
    from transformers import DeepseekV3Config

    from worker.latent_attention import LatentAttention
    from worker.layers import Shard

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=3,
                              kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
                              v_head_dim=8)
    LatentAttention(config, Shard(rank=0, size=1), torch.float32)
    with pytest.raises(UnsupportedModel, match="num_attention_heads=3 does not split over tp=2"):
        LatentAttention(config, Shard(rank=0, size=2), torch.float32)
