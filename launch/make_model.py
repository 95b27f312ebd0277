"""`lockstep make-model`: a randomly initialised checkpoint written by transformers' own classes from a seeded
generator (nothing is downloaded), with a tokenizer of its vocabulary size (launch/make_tokenizer.py)."""

from __future__ import annotations

import argparse
import os
from contextlib import suppress
from pathlib import Path

SIZES = {
    # about 3.4M parameters: fast enough for parity tests of four architectures at two TP sizes
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    # about 100M parameters: the benchmark model
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048),
}
SPREAD = {"initializer_range": 0.1}  # transformers' default is 0.02
# arch -> (transformers' config class, model class, the arch's own config fields at every size)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # 8 experts, top 2; layer 1 keeps a dense MLP
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                            sliding_window=None)),
    # DeepSeek-V3's router: 8 experts in 2 groups, the best group's top 2, a shared expert; layer 0 dense
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True,
        partial_rotary_factor=0.5)),
    # DeepSeek-V3: latent attention (q through a q_lora_rank of 64, a latent of 32 and a rope key of 16 cached a token;
    # heads of 32 + 16 for q/k, 32 for v; every head its own KV head, as transformers' MLA needs), yarn with mscale
    # (its softmax scale too), interleaved rotary; GLM-4.5's (DeepSeek's) MoE as above; initialised wider (SPREAD)
    # so that attention is not near uniform
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        SPREAD, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, head_dim=16, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8),
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True)),
    # Gemma 3: six layers, five sliding to one full (the window: transformers' default unless --set), tied
    # embeddings; softmax scale query_pre_attn_scalar ** -0.5 = 0.5, not head_dim ** -0.5: with q and k normed,
    # transformers' default (256) leaves a tiny random model's attention near uniform and its outputs mostly
    # the last token again
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_hidden_layers=6, tie_word_embeddings=True,
                                                            query_pre_attn_scalar=4)),
    # Gemma 2: Gemma 3's shape without q/k norms, sliding and full layers alternating (window 32: the test prompts are
    # longer), its scores capped at 5 (its default, 50, is out of a tiny model's reach: the cap would change
    # nothing), its logits at transformers' default 30; SPREAD, so that unnormed q and k make attention uneven; an
    # untied head (tied, the tiny model's greedy output is its input token again and again; Gemma 3 is tied)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(SPREAD, tie_word_embeddings=False, query_pre_attn_scalar=64,
                                                        attn_logit_softcapping=5.0, sliding_window=32)),
    # gpt-oss: 8 experts, top 4, of 128 rows; sliding and full layers alternating, the window 32 (test prompts are
    # longer); yarn stretching an original 64 positions 16 times (the prompts reach past 64); SPREAD, and sinks and
    # biases drawn (RANDOM_PARAMS: transformers starts the biases at zero and the sinks near it); the SwiGLU's clamp
    # at 1 (gpt-oss's 7 is out of a tiny model's reach: the clamp would change nothing)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        SPREAD, num_local_experts=8, num_experts_per_tok=4, intermediate_size=128, sliding_window=32, swiglu_limit=1.0,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=16.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=64))),
    # no native family: the generic path (worker/generic/) serves these through transformers' modelling code, at
    # TP=2 by their base_model_tp_plan (stablelm has none: TP=1 only). Each with what sets it apart: granite's
    # multipliers, olmo2's q/k norm over whole projections, phi3's fused qkv and gate_up, stablelm's partial rotary
    # and LayerNorm with biases, cohere's parallel block, interleaved rotary and tied, scaled logits; initialised
    # wider (SPREAD) so that greedy outputs do not settle into one repeated token
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        SPREAD, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(SPREAD, pad_token_id=0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(SPREAD, pad_token_id=0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(SPREAD, use_qkv_bias=True)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(SPREAD, tie_word_embeddings=True)),
}
# arch -> size -> the arch's own config fields at that size (over ARCHS'): qwen3_moe/small is the MoE benchmark
# model, 8 experts top-2 of 256 rows on 7 of 8 layers, about 100M parameters (experts a third of them); transformers'
# MLA needs num_key_value_heads = num_attention_heads
ARCH_SIZES = {"qwen3_moe": {"small": dict(moe_intermediate_size=256)},
              "deepseek_v3": {"small": dict(num_key_value_heads=12)}}  # MLA: a KV head a head
