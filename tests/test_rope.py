"""Every RoPE variant against transformers' own rotary embedding for the same config, bit for bit: cos and sin at
the positions of one greedy `generate` call (the prompt in one forward, then one decode forward a token, a fresh
rotary module each call, as transformers' dynamic types update theirs per forward), and q/k rotated as the family's
own apply_rotary_pos_emb rotates them (partial rotary)."""

from __future__ import annotations

import pytest
import torch

from cluster.errors import UnsupportedModel
from worker.rope import LayerRotary, RotaryTable, exact_prompt_limit, inverse_frequencies

HEAD_DIM = 64
SMALL = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=HEAD_DIM)


def llama(rope: dict, max_positions: int = 256, **fields):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**SMALL, max_position_embeddings=max_positions, rope_parameters=rope, **fields)
    return config, LlamaRotaryEmbedding


def generate_rotary(config, rotary_class, prompt: int, total: int, **forward) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [total, D] of positions 0..total-1 as a greedy generate call computes them: the prompt's
    positions in one forward, then each later position in a forward of its own."""
    module = rotary_class(config)
    calls = [torch.arange(prompt)] + [torch.tensor([p]) for p in range(prompt, total)]
    outs = [module(torch.zeros(1, dtype=torch.float32), pos[None], **forward) for pos in calls]
    return torch.cat([c[0] for c, _ in outs]), torch.cat([s[0] for _, s in outs])


def ours(config, total: int, layer_type: str | None = None, head_dim: int = HEAD_DIM):
    step = RotaryTable(config, head_dim, config.max_position_embeddings, torch.device("cpu"), layer_type).at(
        torch.arange(total), torch.float32)
    cos, signed = step.cos[:, 0], step.signed_sin[:, 0]
    half = signed.shape[-1] // 2
    return cos, torch.cat([-signed[:, :half], signed[:, half:]], dim=-1)


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w, name in zip(got, want, ("cos", "sin")):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert torch.equal(g, w), f"{name}: max difference {(g - w).abs().max().item():.3g}"


LLAMA_ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=64,
                   low_freq_factor=1.0, high_freq_factor=4.0),
    # yarn as Qwen and Llama checkpoints set it (truncate default, attention factor from the factor alone)
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    # gpt-oss: an explicit attention factor, beta_fast / beta_slow, no truncation
    "yarn_untruncated": dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=32.0, beta_slow=1.0, truncate=False, attention_factor=1.25),
    # DeepSeek-V3: attention factor from mscale / mscale_all_dim
    "yarn_mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=64,
                        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707),
    "yarn_partial": dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, original_max_position_embeddings=128,
                         partial_rotary_factor=0.5),
    # dynamic NTK: within max_position_embeddings (all Lockstep serves) transformers keeps its starting frequencies
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=3.0),
}


@pytest.mark.parametrize("name", list(LLAMA_ROPES))
def test_llama_rotary_types_match_transformers(name):
    config, rotary = llama(dict(LLAMA_ROPES[name]))
    assert_same(ours(config, 256), generate_rotary(config, rotary, 40, 256))


def test_dynamic_ntk_changes_only_past_the_context_lockstep_serves():
    """transformers' dynamic NTK rescales once a forward reaches past max_position_embeddings; Lockstep serves at
    most that many positions (the request checks refuse more), where its values are the table's; one position
    further transformers' differ."""
    config, rotary = llama(dict(LLAMA_ROPES["dynamic"]), max_positions=64)
    assert_same(ours(config, 64), generate_rotary(config, rotary, 10, 64))
    past = generate_rotary(config, rotary, 10, 66)[0][64:, :HEAD_DIM // 2]
    start = (torch.tensor([64.0, 65.0])[:, None] * inverse_frequencies(config, HEAD_DIM).inv_freq).cos()
    assert not torch.equal(past, start)


def phi3_longrope(original: int = 32, max_positions: int = 128):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    short, long = (1 + torch.rand(HEAD_DIM // 2, generator=g)).tolist(), (1 + 4 * torch.rand(HEAD_DIM // 2,
                                                                                             generator=g)).tolist()
    config = Phi3Config(**{k: v for k, v in SMALL.items() if k != "head_dim"}, max_position_embeddings=max_positions,
                        original_max_position_embeddings=original, pad_token_id=0,
                        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=short,
                                             long_factor=long))
    return config, Phi3RotaryEmbedding


def test_longrope_matches_transformers_for_prompts_within_the_original_length():
    """Short factors below original_max_position_embeddings, long ones from it (a decode token's forward reaches
    past it exactly then), with longrope's attention factor; a prompt longer than the original length has every
    token rotated with the long factors by transformers, so Lockstep refuses it (exact_prompt_limit)."""
    config, rotary = phi3_longrope()
    for prompt in (1, 20, 32):
        assert_same(ours(config, 128), generate_rotary(config, rotary, prompt, 128))
    assert exact_prompt_limit(config) == 32
    long_prompt = generate_rotary(config, rotary, 33, 40)
    assert not torch.equal(ours(config, 40)[0][:32], long_prompt[0][:32])
    assert exact_prompt_limit(llama(dict(LLAMA_ROPES["yarn"]))[0]) is None


