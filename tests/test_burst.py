"""Multi-step decode (decode_burst): one plan runs several decode forwards, the positions, slots and KV lengths
advanced on the device between them; the tokens equal transformers' and the one-step engine's, seeded sampling
included; rows that need token history on the host, waiting requests and short budgets fall back to one step."""

from __future__ import annotations

import numpy as np
import pytest

import cluster
from cluster.config import ContinuousBatchingConfig, resolve_config
from cluster.outputs import RequestStatus
from cluster.plan import StepPlan
from driver.engine.request import Request, SamplingParams
from tests.conftest import hf_greedy
from tests.test_overlap import run_engine
from tests.workloads import mixed_prompts
from worker.step_inputs import StaticBuffers, prepare_step


def burst_config(**fields) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=16, use_async_batching=True, decode_burst=4, **fields)


def test_decode_burst_resolves_to_one_without_overlap():
    def resolved(**fields):
        return resolve_config(ContinuousBatchingConfig(**fields), device_kind="cpu", max_model_len=1024,
                              kv_bytes_per_token=4096, free_bytes=None, flash_available=False)

    assert resolved(decode_burst=8, use_async_batching=True).decode_burst == 8
    off = resolved(decode_burst=8)
    assert off.decode_burst == 1 and any("decode_burst 8 -> 1" in n for n in off.notes)
    with pytest.raises(ValueError, match="decode_burst"):
        ContinuousBatchingConfig(decode_burst=0)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_burst_plan_runs_several_forwards_with_transformers_tokens(make_checkpoint, graphs):
    """Greedy, a burst of up to 4 forwards a plan: the same tokens as transformers; fewer plans than forwards; the
    request with the shortest budget caps the burst. With (stand-in) graphs the bursts replay the bucket."""
    from worker.graphs import EagerStandIn
    from worker.self_attention import KVHeads, head_dim_of
    from worker.runner import ModelRunner

    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    runner, rc, groups = model.build_runner(burst_config(max_requests_per_batch=4))
    if graphs:
        runner = ModelRunner(model.model, rc, KVHeads(model.config, model.model.shard).kv_local,
                             head_dim_of(model.config), model.dtype, model.device, graph_factory=EagerStandIn())
    prompts, limits = mixed_prompts(2048)[3:6], [11, 6, 9]
    tokens, plans = run_engine(runner, rc, groups, prompts, limits)
    assert tokens == [t[:n] for t, n in zip(hf_greedy(model_dir, prompts), limits)]
    bursts = [p.burst for p in plans]
    assert max(bursts) == 4 and all(b == 1 or p.num_decode == p.num_seqs for b, p in zip(bursts, plans))
    assert sum(bursts) > len(plans)
    assert all(p.share_tokens for p in plans)
    if graphs:
        assert runner.graph_stats["replays"] >= sum(b for b in bursts if b > 1)


def test_seeded_sampling_draws_the_same_tokens_in_bursts(make_checkpoint):
    """Counter-based noise keyed by token index: a burst's forward i samples index + i, so seeded requests get
    what one step a plan gives them."""
    from transformers import GenerationConfig

    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    prompts = mixed_prompts(model.config.vocab_size)[:4]
    gen = GenerationConfig(do_sample=True, temperature=1.5, top_k=0, max_new_tokens=14, eos_token_id=None)
    got = {}
    for burst in (1, 4):
        cfg = ContinuousBatchingConfig(page_size=16, use_async_batching=True, decode_burst=burst, seed=7)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
        got[burst] = [o.generated_tokens for o in out.values()]
        assert burst == 1 or model.last_stats["burst_forwards"] > 0
    assert got[4] == got[1] and all(len(t) == 14 for t in got[1])
    assert got[1] != [t[:14] for t in hf_greedy(model_dir, prompts)], "the rows did not sample"


