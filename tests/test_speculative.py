"""Speculative decoding (docs/speculative.md), at TP=1 in this process: the setting's typed errors, the n-gram
proposer, greedy outputs token-identical to plain decoding and to transformers' generate (chunked prefill,
preemption, prefix sharing, overlap asked for), EOS and max_new_tokens cut inside an accepted run as plain decoding
cuts, logprobs of every accepted token, the per-request opt-out, seeded sampling identical to plain sampling, the
acceptance rule's distribution, pages given back, and the stats and Prometheus counters. TP=2: tests/test_parity.py
(mode `spec` in the TP=2 launch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import cluster
from cluster.errors import Code, RequestRejected, SpeculativeConfigError
from cluster.metrics_export import render
from cluster.speculative import SpeculativeConfig
from driver.api.serving_metrics import metrics_map
from driver.engine.block_manager import BlockManager
from driver.engine.ngram import propose
from driver.engine.request import Request, SamplingParams
from driver.engine.speculation import Speculator
from tests.conftest import hf_greedy
from tests.workloads import NEW_TOKENS, SCENARIOS, SPECULATIVE, prompts_for


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def model(model_dir):
    return cluster.load(model_dir)


def config(speculative=SPECULATIVE, **fields) -> cluster.ContinuousBatchingConfig:
    return cluster.ContinuousBatchingConfig(**{"page_size": 16, **fields}, speculative=speculative)


def spec_stats(model) -> dict:
    return {k: v for k, v in model.last_stats.items() if k.startswith("spec_")}


# ---------------------------------------------------------------- the setting and the proposer
@pytest.mark.parametrize("table,field", [({"method": "eagle"}, "method"), ({"method": "draft"}, "model"),
                                         ({"model": "."}, "model"), ({"method": "draft", "model": "/nowhere"},
                                         "model"), ({"num_speculative_tokens": 0},
                                         "num_speculative_tokens"), ({"num_speculative_tokens": 17},
                                         "num_speculative_tokens"), ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
                                         ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                                         ({"num_speculative_tokens": True}, "num_speculative_tokens"),
                                         ({"lookahead": 2}, "lookahead")])
def test_bad_settings_raise_typed_errors_naming_the_field(table, field):
    with pytest.raises(SpeculativeConfigError) as e:
        cluster.ContinuousBatchingConfig(speculative=table)
    assert e.value.field == field and e.value.code == Code.BAD_FIELD and field in str(e.value)
    assert isinstance(e.value, ValueError)  # as every other ContinuousBatchingConfig field's error
    with pytest.raises(SpeculativeConfigError):
        cluster.ContinuousBatchingConfig(speculative="ngram")


def test_settings_resolve_from_a_preset_table(tmp_path):
    preset = tmp_path / "spec.toml"
    preset.write_text('[continuous_batching]\nspeculative = {method = "ngram", num_speculative_tokens = 5, '
                      'prompt_lookup_max = 4}\n')
    from cluster.config import load_preset
    got = SpeculativeConfig.from_any(load_preset(preset).speculative)
    assert got == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=4)
    assert SpeculativeConfig.from_any(None) is None


def test_ngram_proposes_what_followed_the_latest_longest_match():
    t = np.array([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3])
    assert propose(t, 3, 1, 3).tolist() == [9, 9, 1]  # "1 2 3" last seen at 5, not at 0
    assert propose(t, 3, 1, 1).tolist() == [9, 9, 1]  # "3" last seen at 7
    assert propose(np.array([7, 8, 9, 4, 8, 9]), 2, 1, 2).tolist() == [4, 8]  # "8 9" beats the later "9"
    assert propose(np.array([5, 5, 5, 5]), 4, 1, 3).tolist() == [5, 5, 5, 5]  # the copy runs on into itself
    assert propose(np.array([3, 1, 2, 1, 2]), 5, 2, 2).tolist() == [1, 2, 1, 2, 1]
    assert propose(np.array([1, 2, 3]), 4, 1, 3).size == 0  # nothing earlier matches
    assert propose(np.array([6, 1, 2, 6]), 2, 2, 3).size == 0  # only n >= 2 counts: "2 6" never came earlier
    assert propose(np.array([7]), 4, 1, 3).size == 0


def test_trim_frees_the_pages_past_the_tokens():
    blocks = BlockManager(8, 4, allow_sharing=True)
    req = Request("r", [1, 2, 3], 10)
    assert blocks.allocate(req, 9)
    assert len(req.block_ids) == 3 and blocks.num_free == 5
    blocks.trim(req, 5)
    assert len(req.block_ids) == 2 and blocks.num_free == 6
    blocks.trim(req, 8)  # nothing past 8 tokens' pages
    assert len(req.block_ids) == 2


def test_a_request_whose_proposals_miss_backs_off():
    """No proposal (or none accepted) makes a request wait 1, 2, 4 ... decode steps before it proposes again; while
    it waits the engine need not collect an overlapped step first."""
    from driver.engine.persistent_batch import PersistentBatch

    rows, blocks = PersistentBatch(64), BlockManager(16, 4, allow_sharing=False)
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=2), seed=None)
    req = Request("r", [1, 2, 3, 4], 20)  # no token repeats: no proposal
    rows.join(req)
    req.num_computed = req.num_tokens - 1
    proposed = []
    for step in range(8):
        n = [1]
        proposed.append(bool(spec.draft([req], n, rows, blocks, budget=64, keep_free=0)))
        assert n == [1] and spec.wants_host_tokens([req]) == (step in (1, 4))  # it proposes at steps 0, 2, 5
        req.generated.append(10 + step)  # plain decoding appends a fresh token; the row stays one behind
        req.num_computed = req.num_tokens - 1
    assert spec.backoff[req][0] == 3 and proposed == [False] * 8
    req.generated.append(req.generated[-1])  # now "x x": "x" came before
    req.num_computed = req.num_tokens - 1
    spec.backoff[req] = (3, 0)
    n = [1]
    assert spec.draft([req], n, rows, blocks, budget=64, keep_free=0)[req].tolist() == [17, 17] and n == [3]
    assert len(req.block_ids) == blocks.blocks_for(req.num_tokens + 2)  # pages for the proposals
    req.speculative = False
    assert not spec.wants_host_tokens([req])
    # sampling that reads the history (penalties, generation options, structured outputs) decodes plainly
    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(no_repeat_ngram_size=2),
                   SamplingParams(structured_output="start: /[0-9]+/"), SamplingParams(presence_penalty=0.5)):
        assert not Speculator.eligible(Request("h", [1, 2], 4, sampling=params))
    assert Speculator.eligible(Request("s", [1, 2], 4, sampling=SamplingParams(do_sample=True, top_k=5)))


def test_the_wire_carries_the_switch():
    from cluster.protocol import ProtocolError, parse_submit

    assert parse_submit({"input_ids": [1, 2]}).speculative is True
    assert parse_submit({"input_ids": [1, 2], "speculative": False}).speculative is False
    with pytest.raises(ProtocolError) as e:
        parse_submit({"input_ids": [1, 2], "speculative": 0})
    assert e.value.code == Code.BAD_FIELD and "speculative" in str(e.value)
    from launch.gateway.openai_schema import CompletionRequest  # the HTTP gateway's field, passed to the wire

    off = CompletionRequest(model="m", prompt=[1, 2], speculative=False)
    assert off.submit_params(4, False, 0, False)["speculative"] is False
    assert "speculative" not in CompletionRequest(model="m", prompt=[1, 2]).submit_params(4, False, 0, False)


# ---------------------------------------------------------------- greedy: exact
@pytest.mark.parametrize("scenario", ["chunked", "sharing", "preempt"])
def test_greedy_equals_plain_decoding_and_transformers(model, model_dir, scenario):
    fields, kind = SCENARIOS[scenario]
    prompts = prompts_for(kind, model.config.vocab_size)
    overlap = scenario == "sharing"  # overlap asked for: a speculating row collects the step in flight first
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS,
                               continuous_batching_config=config(use_async_batching=overlap, **fields))
    stats = model.last_stats
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)
    # the tiny model's greedy outputs repeat: proposals are accepted, and some are not
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], spec_stats(model)
    assert sum(stats["spec_accepted_per_pos"]) == stats["spec_accepted_tokens"] and stats["spec_method"] == "ngram"
    assert stats["spec_mean_accept_length"] == pytest.approx(1 + stats["spec_accepted_tokens"] / stats["spec_drafts"])
    assert stats["free_blocks"] == stats["num_blocks"]  # no page left behind by a rejected proposal
    if scenario == "preempt":
        assert stats["preemptions"] > 0
    if scenario == "sharing":
        assert stats["prefix_hit_blocks"] > 0
    plain = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS,
                                 continuous_batching_config=config(None, use_async_batching=overlap, **fields))
    assert [o.generated_tokens for o in plain.values()] == [o.generated_tokens for o in out.values()]
    assert stats["step"] < model.last_stats["step"]  # fewer forwards than plain decoding


def test_eos_and_length_cut_inside_accepted_runs(model):
    prompts = prompts_for("mixed", model.config.vocab_size)[4:12]
    plain = model.generate_batch(prompts, max_new_tokens=24, continuous_batching_config=config(None))
    # an EOS id that plain decoding produces late in a repeating stretch, so the accepted runs reach it
    eos = next(t for o in plain.values() for t in o.generated_tokens[6:] if o.generated_tokens.count(t) > 3)
    for kwargs in ({"eos_token_id": eos, "max_new_tokens": 24}, {"max_new_tokens": 7}, {"max_new_tokens": 2}):
        gen = GenerationConfig(**kwargs)
        want = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config(None))
        got = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config())
        assert model.last_stats["spec_accepted_tokens"] > 0 or kwargs["max_new_tokens"] == 2
        for a, b in zip(want.values(), got.values()):
            assert (b.generated_tokens, b.finish_reason) == (a.generated_tokens, a.finish_reason), kwargs
        if "eos_token_id" in kwargs:  # the EOS run: some request stopped on it, before its length
            assert any(o.finish_reason == "stop" and len(o.generated_tokens) < 24 for o in got.values())


def test_logprobs_of_every_accepted_token_and_the_opt_out(model):
    prompt = prompts_for("mixed", model.config.vocab_size)[9]
    runs = {}
    for spec in (None, SPECULATIVE):
        with model.continuous_batching_context_manager(continuous_batching_config=config(spec)) as m:
            rid = m.add_request(prompt, max_new_tokens=20, top_logprobs=3, eos_token_id=-1)
            runs[spec is not None] = m.get_result(rid, timeout=60)
            out = m.get_result(m.add_request(prompt, max_new_tokens=20, eos_token_id=-1, speculative=False),
                               timeout=60)
            assert out.generated_tokens == runs[spec is not None].generated_tokens
            stats = m.stats()
            with pytest.raises(RequestRejected) as e:
                m.add_request(prompt, max_new_tokens=2, speculative="yes")
            assert e.value.code == Code.BAD_FIELD and "speculative" in e.value.message
    assert stats["spec_accepted_tokens"] > 0
    plain, spec = runs[False], runs[True]
    assert spec.generated_tokens == plain.generated_tokens and len(spec.logprobs) == 20
    assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    for a, b in zip(plain.top_logprobs, spec.top_logprobs):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)


def test_pauses_keep_and_retract_change_nothing(model):
    """Pauses of mode keep (frozen with their KV) and retract (KV freed, recomputed after) in the middle of
    speculating requests: the outputs are plain decoding's."""
    import time

    prompts = prompts_for("mixed", model.config.vocab_size)[2:8]
    want = model.generate_batch(prompts, max_new_tokens=48, continuous_batching_config=config(None))
    with model.continuous_batching_context_manager(continuous_batching_config=config()) as m:
        ids = [m.add_request(p, max_new_tokens=48, eos_token_id=-1) for p in prompts]
        for mode in ("keep", "retract"):
            time.sleep(0.15)
            with m.pause(mode):
                pass
        outs = [m.get_result(i, timeout=120) for i in ids]
        stats = m.stats()
    assert [o.generated_tokens for o in outs] == [o.generated_tokens for o in want.values()]
    assert stats["spec_accepted_tokens"] > 0
    held = {mode for o in outs for _, mode in (o.pauses or [])}
    assert held, "no pause held a request: the test paused nothing"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_as_the_uninterrupted_one(model, sampled):
    """Crash-resume (docs/recovery.md): a request resumed after k delivered tokens, speculating, writes the
    uninterrupted plain run's tokens (its token index counts the resumed ones)."""
    prompt = prompts_for("mixed", model.config.vocab_size)[9]
    params = {"do_sample": True, "temperature": 0.01, "seed": 11} if sampled else {}
    with model.continuous_batching_context_manager(continuous_batching_config=config(
            None, per_request_processors=True)) as m:
        whole = m.get_result(m.add_request(prompt, max_new_tokens=24, eos_token_id=-1, **params), timeout=60)
        greedy = m.get_result(m.add_request(prompt, max_new_tokens=24, eos_token_id=-1), timeout=60)
    assert (whole.generated_tokens != greedy.generated_tokens) == sampled  # the seeded run really samples
    with model.continuous_batching_context_manager(continuous_batching_config=config(
            per_request_processors=True)) as m:
        for k in (1, 9):
            rid = m.add_request(prompt, max_new_tokens=24, eos_token_id=-1, resume_tokens=whole.generated_tokens[:k],
                                resumes=1, **params)
            assert m.get_result(rid, timeout=60).generated_tokens == whole.generated_tokens
        assert m.stats()["spec_accepted_tokens"] > 0


