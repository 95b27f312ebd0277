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


@pytest.mark.slow  # 12 to 40 s on the shared 2 cores (the checkpoint made, six layers, a first batch)
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


def test_final_logit_softcapping_as_transformers(make_checkpoint, tmp_path):
    """A config's final_logit_softcapping caps the logits (tanh) before sampling and logprobs: the logprobs of the
    tokens and their alternatives equal transformers' (a cap of 1 changes them a great deal; the greedy tokens
    it cannot change). The fast tier's Gemma 3 end to end: a prompt past the window, four tokens."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "capped"
    shutil.copytree(make_checkpoint("gemma3", **GEMMA3), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"final_logit_softcapping": 1.0}))
    prompt = mixed_prompts(config["vocab_size"])[7]
    with cluster.load(model_dir).continuous_batching_context_manager() as m:
        out = m.get_result(m.add_request(prompt, max_new_tokens=4, top_logprobs=3, eos_token_id=-1), timeout=60)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.generated_tokens])).logits[0, len(prompt) - 1:-1].double()
    assert logits.abs().max() <= 1.0
    values, top = torch.topk(logits.log_softmax(-1), 3)
    for i, alts in enumerate(out.top_logprobs):
        assert [t for t, _ in alts] == top[i].tolist()
        assert [lp for _, lp in alts] == pytest.approx(values[i].tolist(), abs=2e-5)


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
