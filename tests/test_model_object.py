"""The object `cluster.load` returns, at TP=2 with real processes: parameters, named_parameters and state_dict
give this rank's shard of every tensor under transformers' names (q/k/v and gate/up as views into the fused
weights), in-place changes to them inside a pause are what the next requests use (they then equal
transformers' greedy on the other checkpoint); and generate_batch checks its inputs the same way on every
rank: a bad batch raises the same ValueError everywhere before any step, and a batch larger than
max_queue_size completes."""

from __future__ import annotations

from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.model_object_rank import PROMPTS


def test_model_object_and_batch_checks_tp2(make_checkpoint, tmp_path):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    out = tmp_path / "rec"
    proc = run_ranks("model_object_rank.py", [str(dir_a), str(dir_b), str(out)], timeout=240)
    recs = [read_json(f"{out}.rank{r}") for r in range(2)]
    want_a, want_b = (hf_greedy(d, PROMPTS, 8) for d in (dir_a, dir_b))

    # generate_batch: the same ValueError on every rank (none returns, none hangs)
    for key, code, text in (("too_long", "bad_max_new_tokens", "request inputs[1]: max_new_tokens=100"),
                            ("unknown_kwarg", "bad_field", "unknown generation parameter(s) ['foo']")):
        for rec in recs:
            assert rec[key]["raised"] == "RequestRejected" and rec[key]["code"] == code, (rec["rank"], rec[key])
            assert text in rec[key]["message"], rec[key]
        assert recs[0][key]["message"] == recs[1][key]["message"]
    # a batch of 5 with max_queue_size=2: fed as room appears, the same outputs on every rank
    for rec in recs:
        assert rec["small_queue"]["raised"] is None, rec["small_queue"]
        assert rec["small_queue"]["tokens"] == want_a

    names = sorted(recs[0]["state_dict_names"])
    for rec in recs:
        assert rec["eval_is_self"] and rec["dtype"] == "torch.float32" and rec["device"] == "cpu"
        assert rec["model_type"] == "llama" and rec["generation_config"] == "GenerationConfig"
        assert rec["all_parameters"] and rec["n_parameters"] == len(rec["names"]) == len(names)
        # transformers' names, fused tensors split back into theirs
        assert sorted(rec["names"]) == names == rec["state_dict_names"]
        assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight",
                "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= set(names)
        # each one is exactly this rank's part of the checkpoint's tensor; shard_of cuts the same part
        assert rec["shard_mismatch"] == [] and rec["shard_of_mismatch"] == []
        assert rec["state_dict_is_b"]
    assert len(names) == 2 + 1 + 4 * 9  # embed, norm, lm_head + 9 per layer
    # in-place changes inside the pause are what the next requests use
    assert recs[0]["before"] == want_a
    assert recs[0]["after"] == want_b
    assert proc.returncode == 0, proc.stdout[-4000:]