def test_partial_rotary_matches_transformers():
    """partial_rotary_factor: the first columns of each head rotate (GLM-4 MoE's and Phi's convention), the rest
    pass through; q rotated by Lockstep equals q rotated by the family's own apply_rotary_pos_emb."""
    from transformers import Glm4MoeConfig, PhiConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

    glm = Glm4MoeConfig(**SMALL, max_position_embeddings=256, partial_rotary_factor=0.5,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    cos, sin = generate_rotary(glm, Glm4MoeRotaryEmbedding, 30, 256)
    assert cos.shape[-1] == HEAD_DIM // 2
    assert_same(ours(glm, 256), (cos, sin))
    phi = PhiConfig(**{k: v for k, v in SMALL.items() if k != "head_dim"}, max_position_embeddings=256,
                    partial_rotary_factor=0.4)
    assert_same(ours(phi, 256), generate_rotary(phi, PhiRotaryEmbedding, 30, 256))

    q = torch.randn(1, 3, 256, HEAD_DIM, generator=torch.Generator().manual_seed(1))  # [B, H, T, D]
    want, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None])
    table = RotaryTable(glm, HEAD_DIM, 256, torch.device("cpu"))
    got = table.at(torch.arange(256), torch.float32).apply(q[0].transpose(0, 1))  # [T, H, D]
    assert torch.equal(got, want[0].transpose(0, 1))


def test_per_layer_type_parameters_match_gemma3():
    """Gemma 3: each layer type its own rope (here sliding layers default with base 10k, full layers linear x8
    with base 1M, as the 4B+ checkpoints); every layer gets its type's table, each table gathered once."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 7}, max_position_embeddings=256, rope_parameters={
        "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)})
    for layer_type in ("sliding_attention", "full_attention"):
        assert_same(ours(config, 256, layer_type), generate_rotary(config, Gemma3RotaryEmbedding, 50, 256,
                                                                   layer_type=layer_type))
    layers = LayerRotary(config, HEAD_DIM, 256, torch.device("cpu"))
    assert layers.names == ["sliding_attention", "full_attention"]
    step = layers.at(torch.arange(5), torch.float32)
    assert [s is step[5] for s in step] == [False] * 5 + [True, False]
    assert [s is step[0] for s in step] == [True] * 5 + [False, True]


@pytest.mark.parametrize("kind", ["proportional", "mrope", "su"])
def test_other_rope_types_are_refused_by_name(kind):
    config, _ = llama(dict(rope_type="default", rope_theta=10000.0))
    config.rope_parameters = dict(rope_type=kind, rope_theta=10000.0, factor=2.0)
    with pytest.raises(UnsupportedModel, match=f"rope_type '{kind}' is not supported"):
        inverse_frequencies(config, HEAD_DIM)


def test_longer_prompts_than_longrope_serves_exactly_are_refused():
    from cluster.errors import Code, RequestRejected
    from driver.api.validation import check_prompt

    config, _ = phi3_longrope()
    assert check_prompt([5] * 32, "r", 64, 128, exact_prompt_limit(config)) == [5] * 32
    with pytest.raises(RequestRejected, match="up to 32 tokens") as e:
        check_prompt([5] * 33, "r", 64, 128, exact_prompt_limit(config))
    assert e.value.code == Code.PROMPT_TOO_LONG


@pytest.mark.slow  # 11 to 24 s on the shared 2 cores (a checkpoint made)
def test_llama_with_longrope_matches_transformers(tmp_path):
    """A served model whose decode crosses longrope's original length (short factors below it, long from it) and
    whose attention factor is not 1: token-identical to transformers' generate."""
    import cluster
    from launch.make_model import make_model
    from tests.conftest import hf_greedy
    from tests.workloads import NEW_TOKENS, mixed_prompts

    g = torch.Generator().manual_seed(0)
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=40,
                short_factor=(1 + torch.rand(32, generator=g)).tolist(),
                long_factor=(1 + 8 * torch.rand(32, generator=g)).tolist())
    model_dir = make_model(tmp_path / "llama-longrope", "llama", tokenizer=False, rope_parameters=rope)
    prompts = [p for p in mixed_prompts(2048) if 40 - NEW_TOKENS < len(p) <= 40]  # 17 and 31 tokens
    model = cluster.load(model_dir)
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, continuous_batching_config=cluster.
                               ContinuousBatchingConfig(page_size=16, max_batch_tokens=64))
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)