def test_opted_out_requests_propose_nothing(model):
    prompts = prompts_for("mixed", model.config.vocab_size)[4:8]
    with model.continuous_batching_context_manager(continuous_batching_config=config()) as m:
        ids = [m.add_request(p, max_new_tokens=16, speculative=False) for p in prompts]
        [m.get_result(i, timeout=60) for i in ids]
        assert m.stats()["spec_drafts"] == 0
        metrics = metrics_map(m)
    assert metrics["spec_decode_num_drafts"] == 0 and metrics["spec_decode_num_accepted_tokens_per_pos"] == [0] * 4


# ---------------------------------------------------------------- sampling: the target's distribution
def test_seeded_sampling_equals_plain_sampling(model):
    """The verifier draws at each position what plain decoding draws there (same key, same token index), so seeded
    sampled outputs are token for token the plain ones; a low temperature makes the tiny model repeat itself."""
    prompts = prompts_for("mixed", model.config.vocab_size)[:8]
    gen = GenerationConfig(do_sample=True, temperature=0.05, top_k=50, max_new_tokens=24, eos_token_id=None)
    runs = [[o.generated_tokens for o in model.generate_batch(prompts, generation_config=gen,
                                                                continuous_batching_config=config(spec, seed=seed)
                                                                ).values()]
            for seed in (5, 5, 6) for spec in (None, SPECULATIVE)]
    assert model.last_stats["spec_accepted_tokens"] > 0
    assert runs[0] == runs[1] == runs[2] == runs[3]  # speculative = plain, and repeatable
    assert runs[4] == runs[5] and runs[4] != runs[0]  # another seed: other tokens, still equal


