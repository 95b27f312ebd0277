"""Gemma 3 (gemma3_text) in this process (TP=1): token-identical to transformers' generate (greedy, float32) with a
sliding window shorter than the prompts, under chunked prefill, prefix sharing and preemption; its (1 + w) norm as
transformers'; what it refuses. tests/test_parity.py runs it at TP=2 (every scenario, overlapped)."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster.errors import UnsupportedModel
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy
from tests.workloads import NEW_TOKENS, mixed_prompts, shared_prefix_prompts
from worker.layers import GemmaRMSNorm

GEMMA3 = {"sliding_window": 48}  # shorter than most of the parity prompts: the window is exercised


def test_gemma3_matches_transformers(make_checkpoint):
    """One batch that chunks its prefills (prompts longer than max_batch_tokens), shares prefixes (two families of
    two) and preempts (a cache of 24 pages): every prompt longer than the window, generated past it."""
    model_dir = make_checkpoint("gemma3", **GEMMA3)
    model = cluster.load(model_dir)
    config = model.config
    assert config.layer_types.count("full_attention") == 1 and model.model.tied
    assert model.model.layers[0].self_attn.scale != config.head_dim ** -0.5
    assert config.model_type == "gemma3_text" and (model_dir / "tokenizer.json").exists()  # make-model's checkpoint
    shared, mixed = shared_prefix_prompts(config.vocab_size), mixed_prompts(config.vocab_size)
    prompts = shared[0:2] + shared[8:10] + [mixed[11], mixed[15]]  # 101 to 300 tokens
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, continuous_batching_config=cluster.
                               ContinuousBatchingConfig(page_size=16, num_blocks=24, max_batch_tokens=128,
                                                        allow_block_sharing=True))
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)
    assert all(o.status == RequestStatus.FINISHED for o in out.values())
    stats = model.last_stats
    assert stats["prefix_hit_blocks"] > 0 and stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0


def test_gemma_norm_is_transformers_own():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    theirs = Gemma3RMSNorm(64, eps=1e-6)
    ours = GemmaRMSNorm(64, 1e-6, torch.float32)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    x = torch.randn(5, 3, 64)
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours.to(torch.bfloat16)(x.bfloat16()), theirs.to(torch.bfloat16)(x.bfloat16()))


@pytest.mark.parametrize("field,value,message", [
    ("hidden_activation", "relu", "activation 'relu' is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_gemma3_refuses_by_name(field, value, message):
    from transformers import Gemma3TextConfig

    from worker.models import check_supported

    config = Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, **{field: value})
    with pytest.raises(UnsupportedModel, match=message):
        check_supported(config)
