"""Seeded sampling is reproducible run after run; logprobs and the sampling knobs do what they say."""

from __future__ import annotations

import pytest
import subprocess
import sys

from transformers import GenerationConfig

import cluster
from tests.conftest import REPO, hf_greedy, read_json, run_ranks
from tests.workloads import mixed_prompts

SAMPLED = GenerationConfig(do_sample=True, temperature=0.8, top_k=50, top_p=0.95, max_new_tokens=16,
                           eos_token_id=None)


def sample_once(model, seed, **cfg):
    prompts = mixed_prompts(model.config.vocab_size)[:8]
    out = model.generate_batch(prompts, generation_config=SAMPLED,
                               continuous_batching_config=cluster.ContinuousBatchingConfig(seed=seed, **cfg))
    return [o.generated_tokens for o in out.values()], out


@pytest.mark.slow
def test_seeded_sampling_repeats(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    a, _ = sample_once(model, 1234)
    b, _ = sample_once(model, 1234, max_batch_tokens=64)  # a different batching gives the same tokens
    c, _ = sample_once(model, 99)
    assert a == b
    assert a != c
    assert all(len(t) == 16 for t in a)


@pytest.mark.slow
def test_seeded_sampling_repeats_across_processes(make_checkpoint):
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import cluster; "
            "from tests.test_sampling import sample_once; "
            f"m = cluster.load({str(make_checkpoint('llama'))!r}); print(sample_once(m, 7)[0])")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
            for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr[-2000:]
    assert runs[0].stdout.strip().splitlines()[-1] == runs[1].stdout.strip().splitlines()[-1]


def hf_scores(model_dir, prompts, new_tokens):
    """transformers' greedy tokens and the log-probability of each under its own logits (float32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 eos_token_id=None)
            gen = out.sequences[0, len(p):]
            steps = torch.stack(out.logits, 1)[0].float().log_softmax(-1)  # [new_tokens, vocab]
            tokens.append(gen.tolist())
            logprobs.append(steps.gather(-1, gen[:, None])[:, 0].tolist())
    return tokens, logprobs


def assert_logprobs_match(tokens, logprobs, prompts, model_dir):
    want_tokens, want = hf_scores(model_dir, prompts, len(tokens[0]))
    assert tokens == want_tokens
    for got, ref in zip(logprobs, want):
        assert len(got) == len(ref)
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, (got, ref)


@pytest.mark.slow
def test_logprobs_match_transformers_scores_tp1(make_checkpoint):
    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    prompts = mixed_prompts(model.config.vocab_size)[:6]
    out = model.generate_batch(prompts, max_new_tokens=8, continuous_batching_config=cluster.ContinuousBatchingConfig(
        page_size=16, return_logprobs=True))
    assert_logprobs_match([o.generated_tokens for o in out.values()], [o.logprobs for o in out.values()], prompts,
                          model_dir)


@pytest.fixture(scope="module")
def tp2_records(make_checkpoint, tmp_path_factory) -> tuple[dict, dict]:
    """One torchrun launch of tests/scripts/sampling_rank.py for the module's TP=2 tests: its `logprobs` and
    `publish` modes, in that order; (rank 0's record, rank 1's)."""
    rec = tmp_path_factory.mktemp("sampling") / "rec"
    proc = run_ranks("sampling_rank.py", ["logprobs,publish", str(make_checkpoint("llama")), str(rec)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return read_json(f"{rec}.rank0"), read_json(f"{rec}.rank1")


@pytest.mark.slow
def test_logprobs_match_transformers_scores_tp2(make_checkpoint, tp2_records):
    rec = tp2_records[0]["logprobs"]
    assert_logprobs_match(rec["tokens"], rec["logprobs"], rec["prompts"], make_checkpoint("llama"))


# ---------------------------------------------------------------- a sampling error fails its own request only
def test_a_row_that_fails_to_sample_fails_only_its_request(make_checkpoint, monkeypatch):
    import driver.engine.sampler

    real = driver.engine.sampler.pick

    def broken(logits, rows, *args):  # any batch holding req_1 raises: the sampler must find req_1 row by row
        if any(r.request_id == "req_1" for r in rows):
            raise RuntimeError("boom in row req_1")
        return real(logits, rows, *args)

    monkeypatch.setattr(driver.engine.sampler, "pick", broken)
    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    prompts = mixed_prompts(model.config.vocab_size)[:4]
    gen = GenerationConfig(do_sample=False, repetition_penalty=1.0, max_new_tokens=6, eos_token_id=None)
    out = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=cluster.ContinuousBatchingConfig(return_logprobs=True))
    assert out["req_1"].status == cluster.RequestStatus.FAILED
    assert out["req_1"].error_code == "sampling_failed" and "boom in row req_1" in out["req_1"].error
    reference = hf_greedy(model_dir, prompts, 6)
    for i in (0, 2, 3):
        assert out[f"req_{i}"].status == cluster.RequestStatus.FINISHED
        assert out[f"req_{i}"].generated_tokens == reference[i]


def test_sampler_returns_each_rows_failure():
    import torch

    from driver.engine.request import Request, SamplingParams
    from driver.engine.sampler import Sampler

    reqs = [Request(f"r{i}", [1, 2], 4, sampling=SamplingParams(do_sample=True)) for i in range(3)]
    logits = torch.randn(3, 32)
    logits[1] = float("nan")  # NaN logits fail their row (InvalidLogits, a RuntimeError), not the batch
    draws = Sampler(seed=1)(logits, reqs)
    assert draws[1].token is None and isinstance(draws[1].error, RuntimeError)
    assert all(d.error is None and 0 <= d.token < 32 for d in (draws[0], draws[2]))
    # greedy rows (no processor: the max itself shows the NaN) and a filtered row (top-k could mask a NaN away)
    for sampling in (SamplingParams(), SamplingParams(do_sample=True, top_k=2)):
        reqs = [Request(f"g{i}", [1, 2], 4, sampling=sampling) for i in range(3)]
        logits = torch.randn(3, 32)
        logits[1, 5] = float("nan")
        draws = Sampler(seed=1)(logits, reqs)
        assert draws[1].token is None and isinstance(draws[1].error, RuntimeError), (sampling, draws[1])
        assert all(d.error is None for d in (draws[0], draws[2]))


# ---------------------------------------------------------------- outputs owed to workers on a no-forward step
@pytest.mark.slow
def test_results_owed_to_a_worker_survive_a_step_with_only_impossible_requests(tp2_records):
    driver_finals, worker_finals = (record["publish"]["finals"] for record in tp2_records)
    assert driver_finals == {"short": int(cluster.RequestStatus.FINISHED), "too_big": int(cluster.RequestStatus.FAILED)}
    assert worker_finals == driver_finals  # on base rank 1 never hears of "short"