# MoE routers' weights are multiplied by this after transformers' initialisation: its default (std 0.02) gives
# near-uniform router probabilities, where every token's top-k is decided by rounding; scaled, tokens differ
ROUTER_SCALE = 10.0
# the spread of the random w of a (1 + w) norm (transformers' Gemma initialises w to zeros)
NORM_SPREAD = 0.5
# arch -> parameter name suffix -> (mean, std) it is drawn from after transformers' initialisation
RANDOM_PARAMS = {"gpt_oss": {"sinks": (1.0, 1.0), "bias": (0.0, 0.1)}}
LAYOUTS = ("published", "fused")  # experts one tensor each, as published / as transformers holds them in memory
BOS, EOS = 1, 2


def make_model(out_dir: str | os.PathLike, arch: str = "llama", size: str = "tiny", seed: int = 0,
               tokenizer: bool | None = None, layout: str = "published", **overrides) -> Path:
    """Write a checkpoint to out_dir and return its path. `tokenizer`: None writes one when the vocabulary can
    hold a byte-level BPE, True insists (ValueError if it cannot), False writes none. `layout`: how a MoE's experts
    are written: "published" (one tensor per expert, transformers' default) or "fused" (`save_pretrained(...,
    save_original_format=False)`: `experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
    `overrides`: config fields."""
    import torch
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {tuple(ARCHS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {tuple(SIZES)}")
    fields = dict(SIZES[size], bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False, rms_norm_eps=1e-6)
    fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    config_name, model_name, arch_fields = ARCHS[arch]
    fields.update(arch_fields)
    fields.update(ARCH_SIZES.get(arch, {}).get(size, {}))
    fields.update(overrides)
    config = getattr(transformers, config_name)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            drawn = [ms for suffix, ms in RANDOM_PARAMS.get(arch, {}).items() if name.endswith(suffix)]
            if drawn:
                param.normal_(*drawn[0])
            if name.endswith((".gate.weight", ".router.weight")):  # a MoE router (dense MLPs' are gate_proj)
                param.mul_(ROUTER_SCALE)
            elif name.endswith("norm.weight") and not param.any():  # a (1 + w) norm (Gemma) starts at w = 0:
                param.normal_(0.0, NORM_SPREAD)  # random, so that each norm's weights count
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros by default: make it count in the choice
                buffer.copy_(torch.rand(buffer.shape) * 0.2)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0,
                                               do_sample=False, max_new_tokens=32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, save_original_format=layout == "published")
    from launch.make_tokenizer import make_tokenizer, min_vocab_size

    if tokenizer is None:  # by default, whenever the vocabulary can hold a byte-level BPE
        tokenizer = config.vocab_size >= min_vocab_size()
        if not tokenizer:
            print(f"make-model: no tokenizer (vocab_size={config.vocab_size} is below {min_vocab_size()})")
    if tokenizer:
        make_tokenizer(out, config.vocab_size)
    return out


def parse_overrides(pairs: list[str]) -> dict:
    """--set key=value pairs; values parsed as int, float, bool or None where they look like one."""
    out = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        if not key or not _:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        value: object = raw
        for conv in (int, float):
            with suppress(ValueError):
                value = conv(raw)
                break
        out[key] = {"true": True, "false": False, "none": None}.get(raw.lower(), value)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=tuple(ARCHS), default="llama")
    p.add_argument("--layout", choices=LAYOUTS, default="published", help="how a MoE checkpoint writes its experts")
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set num_key_value_heads=1")
    p.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer next to the weights")


def run(args: argparse.Namespace) -> int:
    out = make_model(args.dir, args.arch, args.size, args.seed, tokenizer=False if args.no_tokenizer else None,
                     layout=args.layout, **parse_overrides(args.set))
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}) to {out}")
    return 0
