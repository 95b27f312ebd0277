"""Greedy tokens chosen on the vocab shards (worker/shard_argmax.py): the same tokens and invalid rows as the
driver's sampler on the gathered logits, ties, NaN, -inf and vocabulary padding included, at TP=1 and across two
ranks; the engine uses it exactly for steps whose every sampled row is plain greedy without logprobs, and the
tokens still equal transformers'."""

from __future__ import annotations

import math

import pytest

import cluster
from cluster.config import ContinuousBatchingConfig
from driver.engine.engine import Engine
from driver.engine.logits_processing import SampleRow
from driver.engine.request import Request, SamplingParams
from driver.engine.sampler import pick
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.shard_argmax_rank import VOCAB, edge_logits
from tests.workloads import mixed_prompts
from worker.shard_argmax import ShardArgmax, shard_argmax


def sampler_choice(logits) -> tuple[list[int], list[bool]]:
    picks = pick(logits[:, :VOCAB], [SampleRow(f"r{i}", SamplingParams(), 0, 0) for i in range(logits.shape[0])])
    return picks.tokens.tolist(), picks.invalid.tolist()


def test_one_shard_chooses_what_the_sampler_does():
    logits = edge_logits(1)
    chosen = shard_argmax(logits, 0, VOCAB, 0, 1, None)
    tokens, invalid = sampler_choice(logits)
    assert chosen.tokens.tolist() == tokens and (~chosen.best.isfinite()).tolist() == invalid
    assert tokens[:2] == [2, 7] and tokens[4] == 5 and invalid[2:5] == [True, True, True]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["gloo", "host"])
def test_two_ranks_choose_what_the_sampler_does_on_the_gathered_logits(tmp_path, how):
    out = tmp_path / "argmax.json"
    proc = run_ranks("shard_argmax_rank.py", [str(out), how], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rec = read_json(out)
    assert rec["gathered_width"] == VOCAB and rec["host"] == (how == "host")
    tokens, invalid = sampler_choice(edge_logits(2))
    assert rec["pick_tokens"] == tokens and rec["pick_invalid"] == invalid  # the script's logits are these
    assert rec["tokens"] == [tokens, tokens]  # every rank holds the tokens
    assert [not math.isfinite(b) for b in rec["best"]] == invalid  # rank 0 knows the invalid rows


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_chooses_on_shards_only_for_plain_greedy_rows_without_logprobs(make_checkpoint, overlap):
    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    runner, rc, groups = model.build_runner(ContinuousBatchingConfig(page_size=16, use_async_batching=overlap))
    engine = Engine(runner, rc, groups, seed=None)
    steps = []
    launch = runner.launch
    runner.launch = lambda plan: steps.append((plan, launch(plan))) or steps[-1][1]
    prompts = mixed_prompts(2048)[:4]
    reqs = [Request("greedy_a", prompts[0], 9), Request("greedy_b", prompts[1], 12),
            Request("logprobs", prompts[2], 4, return_logprobs=True),
            Request("sampled", prompts[3], 8, sampling=SamplingParams(do_sample=True, temperature=5.0, seed=1))]
    for r in reqs:
        engine.scheduler.add(r)
    while engine.has_work():
        engine.step()
    reference = hf_greedy(model_dir, prompts)
    assert [r.generated for r in reqs[:3]] == [reference[0][:9], reference[1][:12], reference[2][:4]]
    assert len(reqs[2].logprobs) == 4 and all(lp < 0 for lp in reqs[2].logprobs)  # real logprobs, not zeros
    assert len(reqs[3].generated) == 8 and reqs[3].generated != reference[3][:8]  # sampled, not greedy
    kinds = {p.argmax_on_shards for p, _ in steps}
    assert kinds == {True, False}  # the last steps hold greedy rows alone
    for plan, handle in steps:
        assert isinstance(handle.value(), ShardArgmax) == plan.argmax_on_shards
