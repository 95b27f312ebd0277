"""gpt-oss (gpt_oss) in this process (TP=1): token-identical to transformers' generate (greedy, float32) with a
sliding window shorter than the prompts, under chunked prefill, prefix sharing and preemption, on a checkpoint
whose sinks, biases and clamp all change the tokens and whose routing varies; its experts and router against
transformers' own modules, in both placements; what it refuses. tests/test_moe_parity.py runs it at TP=2 (tensor-
and expert-parallel experts); tests/test_triton_attention.py checks the sinks in the Triton kernel."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster.errors import UnsupportedModel
from tests.conftest import hf_greedy, vocab_of
from tests.test_moe import ROUTED_CHECKPOINTS, assert_routing_varies, routed_histograms
from tests.test_gemma import check_batch
from tests.workloads import window_prompts
from worker.clamped_experts import PARTS, ClampedExperts
from worker.experts import ExpertPlacement
from worker.layers import Shard
from worker.routers import BiasedTopKSoftmax

GPT_OSS = ROUTED_CHECKPOINTS["gpt_oss"]  # make-model's gpt_oss: window 32, 8 experts top 4 (launch/make_model.py)


@pytest.mark.slow  # a checkpoint made, four MoE layers, a batch of six long prompts
def test_gpt_oss_matches_transformers(make_checkpoint):
    """One batch that chunks its prefills (prompts longer than max_batch_tokens), shares prefixes and preempts (a
    cache of 24 pages), every prompt longer than the window; transformers' routers send the prompts' tokens to
    more than half of every layer's experts."""
    model_dir = make_checkpoint("gpt_oss", **GPT_OSS)
    model = cluster.load(model_dir)
    config = model.config
    assert config.model_type == "gpt_oss" and type(model.model).__name__ == "GptOss"
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 and config.sliding_window == 32
    assert config.rope_parameters["rope_type"] == "yarn"
    prompts = window_prompts(config.vocab_size)
    assert min(map(len, prompts)) > config.sliding_window
    assert_routing_varies(routed_histograms(model_dir, prompts), layers=config.num_hidden_layers)
    check_batch(model, model_dir, prompts)
    assert all(len(set(w)) > 4 for w in hf_greedy(model_dir, prompts)), "the reference repeats itself"


@pytest.mark.slow
def test_sinks_biases_and_clamp_change_the_tokens(make_checkpoint):
    """The parity above proves each of gpt-oss's own terms only if dropping it changes the tokens: with the sinks
    at -1e4 (no sink), the experts' biases at zero, or the clamp out of reach, every prompt's tokens differ."""
    model_dir = make_checkpoint("gpt_oss", **GPT_OSS)
    prompts = window_prompts(vocab_of(model_dir))[::2]
    changes = {"sinks": lambda layer: layer.self_attn.sinks.weight.fill_(-1e4),
               "biases": lambda layer: (layer.mlp.experts.gate_up_bias.zero_(), layer.mlp.experts.down_bias.zero_()),
               "clamp": lambda layer: setattr(layer.mlp.experts, "limit", 1e9)}
    config = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=128)
    want = hf_greedy(model_dir, prompts, 8)
    for name, change in changes.items():
        model = cluster.load(model_dir)
        with torch.no_grad():
            for layer in model.model.layers:
                change(layer)
        out = model.generate_batch(prompts, max_new_tokens=8, continuous_batching_config=config)
        assert all(o.generated_tokens != w for o, w in zip(out.values(), want)), name


def transformers_moe(seed: int = 0):
    """transformers' GptOssTopKRouter and GptOssExperts (8 experts of 12 rows over 16 features, top 3), every
    tensor random (biases too), and a clamp the outputs reach."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=8, num_experts_per_tok=3,
                          swiglu_limit=0.5, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(seed)
    router, experts = GptOssTopKRouter(config), GptOssExperts(config)
    with torch.no_grad():
        for p in (*router.parameters(), *experts.parameters()):
            p.normal_()
    return config, router, experts


def test_router_as_transformers():
    config, theirs, _ = transformers_moe()
    ours = BiasedTopKSoftmax(config.num_local_experts, config.hidden_size, config.num_experts_per_tok, torch.float32)
    for kind in ("weight", "bias"):
        dst, value = ours.shard_of("", kind, getattr(theirs, kind).detach())
        dst.copy_(value)
    x = torch.randn(20, config.hidden_size)
    _, scores, indices = theirs(x)
    experts, weights = ours(x)
    assert torch.equal(experts, indices) and torch.equal(weights, scores)


def loaded(placement: ExpertPlacement, config, theirs) -> ClampedExperts:
    ours = ClampedExperts(config.hidden_size, placement, config.swiglu_limit, config.swiglu_alpha, torch.float32)
    for part in PARTS:
        dst, value = ours.shard_of(part, "weight", getattr(theirs, part).detach())
        dst.copy_(value)
    return ours


def test_experts_as_transformers_in_both_placements():
    """One rank holding every expert computes transformers' GptOssExperts (interleaved gate/up, biases, the clamped
    SwiGLU, which clamps here); the masked path (graph capture, compile) agrees; tensor-parallel ranks (a run of
    gate/up column pairs each, the down bias on the first rank only) and expert-parallel ranks (whole experts) sum
    to it; an expert no token chose is handled."""
    config, _, theirs = transformers_moe()
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    chosen = torch.tensor([[0, 1, 2], [1, 0, 7], [7, 6, 3], [6, 2, 4], [2, 3, 0], [3, 4, 1], [4, 7, 6], [0, 7, 2],
                           [1, 6, 3]])  # expert 5: no token
    weights = torch.rand(9, 3, generator=torch.Generator().manual_seed(2)).softmax(-1)
    with torch.no_grad():
        want = theirs(x, chosen, weights)
        gate = (x @ theirs.gate_up_proj + theirs.gate_up_proj_bias[:, None])[..., ::2]
    assert (gate > config.swiglu_limit).any(), "the clamp changes nothing here"
    e, inter = config.num_local_experts, config.intermediate_size
    one = loaded(ExpertPlacement.tensor_parallel(e, inter, Shard()), config, theirs)
    torch.testing.assert_close(one(x, chosen, weights), want)
    torch.testing.assert_close(one._masked(x, chosen, weights), want)
    for make in (ExpertPlacement.tensor_parallel, ExpertPlacement.expert_parallel):
        ranks = [loaded(make(e, inter, Shard(rank=r, size=2)), config, theirs) for r in range(2)]
        torch.testing.assert_close(sum(r(x, chosen, weights) for r in ranks), want)
    tp1 = loaded(ExpertPlacement.tensor_parallel(e, inter, Shard(rank=1, size=2)), config, theirs)
    assert tp1.gate_up.shape == (e, config.hidden_size, inter) and not tp1.adds_down_bias
    assert torch.equal(tp1.view("gate_up_proj", "weight"), theirs.gate_up_proj.detach()[:, :, inter:])


def test_quantized_checkpoints_are_refused_by_name():
    from transformers import GptOssConfig

    from worker.models import check_supported

    config = GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4)
    check_supported(config, "native")
    config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(UnsupportedModel, match="quantization_config: mxfp4"):
        check_supported(config, "native")