def test_n_samples_equal_plain_sampling(model):
    """n samples of a prompt (children forked from one prefill, each keyed by the seed and its index)."""
    prompts = prompts_for("mixed", model.config.vocab_size)[5:8]
    gen = GenerationConfig(do_sample=True, temperature=0.05, max_new_tokens=20, eos_token_id=None,
                           num_return_sequences=3)
    runs = [{k: o.generated_tokens for k, o in model.generate_batch(
        prompts, generation_config=gen, continuous_batching_config=config(spec, seed=3)).items()}
        for spec in (None, SPECULATIVE)]
    assert len(runs[0]) == 9 and runs[0] == runs[1]
    assert model.last_stats["spec_accepted_tokens"] > 0 and model.last_stats["forked_children"] > 0


def test_acceptance_is_rejection_sampling(model):
    """Many seeded requests verify the same proposal x against the same target distribution p: x stands with
    probability p(x) (within 4 standard deviations), and a rejected draw follows p with x removed, renormalised
    (total variation under 0.05 over 3000-odd draws; its expected size here is about 0.02)."""
    vocab, x, n = 6, 2, 6000
    logits = torch.tensor([1.0, 0.2, 0.9, -0.5, 0.4, 0.0])
    p = torch.softmax(logits, -1).double()
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=1), seed=None)
    reqs = [Request(f"r{i}", [1, 2, 3], 4, sampling=SamplingParams(do_sample=True, seed=i)) for i in range(n)]
    drafts = {r: np.array([x]) for r in reqs}
    draws = spec.verify(logits.repeat(2 * n, 1), reqs, drafts)
    first = np.array([d[0].token for d in draws])
    accepted = (first == x).mean()
    assert abs(accepted - p[x].item()) < 4 * (p[x].item() * (1 - p[x].item()) / n) ** 0.5
    assert spec.stats.accepted_tokens == int((first == x).sum()) and spec.stats.drafts == n
    assert all(len(d) == (2 if t == x else 1) for d, t in zip(draws, first))  # the bonus after an accepted x
    rejected = np.bincount(first[first != x], minlength=vocab) / (first != x).sum()
    q = p.clone()
    q[x] = 0
    assert 0.5 * np.abs(rejected - (q / q.sum()).numpy()).sum() < 0.05