def test_rows_with_token_history_or_waiting_requests_run_one_step(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    runner, rc, groups = model.build_runner(burst_config())
    from driver.engine.engine import Engine

    engine = Engine(runner, rc, groups, seed=None)
    prompt = mixed_prompts(2048)[0]

    def decoding(sampling: SamplingParams = SamplingParams(), max_new: int = 20) -> list:
        r = Request("r", prompt, max_new_tokens=max_new, sampling=sampling)
        r.generated, r.num_computed = [1, 2], len(prompt) + 1
        assert engine.blocks.allocate(r, r.num_computed + 1)
        from driver.engine.scheduler import Scheduled
        return [Scheduled(r, 1)]

    assert engine.scheduler.burst_length(decoding()) == 4
    assert engine.scheduler.burst_length(decoding(SamplingParams(repetition_penalty=1.2))) == 1
    assert engine.scheduler.burst_length(decoding(SamplingParams(no_repeat_ngram_size=2))) == 1
    assert engine.scheduler.burst_length(decoding(max_new=5)) == 3  # 2 generated: 3 left
    assert engine.scheduler.burst_length(decoding(max_new=3)) == 1
    batch = decoding()
    engine.scheduler.running = [batch[0].req, Request("left-out", prompt, max_new_tokens=9)]  # not in the batch
    assert engine.scheduler.burst_length(batch) == 1
    engine.scheduler.running = []
    engine.scheduler.waiting.append(Request("w", prompt, max_new_tokens=2))
    assert engine.scheduler.burst_length(decoding()) == 1


@pytest.mark.parametrize("flash", [False, True])
def test_advancing_on_the_device_lays_out_what_the_next_plan_would(make_checkpoint, flash):
    """A burst's later forward (positions, slots, KV lengths and input ids advanced on the device, in both the
    SDPA and the paged kernels' layouts) reads exactly what preparing the next one-step plan on the host gives."""
    import dataclasses

    import torch

    model = cluster.load(make_checkpoint("llama"))
    runner, rc, _ = model.build_runner(ContinuousBatchingConfig(page_size=16))
    rc = dataclasses.replace(rc, attention="flash_attn" if flash else "paged_sdpa", max_blocks_per_request=8)
    tables = np.array([[3, 7, 9, 0], [4, 5, 0, 0], [8, 2, 6, 1]], np.int32)
    kv = np.array([17, 30, 40], np.int32)
    one = np.ones(3, np.int32)

    def plan(kv_lens, ids, burst=1):
        return StepPlan(input_ids=np.asarray(ids, np.int32), q_lens=one, kv_lens=np.asarray(kv_lens, np.int32),
                        sample=one, block_tables=tables, burst=burst)

    def laid_out(buf, ids, meta):
        fields = ["positions", "slot_mapping", "dec_q_pos"] + (["dec_kv_lens"] if flash else ["dec_kv_slots"])
        return {"ids": ids.tolist(), **{f: getattr(meta, f).tolist() for f in fields}}

    buf = StaticBuffers(rc, torch.device("cpu"))
    ids, meta, _ = prepare_step(rc, buf, plan(kv, [5, 6, 7], burst=3), scratch_block=0)
    runner.shared_tokens[:3] = torch.tensor([50, 60, 70])
    runner._advance(ids, meta, 3)
    if not flash:  # a position the burst has not reached yet lists the scratch slot (0 here), not its page's
        assert meta.dec_kv_slots[:, kv + 1].diagonal().tolist() == [0, 0, 0]
    runner.shared_tokens[:3] = torch.tensor([51, 61, 71])
    runner._advance(ids, meta, 3)
    got = laid_out(buf, ids, meta)
    want_buf = StaticBuffers(rc, torch.device("cpu"))
    want_ids, want_meta, _ = prepare_step(rc, want_buf, plan(kv + 2, [51, 61, 71], burst=1), scratch_block=0)
    want = laid_out(want_buf, want_ids, want_meta)
    if not flash:  # the burst's key-slot lists are 2 positions wider, scratch past the query (checked above)
        width = len(want["dec_kv_slots"][0])
        assert [row[:width] for row in got.pop("dec_kv_slots")] == want.pop("dec_kv_slots")
    assert got == want


def test_a_burst_never_reads_stale_kv_at_positions_it_has_not_written(make_checkpoint):
    """Every page but the scratch block starts full of NaN, as pages freed by a request whose K/V overflowed
    would be: a burst's later positions must not be read (not even masked) before its forwards write them, so
    the tokens still equal transformers' (SDPA layout)."""
    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    runner, rc, groups = model.build_runner(burst_config(max_requests_per_batch=4))
    assert rc.attention == "paged_sdpa"
    scratch = runner.cache.scratch_block * rc.page_size
    for t in runner.cache.k + runner.cache.v:
        t[:scratch] = float("nan")
    prompts, limits = mixed_prompts(2048)[3:6], [11, 6, 9]
    tokens, plans = run_engine(runner, rc, groups, prompts, limits)
    assert max(p.burst for p in plans) > 1
    assert tokens == [t[:n] for t, n in zip(hf_greedy(model_dir, prompts), limits)]


@pytest.mark.slow
def test_bursts_cut_at_eos_and_limits_with_the_same_tokens_logprobs_and_endings(make_checkpoint):
    """An EOS list that ends requests inside a burst, varied max_new_tokens and logprobs: the same tokens,
    logprobs, statuses and finish reasons as one forward a plan; the tokens a burst drew past an ending are
    dropped."""
    model = cluster.load(make_checkpoint("llama", vocab_size=512))
    prompts = mixed_prompts(512)[:10]
    eos = list(range(7, 512, 512 // 64 + 1))[:64]  # about 1 token in 8 ends a request
    got = {}
    for burst in (1, 4):
        cfg = ContinuousBatchingConfig(page_size=16, use_async_batching=True, decode_burst=burst,
                                       return_logprobs=True)
        out = model.generate_batch(prompts, continuous_batching_config=cfg, max_new_tokens=23, eos_token_id=eos)
        got[burst] = [(o.generated_tokens, o.status, o.finish_reason, np.round(o.logprobs, 4).tolist())
                      for o in out.values()]
        if burst > 1:
            assert model.last_stats["burst_forwards"] > 0
    assert got[4] == got[1]
    lengths = [len(t) for t, *_ in got[1]]
    assert any(n < 23 for n in lengths) and any(n == 23 for n in lengths)  # EOS endings, and length endings
    assert all(len(lp) == len(t) for t, _, _, lp in got[1])


def test_generated_blocks_become_shareable_while_bursting(make_checkpoint):
    """A bursting request's K/V always runs ahead of its tokens on the host; its full blocks are registered for
    prefix sharing as far as its tokens are known (not only the prompt's)."""
    from driver.engine.engine import Engine

    model = cluster.load(make_checkpoint("llama"))
    runner, rc, groups = model.build_runner(burst_config(allow_block_sharing=True))
    engine = Engine(runner, rc, groups, seed=None)
    req = Request("r", list(range(3, 23)), max_new_tokens=60)
    engine.scheduler.add(req)
    while len(req.generated) < 40:
        engine.step()
    assert engine.num_burst_forwards > 0 and req.num_computed > req.num_tokens
    assert len(req.block_hashes) == req.num_tokens // 16 >= 3  # 20 prompt tokens: one block before any decode
    while engine.has_work():
        engine.step()


def run_burst_engine(make_checkpoint, on_forward=None, between=None):
    """Three greedy requests through a bare Engine with bursts of up to 4. `on_forward(plan, i, chosen)` runs after
    forward i of each plan (chosen: its ShardArgmax, editable); `between(engine)` after each step. Returns
    (model dir, prompts, requests); nothing is left in flight, pending or allocated."""
    from driver.engine.engine import Engine

    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    runner, rc, groups = model.build_runner(burst_config(max_requests_per_batch=4))
    engine = Engine(runner, rc, groups, seed=None)
    current = {}
    launch, argmax = runner.launch, runner.model.lm_head.argmax

    def launching(plan):
        current.update(plan=plan, i=0)
        return launch(plan)

    def choosing(local):
        chosen = argmax(local)
        if on_forward is not None:
            on_forward(current["plan"], current["i"], chosen)
        current["i"] += 1
        return chosen

    runner.launch, runner.model.lm_head.argmax = launching, choosing
    prompts = mixed_prompts(2048)[3:6]
    reqs = [Request(f"r{i}", p, max_new_tokens=14) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.scheduler.add(r)
    while engine.has_work():
        engine.step()
        if between is not None:
            between(engine)
    assert engine.in_flight is None and engine.blocks.num_free == rc.num_blocks
    assert all(r.num_pending == 0 for r in reqs) and engine.num_burst_forwards > 0
    return model_dir, prompts, reqs


def test_a_cancel_while_a_burst_is_in_flight_keeps_the_others_exact(make_checkpoint):
    """A request cancelled while a burst is in flight (launched, not collected) drops the burst's tokens and frees
    its pages; the other rows' tokens are transformers'."""
    hit = []

    def cancel(engine):
        f = engine.in_flight
        if f is not None and len(f.launched) > 1 and not hit:
            hit.append(len(f.sampled[1].generated))
            engine.end(f.sampled[1], RequestStatus.CANCELLED, "cancelled")

    model_dir, prompts, reqs = run_burst_engine(make_checkpoint, between=cancel)
    reference = hf_greedy(model_dir, prompts)
    assert hit and reqs[1].status == RequestStatus.CANCELLED and len(reqs[1].generated) == hit[0] < 14
    assert reqs[1].generated == reference[1][:hit[0]]
    assert [reqs[0].generated, reqs[2].generated] == [reference[0][:14], reference[2][:14]]


def test_a_row_that_fails_inside_a_burst_fails_alone(make_checkpoint):
    """A row whose logits turn invalid in a burst's third forward fails (sampling_failed) with the tokens before
    it kept; the burst falls back to applying its forwards one by one and the other rows stay exact."""
    hit = []

    def poison(plan, i, chosen):
        if plan.burst > 2 and i == 2 and not hit:
            hit.append(plan.step)
            chosen.best[1] = float("nan")

    model_dir, prompts, reqs = run_burst_engine(make_checkpoint, on_forward=poison)
    reference = hf_greedy(model_dir, prompts)
    assert hit and reqs[1].status == RequestStatus.FAILED and reqs[1].error_code == "sampling_failed"
    assert 2 <= len(reqs[1].generated) < 14 and reqs[1].generated == reference[1][:len(reqs[1].generated)]
    assert [reqs[0].generated, reqs[2].generated] == [reference[0][:14], reference[2][:14]]
