"""The object `cluster.load` returns, at TP=2 with real processes: parameters, named_parameters and state_dict
give this rank's shard of every tensor under transformers' names (q/k/v and gate/up as views into the fused
weights), in-place changes to them inside a pause are what the next requests use (they then equal
transformers' greedy on the other checkpoint); and generate_batch checks its inputs the same way on every
rank: a bad batch raises the same ValueError everywhere before any step, and a batch larger than
max_queue_size completes."""

from __future__ import annotations

import pytest

from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.model_object_rank import PROMPTS


@pytest.fixture(scope="module")
def run(make_checkpoint, tmp_path_factory):
    """One TP=2 run of the script; (records of rank 0 and 1, checkpoint A, checkpoint B, torchrun's result)."""
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    out = tmp_path_factory.mktemp("model_object") / "rec"
    proc = run_ranks("model_object_rank.py", [str(dir_a), str(dir_b), str(out)], timeout=240)
    return [read_json(f"{out}.rank{r}") for r in range(2)], dir_a, dir_b, proc


@pytest.mark.slow
@pytest.mark.parametrize("key,code,text", [
    ("too_long", "bad_max_new_tokens", "request inputs[1]: max_new_tokens=100"),
    ("unknown_kwarg", "bad_field", "unknown generation parameter(s) ['foo']")])
def test_batch_checks_raise_alike_on_every_rank(run, key, code, text):
    recs = run[0]
    assert [rec[key]["raised"] is not None for rec in recs] == [True, True], [rec[key] for rec in recs]
    assert recs[0][key]["message"] == recs[1][key]["message"]
    for rec in recs:
        assert rec[key]["raised"] == "RequestRejected" and rec[key]["code"] == code, (rec["rank"], rec[key])
        assert text in rec[key]["message"], rec[key]


@pytest.mark.slow
def test_batch_larger_than_queue_is_fed(run):
    """5 prompts with max_queue_size=2: every rank gets all 5, equal to transformers."""
    recs, dir_a = run[0], run[1]
    for rec in recs:
        assert rec["small_queue"]["raised"] is None, rec["small_queue"]
        assert rec["small_queue"]["tokens"] == hf_greedy(dir_a, PROMPTS, 8)


@pytest.mark.slow
def test_parameters_are_this_ranks_shards_under_transformers_names(run):
    recs = run[0]
    names = recs[0]["state_dict_names"]
    assert len(names) == 2 + 1 + 4 * 9  # embed, norm, lm_head + 9 per layer
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight",
            "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= set(names)
    for rec in recs:
        assert rec["eval_is_self"] and rec["dtype"] == "torch.float32" and rec["device"] == "cpu"
        assert rec["model_type"] == "llama" and rec["generation_config"] == "GenerationConfig"
        assert rec["all_parameters"] and rec["n_parameters"] == len(rec["names"]) == len(names)
        assert sorted(rec["names"]) == names == rec["state_dict_names"]
        # each one is exactly this rank's part of the checkpoint's tensor; shard_of cuts the same part
        assert rec["shard_mismatch"] == [] and rec["shard_of_mismatch"] == []


@pytest.mark.slow
def test_in_place_changes_inside_pause_are_used(run):
    recs, dir_a, dir_b, proc = run
    assert recs[0]["before"] == hf_greedy(dir_a, PROMPTS, 8)
    assert recs[0]["after"] == hf_greedy(dir_b, PROMPTS, 8)
    assert all(rec["state_dict_is_b"] for rec in recs)
    assert proc.returncode == 0, proc.stdout[-4000:]
