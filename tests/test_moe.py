"""Mixture-of-experts families in this process (TP=1): token-identical to transformers' generate (greedy, float32)
under chunked prefill, prefix sharing and preemption, on checkpoints whose routing varies; both checkpoint
layouts load to the same tokens; the experts' two placements (tensor- and expert-parallel) sum to the same output
as one rank holding everything. tests/test_moe_parity.py runs TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cluster
from tests.conftest import hf_greedy
from tests.test_parity import check_scenario
from tests.workloads import NEW_TOKENS, SCENARIOS, prompts_for
from worker.experts import ExpertPlacement, Experts
from worker.layers import Shard

# arch -> config overrides of its test checkpoint: Mixtral's window is shorter than most prompts
MOE_CHECKPOINTS = {"qwen3_moe": {}, "mixtral": {"sliding_window": 48}, "glm4_moe": {}, "deepseek_v3": {}}
MOE_ARCHS = list(MOE_CHECKPOINTS)
# and gpt-oss (tests/test_gpt_oss.py), which routes as they do but has no per-expert tensor names (no layouts test,
# no update sequence)
ROUTED_CHECKPOINTS = MOE_CHECKPOINTS | {"gpt_oss": {}}
TP1_SCENARIOS = ("chunked", "sharing", "preempt")


def routed_histograms(model_dir: Path, sequences: list[list[int]]) -> list[list[int]]:
    """Per MoE layer of transformers' own model, the tokens of `sequences` routed to each expert (hooks on its
    routers: their third output is each token's chosen experts)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("router")]
    counts = [torch.zeros(num_experts(model.config), dtype=torch.int64) for _ in routers]

    def counter(seen: torch.Tensor):
        def hook(_module, _inputs, out) -> None:  # None: the router's output stays as it is
            seen.add_(torch.bincount(out[2].flatten(), minlength=seen.numel()))
        return hook

    hooks = [r.register_forward_hook(counter(seen)) for r, seen in zip(routers, counts)]
    with torch.no_grad():
        for tokens in sequences:
            model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return [c.tolist() for c in counts]


def assert_routing_varies(histograms: list[list[int]], layers: int | None = None) -> None:
    """More than half of the experts of every MoE layer got tokens (a degenerate router, every token to the same
    few experts, would make a MoE test prove little). `histograms`: per MoE layer, the tokens routed to each
    expert (`routed_histograms`, or the values of `stats()["experts_routed"]`); `layers`: how many MoE layers."""
    used = [[e for e, n in enumerate(layer) if n] for layer in histograms]
    assert used and (layers is None or len(used) == layers), f"MoE layers counted: {len(used)}, not {layers}"
    assert all(len(u) > len(layer) // 2 for u, layer in zip(used, histograms)), used


def num_experts(config) -> int:
    return next(getattr(config, f) for f in ("num_experts", "num_local_experts", "n_routed_experts")
                if getattr(config, f, None))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_varies(arch, make_checkpoint):
    """The test checkpoints' routers send different tokens to different experts: more than half of every MoE
    layer's experts get tokens from the parity prompts (a degenerate router would make parity prove little)."""
    model_dir = make_checkpoint(arch, **MOE_CHECKPOINTS[arch])
    config = cluster.load(model_dir).config
    assert_routing_varies(routed_histograms(model_dir, prompts_for("mixed", config.vocab_size)[:8]))


# the fast tier runs one scenario a family (prefix sharing: the shortest); the whole matrix is slow, as the dense one
# is; and preemption with a host pool (`cpu_offload_space`: the preempted pages go to the host and come back) on two
# families, GLM-4.5 and DeepSeek-V3 (whose pages, and so the host pool's, hold its latent only), four prompts of 128
# to 255 tokens, which with their tokens overflow the scenario's 32 pages
TP1_RUNS = [pytest.param(arch, scenario, slice(None), marks=() if scenario == "sharing" else pytest.mark.slow)
            for arch in MOE_ARCHS for scenario in TP1_SCENARIOS] + [
    (arch, "offload", slice(8, 12)) for arch in ("glm4_moe", "deepseek_v3")]


@pytest.mark.parametrize("arch,scenario,which", TP1_RUNS)
def test_tp1_matches_transformers(arch, scenario, which, make_checkpoint):
    model_dir = make_checkpoint(arch, **MOE_CHECKPOINTS[arch])
    model = cluster.load(model_dir)
    fields, kind = SCENARIOS[scenario]
    prompts = prompts_for(kind, model.config.vocab_size)[which]
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS,
                               continuous_batching_config=cluster.ContinuousBatchingConfig(**fields))
    check_scenario(scenario, [o.generated_tokens for o in out.values()], [o.status for o in out.values()],
                   model.last_stats, hf_greedy(model_dir, prompts), "serial")


