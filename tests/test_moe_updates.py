"""Weight updates on MoE models in this process (tests/moe_updates.py's sequence; its TP=2 run is in
tests/test_moe_parity.py): expert tensors named as the checkpoint names them (published per expert, or transformers'
fused names) land on the right shards of TP=2 ranks, with tensor-parallel experts (every rank its slice of every
expert) and with expert parallelism (an expert's tensors on the rank holding it and nowhere else), from a checkpoint,
by handle and by push (the ranks and the trainer as threads); bad names and shapes are refused on every rank; and
the whole sequence through a TP=1 manager serves exactly transformers' tokens on the updated weights."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from cluster.errors import Code, WeightRefused
from launch.weight_handles import SharedBuckets
from tests.conftest import hf_greedy
from tests.moe_updates import NEW, PROMPTS, expert_of, run_updates
from tests.test_moe import MOE_ARCHS, MOE_CHECKPOINTS
from tests.test_push_backend import TP, run_push, shard_models
from worker.experts import Experts
from worker.handles import stage_handles
from worker.loader import apply, checkpoint_files, stage_checkpoint, stage_named, stage_one
from worker.mapped_checkpoint import mapped_checkpoint

PLACEMENTS = {"tp": False, "ep": True}


def params(models) -> list[dict[str, torch.Tensor]]:
    return [dict(m.state_dict()) for m in models]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_every_source_lands_on_the_shards_that_hold_it(arch, placement, make_checkpoint, moe_update_sources):
    """TP=2 shards (no processes): the full update in transformers' fused layout stages views of the mapped file
    only; each tensor of the partial checkpoint stages, on each rank, its slice (tensor-parallel) or all of it on the
    rank holding that expert and nothing elsewhere (expert-parallel); then the handles and a partial push; every rank
    ends holding exactly the shard of the `mixed` checkpoint."""
    ep, work = PLACEMENTS[placement], moe_update_sources(arch)
    models = shard_models(make_checkpoint(arch, **MOE_CHECKPOINTS[arch]), ep)
    num_experts = next(e for e in models[0].modules() if isinstance(e, Experts)).placement.num_experts
    (file,) = checkpoint_files(work / "full")
    for r, m in enumerate(models):
        staged = stage_checkpoint(m, work / "full")  # every value a view into the mapping of the whole file
        assert all(v.untyped_storage().nbytes() == os.path.getsize(file) for _, v in staged), "a staged copy"
        apply(staged)
        for name, src in mapped_checkpoint(checkpoint_files(work / "partial")):
            _, value = stage_one(m, name, src, "partial")
            _, expert = expert_of(name)
            holds = not ep or expert // (num_experts // TP) == r
            assert value.numel() == (src.numel() // (1 if ep else TP) if holds else 0), (r, name)
        apply(stage_checkpoint(m, work / "partial", partial=True))
        with SharedBuckets(load_file(str(work / "handles.safetensors")), bucket_bytes=1 << 16) as shared:
            apply(stage_handles(m, shared.buckets, shared.handles, partial=True))
    staged, sent = run_push(models, load_file(str(work / "push.safetensors")), 1 << 16, partial=True)
    assert sent is True and not any(isinstance(s, Exception) for s in staged), staged
    for m, s in zip(models, staged):
        apply(s)
    for r, (got, want) in enumerate(zip(params(models), params(shard_models(work / "mixed", ep)))):
        for name, t in want.items():
            assert torch.equal(got[name], t), (r, name)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bad_expert_names_and_shapes_are_refused_on_every_rank(placement, make_checkpoint):
    """An expert past the last, an expert of a dense layer, a misshapen expert (also on the rank not holding it),
    fused experts of the wrong count, and a full update lacking one expert: refused by name on both ranks."""
    model_dir = make_checkpoint("qwen3_moe")  # layer 1 is dense (mlp_only_layers)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    gate5, down3 = "model.layers.0.mlp.experts.5.gate_proj.weight", "model.layers.3.mlp.experts.3.down_proj.weight"
    past, dense = (f"model.layers.{n}.mlp.experts.{e}.gate_proj.weight" for n, e in ((0, 8), (1, 0)))
    fused = "model.layers.2.mlp.experts.gate_up_proj"
    cases = [({past: state[gate5]}, Code.UNKNOWN_TENSOR), ({dense: state[gate5]}, Code.UNKNOWN_TENSOR),
             ({gate5: state[gate5][:-1]}, Code.SHAPE_MISMATCH),  # held by rank 1 alone under expert parallelism
             ({fused: torch.zeros(7, 256, 256)}, Code.SHAPE_MISMATCH)]  # 7 experts, not 8
    for m in shard_models(model_dir, PLACEMENTS[placement]):
        for tensors, code in cases:
            with pytest.raises(WeightRefused) as refused:
                stage_named(m, tensors.items(), "tensors", partial=True)
            assert (refused.value.code, refused.value.tensor) == (code, next(iter(tensors)))
        with pytest.raises(WeightRefused) as refused:  # a full update lacking one expert's tensor
            stage_named(m, ((n, t) for n, t in state.items() if n != down3), "tensors")
        assert (refused.value.code, refused.value.tensor) == (Code.MISSING_TENSOR, down3)


def test_the_update_sequence_through_a_tp1_manager(make_checkpoint, moe_update_sources):
    """Full (fused names) then partial updates by checkpoint, handle and push (published and fused names): the tokens
    after each are transformers' generate on those weights, and the partial updates changed the answer."""
    import cluster

    arch = "qwen3_moe"
    work = moe_update_sources(arch)
    rec = run_updates(cluster.load(make_checkpoint(arch, **MOE_CHECKPOINTS[arch])), work)
    check_sequence(rec, work)


def check_sequence(rec: dict, work) -> None:
    """The driver's record of tests/moe_updates.py's sequence: versions 1 to 4, tokens of B then of `mixed`."""
    assert [rec[k]["version"] for k in ("full", "checkpoint", "handles", "push")] == [1, 2, 3, 4], rec
    after_full = hf_greedy(work / "full", PROMPTS, NEW)
    assert rec["after_full"] == after_full
    assert rec["after_partial"] == hf_greedy(work / "mixed", PROMPTS, NEW) != after_full
