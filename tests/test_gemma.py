"""Gemma 3 (gemma3_text) and Gemma 2 (gemma2) in this process (TP=1): token-identical to transformers' generate
(greedy, float32) with a sliding window shorter than the prompts, under chunked prefill, prefix sharing and
preemption; Gemma 2's attention softcap changes the tokens (so parity proves it is applied); the (1 + w) norm as
transformers'; what they refuse. tests/test_parity.py runs both at TP=2 (overlapped; Gemma 3 every scenario)."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster.errors import UnsupportedModel
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy
from tests.workloads import NEW_TOKENS, WINDOW_BATCH, mixed_prompts, window_prompts
from worker.layers import GemmaRMSNorm

GEMMA3 = {"sliding_window": 48}  # shorter than most of the parity prompts: the window is exercised
GEMMA2: dict = {}  # make-model's gemma2: window 32, scores capped at 5 (launch/make_model.py)


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
    check_batch(model, model_dir, window_prompts(config.vocab_size))


def check_batch(model, model_dir, prompts: list[list[int]]) -> None:
    """WINDOW_BATCH's batch of `prompts` equals transformers' tokens; it shared prefixes and preempted."""
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS,
                               continuous_batching_config=cluster.ContinuousBatchingConfig(**WINDOW_BATCH))
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)
    assert all(o.status == RequestStatus.FINISHED for o in out.values())
    stats = model.last_stats
    assert stats["prefix_hit_blocks"] > 0 and stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0


@pytest.mark.slow  # a checkpoint made, a first batch
def test_gemma2_matches_transformers(make_checkpoint):
    """As Gemma 3's: no q/k norms, sliding every other layer (the window shorter than every prompt), the scores
    capped; the tokens vary (a degenerate model would prove little)."""
    model_dir = make_checkpoint("gemma2", **GEMMA2)
    model = cluster.load(model_dir)
    config = model.config
    assert config.model_type == "gemma2" and type(model.model).__name__ == "Gemma2"
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert not hasattr(model.model.layers[0].self_attn, "q_norm")
    assert model.model.layers[0].self_attn.softcap == config.attn_logit_softcapping == 5.0
    prompts = window_prompts(config.vocab_size)
    assert min(map(len, prompts)) > config.sliding_window
    check_batch(model, model_dir, prompts)
    assert all(len(set(w)) > 4 for w in hf_greedy(model_dir, prompts))


def test_gemma2_score_softcap_changes_the_tokens(make_checkpoint):
    """Without the attention softcap every prompt's first tokens differ from transformers' (which caps): the
    parity above proves the cap is applied. Two prompts past the window, eight tokens."""
    model_dir = make_checkpoint("gemma2", **GEMMA2)
    model = cluster.load(model_dir)
    prompts = window_prompts(model.config.vocab_size)[4:]
    want = hf_greedy(model_dir, prompts, 8)
    config = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=128)
    assert [o.generated_tokens for o in model.generate_batch(prompts, max_new_tokens=8,
                                                             continuous_batching_config=config).values()] == want
    for layer in model.model.layers:
        layer.self_attn.softcap = None
    out = model.generate_batch(prompts, max_new_tokens=8, continuous_batching_config=config)
    assert all(o.generated_tokens != w for o, w in zip(out.values(), want))


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