@pytest.mark.parametrize("arch", list(ROUTED_CHECKPOINTS))
def test_stats_count_the_tokens_routed_to_each_expert(arch, make_checkpoint):
    """`stats()["experts_routed"]`: per MoE layer, the real tokens routed to each expert since the model was loaded
    equal what transformers' routers choose for every token the model ran (each prompt and its generated tokens
    but the last), in chunked prefill and decode steps padded to their buckets (three decode rows in a bucket of
    four: padding rows count nothing); a second batch adds to the counts."""
    model_dir = make_checkpoint(arch, **ROUTED_CHECKPOINTS[arch])
    model = cluster.load(model_dir)
    prompts = prompts_for("mixed", model.config.vocab_size)[:3]
    config = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, use_async_batching=False)
    for batch in (1, 2):
        out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, continuous_batching_config=config)
        routed = model.last_stats["experts_routed"]
        ran = [p + o.generated_tokens[:-1] for p, o in zip(prompts, out.values())]
        want = routed_histograms(model_dir, ran)
        assert list(routed.values()) == [[batch * n for n in layer] for layer in want]
        top_k = model.config.num_experts_per_tok
        assert all(sum(layer) == batch * top_k * sum(map(len, ran)) for layer in routed.values())
    assert all(int(layer) < model.config.num_hidden_layers for layer in routed)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_published_and_fused_layouts_load_to_the_same_tokens(arch, make_checkpoint):
    """One tensor per expert (as published) and transformers' fused experts (`save_original_format=False`) hold the
    same weights (same seed) and load to the same weights and tokens; the files' names differ."""
    from safetensors import safe_open

    overrides = MOE_CHECKPOINTS[arch]
    published, fused = make_checkpoint(arch, **overrides), make_checkpoint(arch, layout="fused", **overrides)
    names = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (published, fused)]
    assert any(".experts.0." in n for n in names[0]) and not any(".experts.0." in n for n in names[1])
    assert any(n.endswith("experts.gate_up_proj") for n in names[1])
    models = [cluster.load(d) for d in (published, fused)]
    for (name, a), (_, b) in zip(models[0].model.named_parameters(), models[1].model.named_parameters()):
        assert torch.equal(a, b), name
    prompts = prompts_for("mixed", models[0].config.vocab_size)[::3]
    config = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=64)
    tokens = [[o.generated_tokens for o in m.generate_batch(prompts, max_new_tokens=NEW_TOKENS,
                                                            continuous_batching_config=config).values()]
              for m in models]
    assert tokens[0] == tokens[1] == hf_greedy(published, prompts)


def full_experts(e: int, inter: int, hidden: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random experts in both layouts: per expert (part -> tensor) and fused (gate_up, down)."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(e, inter, hidden, generator=g), torch.randn(e, inter, hidden, generator=g)
    down = torch.randn(e, hidden, inter, generator=g)
    per = {f"{w}.{i}": t[i] for i in range(e) for w, t in (("gate", gate), ("up", up), ("down", down))}
    return per, {"gate_up": torch.cat([gate, up], dim=1), "down": down}


def loaded(placement: ExpertPlacement, hidden: int, tensors: dict[str, torch.Tensor]) -> Experts:
    experts = Experts(hidden, placement, torch.float32)
    for part, src in tensors.items():
        dst, value = experts.shard_of(part, "weight", src)
        dst.copy_(value)
    return experts


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_both_placements_sum_to_the_one_rank_output(layout):
    """Tensor-parallel experts (a slice of every expert a rank) and expert-parallel (whole experts, E / tp a rank):
    the ranks' parts sum to what one rank holding everything computes, in both checkpoint layouts; an expert
    that gets no token and tokens routed to other ranks' experts are handled; the masked path (used under graph
    capture and compile) agrees with the grouped one."""
    e, inter, hidden, tp, t, k = 8, 16, 12, 2, 9, 2
    per, fused = full_experts(e, inter, hidden)
    tensors = per if layout == "per_expert" else fused
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(1))
    chosen = torch.tensor([[0, 1], [1, 0], [7, 6], [6, 2], [2, 3], [3, 4], [4, 7], [0, 7], [1, 6]])  # 5: none
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(2))
    one = loaded(ExpertPlacement.tensor_parallel(e, inter, Shard()), hidden, tensors)
    want = one(x, chosen, weights)
    torch.testing.assert_close(one._masked(x, chosen, weights), want)
    for make in (ExpertPlacement.tensor_parallel, ExpertPlacement.expert_parallel):
        parts = [loaded(make(e, inter, Shard(rank=r, size=tp)), hidden, tensors)(x, chosen, weights)
                 for r in range(tp)]
        torch.testing.assert_close(sum(parts), want)
    ep0 = loaded(ExpertPlacement.expert_parallel(e, inter, Shard(rank=0, size=tp)), hidden, tensors)
    assert ep0.gate_up.shape == (e // tp, 2 * inter, hidden) and ep0.view("gate.7", "weight").numel() == 0


def test_the_preset_chooses_the_placement():
    from cluster.config import expert_parallel

    assert not expert_parallel(None) and not expert_parallel({"experts": "tensor_parallel"})
    assert expert_parallel({"experts": "expert_parallel"})
    with pytest.raises(ValueError, match="expected one of"):
        expert_parallel({"experts": "ep"})


def test_run_and_generate_load_with_the_presets_placement(make_checkpoint, tmp_path):
    """`lockstep run` and `lockstep generate` (launch/load.py `load_with_preset`) place the experts as the preset's
    [model] table says, and take its [continuous_batching] table, as `lockstep serve` does."""
    from launch.load import load_with_preset

    preset = tmp_path / "ep.toml"
    preset.write_text('[model]\nexperts = "expert_parallel"\n\n[continuous_batching]\npage_size = 32\n')
    model, cb = load_with_preset(make_checkpoint("qwen3_moe"), preset)
    assert model.model.expert_parallel and cb.page_size == 32
    model, cb = load_with_preset(make_checkpoint("qwen3_moe"), None)
    assert not model.model.expert_parallel and cb is None
