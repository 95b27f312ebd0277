"""The generic path (worker/generic/, docs/models.md): decoders without a native family run through transformers'
own modelling code on Lockstep's layers and pages, token-identical to transformers' generate (TP=1 here, in this
process; TP=2 in tests/test_parity.py's one launch), and what it cannot serve is refused at load naming the layer."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

import cluster
from cluster.config import model_impl
from cluster.errors import ModelRefused
from tests.conftest import hf_greedy
from tests.workloads import NEW_TOKENS, mixed_prompts, shared_prefix_prompts

# case -> (arch, config overrides, model_impl): five architectures without a native file, each with what sets it
# apart (launch/make_model.py), phi3 with a window shorter than most prompts; and Llama forced through the path
GENERIC = {"granite": ("granite", {}, "auto"), "olmo2": ("olmo2", {}, "auto"),
           "phi3-window": ("phi3", {"sliding_window": 48}, "auto"), "stablelm": ("stablelm", {}, "auto"),
           "cohere": ("cohere", {}, "auto"), "llama-forced": ("llama", {}, "generic")}
# one call: prompts of 1 to 300 tokens across page boundaries, four sharing a 100-token prefix (block sharing),
# prefill chunked at 64 tokens, and a cache of 24 pages that cannot hold them all at once (preemption)
CONFIG = dict(page_size=16, max_batch_tokens=64, allow_block_sharing=True, num_blocks=24)


def prompts(vocab: int) -> list[list[int]]:
    mixed = mixed_prompts(vocab)
    return [mixed[i] for i in (0, 3, 6, 11, 15)] + shared_prefix_prompts(vocab)[:4]


@pytest.mark.parametrize("case", GENERIC)
def test_generic_path_matches_transformers(case, make_checkpoint, caplog):
    arch, overrides, impl = GENERIC[case]
    model_dir = make_checkpoint(arch, **overrides)
    with caplog.at_level(logging.INFO, logger="lockstep"):
        model = cluster.load(model_dir, model_impl=impl)
    assert "generic path: transformers'" in caplog.text  # the startup log names the path
    batch = prompts(model.config.vocab_size)
    out = model.generate_batch(batch, continuous_batching_config=cluster.ContinuousBatchingConfig(**CONFIG),
                               max_new_tokens=NEW_TOKENS)
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, batch)
    stats = model.last_stats
    assert stats["model_impl"] == "generic"
    assert stats["preemptions"] > 0 and stats["prefix_hit_blocks"] > 0


def test_checkpoint_names_and_updates_are_transformers_own(make_checkpoint):
    """state_dict() holds exactly the checkpoint's tensors under its names; a hot update from another checkpoint
    lands in what the forward reads (transformers' tokens on the new weights)."""
    from safetensors.torch import load_file

    model = cluster.load(make_checkpoint("granite"))
    saved = load_file(make_checkpoint("granite") / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(saved) and all(torch.equal(state[n], saved[n]) for n in saved)
    new_dir = make_checkpoint("granite", seed=1)
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    m.start()
    try:
        assert m.update_weights(new_dir)["ok"]
        batch = prompts(model.config.vocab_size)[:2]
        ids = [m.add_request(p, max_new_tokens=8) for p in batch]
        assert [m.get_result(i, timeout=60).generated_tokens for i in ids] == hf_greedy(new_dir, batch, 8)
    finally:
        m.stop(timeout=10)
        m.destroy()


def test_native_families_stay_native(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    assert model.model.impl == "native" and "native family Llama" in model.model.describe()
    with pytest.raises(ValueError, match="'granite' has no native family"):
        cluster.load(make_checkpoint("granite"), model_impl="native")
    with pytest.raises(ValueError, match="expected one of"):
        model_impl({"impl": "transformers"})
    assert model_impl({"impl": "generic"}) == "generic" and model_impl(None) == "auto"


# ---------------------------------------------------------------- refusals, at load, before any weight is read
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def refused(config, tp: int = 1) -> ModelRefused:
    """The refusal of `config` on rank 0 of `tp` ranks (TP > 1: the checks before any collective)."""
    from worker.generic.model import GenericLM
    from worker.layers import Shard

    with pytest.raises(ModelRefused) as e:
        GenericLM(config, Shard(0, tp), torch.float32, torch.device("cpu"))
    assert e.value.code == "unsupported"
    return e.value


REFUSED = {  # name -> (config, the layer named, words of the reason)
    "t5": (lambda: transformers.T5Config(), None, "an encoder-decoder model"),
    "gpt2-cross": (lambda: transformers.GPT2Config(add_cross_attention=True, n_layer=2, n_embd=64, n_head=4,
                                                   vocab_size=128), None, "cross-attention"),
    "qwen3_next": (lambda: transformers.Qwen3NextConfig(**SMALL), "layer 0", "a 'linear_attention' layer"),
    "falcon_h1": (lambda: transformers.FalconH1Config(**SMALL), "layer 0", "a 'hybrid' layer"),
    "bloom": (lambda: transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4), "layer 0",
              "its attention never reached the attention function"),
    "gemma2": (lambda: transformers.Gemma2Config(**SMALL, head_dim=16), "layer 0", "attention logit softcapping"),
    "gpt_oss": (lambda: transformers.GptOssConfig(**SMALL), "layer 0", "attention sinks"),
    "olmoe": (lambda: transformers.OlmoeConfig(**SMALL), None, "converts its checkpoints' tensors"),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(**SMALL), None, "converts its checkpoints' tensors"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_the_generic_path_cannot_serve_is_refused(name):
    config, layer, reason = REFUSED[name]
    e = refused(config())
    assert e.layer == layer and reason in e.reason, e


def test_tensor_parallel_refusals_name_the_layer():
    plan = dict(transformers.LlamaConfig.base_model_tp_plan, **{"layers.*.mlp.gate_proj": "packed_colwise"})
    e = refused(transformers.LlamaConfig(**SMALL, base_model_tp_plan=plan), tp=2)
    assert e.layer == "model.layers.0.mlp.gate_proj" and "'packed_colwise' is not one" in e.reason
    e = refused(transformers.LlamaConfig(**dict(SMALL, num_key_value_heads=1)), tp=2)
    assert e.layer == "model.layers.0.self_attn.k_proj" and "1 heads of 16 do not split over tp=2" in e.reason
    e = refused(transformers.StableLmConfig(**SMALL), tp=2)
    assert "declares no base_model_tp_plan" in e.reason
