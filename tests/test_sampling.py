"""Seeded sampling is reproducible run after run; logprobs and the sampling knobs do what they say."""

from __future__ import annotations

import math
import subprocess
import sys

from transformers import GenerationConfig

import cluster
from tests.conftest import REPO
from tests.workloads import mixed_prompts

SAMPLED = GenerationConfig(do_sample=True, temperature=0.8, top_k=50, top_p=0.95, max_new_tokens=16,
                           eos_token_id=None)


def sample_once(model, seed, **cfg):
    prompts = mixed_prompts(model.config.vocab_size)[:8]
    out = model.generate_batch(prompts, generation_config=SAMPLED,
                               continuous_batching_config=cluster.ContinuousBatchingConfig(seed=seed, **cfg))
    return [o.generated_tokens for o in out.values()], out


def test_seeded_sampling_repeats(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    a, _ = sample_once(model, 1234)
    b, _ = sample_once(model, 1234, max_batch_tokens=64)  # a different batching gives the same tokens
    c, _ = sample_once(model, 99)
    assert a == b
    assert a != c
    assert all(len(t) == 16 for t in a)


def test_seeded_sampling_repeats_across_processes(make_checkpoint):
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import cluster; "
            "from tests.test_sampling import sample_once; "
            f"m = cluster.load({str(make_checkpoint('llama'))!r}); print(sample_once(m, 7)[0])")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
            for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr[-2000:]
    assert runs[0].stdout.strip().splitlines()[-1] == runs[1].stdout.strip().splitlines()[-1]


def test_logprobs_are_returned_and_consistent(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    prompts = mixed_prompts(model.config.vocab_size)[:4]
    out = model.generate_batch(prompts, max_new_tokens=8,
                               continuous_batching_config=cluster.ContinuousBatchingConfig(return_logprobs=True))
    for o in out.values():
        assert len(o.logprobs) == len(o.generated_tokens) == 8
        # greedy picks the most likely token: its probability is at least 1/vocab
        assert all(math.log(1 / model.config.vocab_size) <= lp <= 0 for lp in o.logprobs)