# ---------------------------------------------------------------- the draft-model proposer
@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    """The target's checkpoint with noise on every matrix (a tenth of its spread): a draft that agrees with the
    target often but not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft") / "llama-noisy"
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.1 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v
               for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def draft(path, k=4) -> dict:
    return {"method": "draft", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("scenario", ["chunked", "sharing", "preempt"])
def test_draft_model_greedy_equals_transformers(model, model_dir, draft_dir, scenario):
    fields, kind = SCENARIOS[scenario]
    prompts = prompts_for(kind, model.config.vocab_size)
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS,
                               continuous_batching_config=config(draft(draft_dir), use_async_batching=True,
                                                                 **fields))  # overlap asked for: it runs in series
    stats = model.last_stats
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], spec_stats(model)
    assert stats["free_blocks"] == stats["num_blocks"] and stats["burst_forwards"] == 0
    assert stats["spec_method"] == "draft"
    if scenario == "preempt":
        assert stats["preemptions"] > 0


def test_draft_model_seeded_sampling_equals_plain(model, draft_dir):
    prompts = prompts_for("mixed", model.config.vocab_size)[:8]
    gen = GenerationConfig(do_sample=True, temperature=0.05, max_new_tokens=24, eos_token_id=None)
    runs = [[o.generated_tokens for o in model.generate_batch(prompts, generation_config=gen,
                                                                continuous_batching_config=config(spec, seed=5)
                                                                ).values()]
            for spec in (None, draft(draft_dir, 3))]
    assert runs[0] == runs[1] and model.last_stats["spec_accepted_tokens"] > 0


def test_a_draft_of_another_vocabulary_is_refused(model, make_checkpoint):
    other = make_checkpoint("llama", seed=0, vocab_size=1000)
    with pytest.raises(SpeculativeConfigError) as e:
        model.generate_batch([[1, 2, 3]], max_new_tokens=2, continuous_batching_config=config(draft(other)))
    assert e.value.field == "model" and "vocabulary" in str(e.value)


# ---------------------------------------------------------------- metrics
def test_prometheus_has_vllms_spec_decode_counters():
    metrics = {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 9, "spec_decode_num_accepted_tokens": 5,
               "spec_decode_num_accepted_tokens_per_pos": [3, 2, 0]}
    text = render({"metrics": metrics}, "m").decode()
    assert 'lockstep:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'lockstep:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'lockstep:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'lockstep:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    from cluster.metrics_export import merge
    assert merge([metrics, metrics])["spec_decode_num_accepted_tokens_per_pos"] == [6, 4, 0]
