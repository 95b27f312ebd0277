"""Speculative sampling draws from the target's distribution (docs/speculative.md, "Exactness"), measured on a model
whose distribution can be enumerated: a small llama of vocabulary 8, initialised wide (its next-token distributions
far from uniform and differing by context), one prompt, NEW = 4 tokens sampled at temperature 1, EOS off. The exact law
of the 4 tokens (8^4 sequences) comes from transformers' forward in float32. Each mode (plain, n-gram, a draft model
of another seed whose greedy proposals are often rejected) samples N requests in one generate_batch, each keyed by
its own (config seed, request id), the modes by disjoint config seeds: the three samples are independent. A row
proposes 2 tokens at its second (the room left before the bonus), so acceptance is exercised at two draft positions.

Pearson's chi-square of each position's marginal (4 tables) and each adjacent pair's joint (3), cells of expected
count under 5 pooled: every mode against the exact law (21 tests) and each speculative mode against plain's sample
(two-sample, 14 tests). Each test fails at p < ALPHA = 1e-7, so a correct engine fails this module with probability
at most 35 x 1e-7 = 3.5e-6 (Bonferroni). And seeded reproducibility: a subset rerun with the same seeds, speculating
or not, writes the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from transformers import GenerationConfig

import cluster
from tests.test_speculative import config, draft
from tests.workloads import SPECULATIVE

VOCAB, NEW, N, ALPHA = 8, 4, 1500, 1e-7
# a small llama (two layers of width 64: 1500 requests in about a second), its weights drawn wide (std 0.3)
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "initializer_range": 0.3}
PROMPT = [3, 5, 0, 6, 2, 4, 7, 1, 3, 5]  # every token: the n-gram proposer finds a match for every first token
SEEDS = {"plain": 101, "ngram": 202, "draft": 303}  # the engine's seed a mode: disjoint request keys
RERUN = 200  # requests of the reproducibility rerun


@pytest.fixture(scope="module")
def dirs(make_checkpoint):
    """The target and the draft: the same vocabulary and shape, other weights."""
    return make_checkpoint("llama", **SHAPE), make_checkpoint("llama", seed=1, **SHAPE)


@pytest.fixture(scope="module")
def model(dirs):
    return cluster.load(dirs[0])


def speculative(mode: str, draft_dir) -> dict | None:
    return {"plain": None, "ngram": SPECULATIVE, "draft": draft(draft_dir)}[mode]


def sample(model, spec: dict | None, seed: int, n: int) -> tuple[np.ndarray, dict]:
    """[n, NEW] tokens of n requests of PROMPT (one generate_batch; the engine's `seed` and each request's id key its
    noise), and the batch's stats."""
    gen = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=NEW, eos_token_id=None)
    out = model.generate_batch([PROMPT] * n, generation_config=gen,
                               continuous_batching_config=config(spec, seed=seed))
    tokens = np.array([o.generated_tokens for o in out.values()])
    assert tokens.shape == (n, NEW)  # no request stopped early
    return tokens, dict(model.last_stats)


@pytest.fixture(scope="module")
def samples(model, dirs) -> dict[str, tuple[np.ndarray, dict]]:
    return {mode: sample(model, speculative(mode, dirs[1]), seed, N) for mode, seed in SEEDS.items()}


@pytest.fixture(scope="module")
def law(dirs) -> np.ndarray:
    """The exact probability of every NEW tokens after PROMPT, [VOCAB] * NEW: one transformers forward of every
    PROMPT + t1..t(NEW-1), each position's softmax, chained."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32).eval()
    heads = torch.cartesian_prod(*[torch.arange(VOCAB)] * (NEW - 1))  # every t1..t(NEW-1), in C order
    ids = torch.cat([torch.tensor(PROMPT).expand(len(heads), -1), heads], 1)
    with torch.no_grad():
        logp = hf(ids).logits[:, len(PROMPT) - 1:].double().log_softmax(-1)  # [sequences, NEW, VOCAB]
    head = logp[:, :-1].gather(2, heads[:, :, None]).sum((1, 2))  # log p(t1..t(NEW-1))
    joint = (head[:, None] + logp[:, -1]).exp().reshape((VOCAB,) * NEW).numpy()
    assert joint.sum() == pytest.approx(1.0, abs=1e-9)
    return joint


def tables(joint: np.ndarray) -> dict[str, np.ndarray]:
    """A joint table over the NEW positions (probabilities or counts) -> each position's marginal and each adjacent
    pair's joint, flat."""
    def keep(*axes: int) -> np.ndarray:
        return joint.sum(tuple(a for a in range(NEW) if a not in axes)).ravel()

    return {**{f"t{i + 1}": keep(i) for i in range(NEW)},
            **{f"t{i + 1}t{i + 2}": keep(i, i + 1) for i in range(NEW - 1)}}


def counts(tokens: np.ndarray) -> np.ndarray:
    """The sampled sequences' counts, [VOCAB] * NEW."""
    flat = np.ravel_multi_index(tuple(tokens.T), (VOCAB,) * NEW)
    return np.bincount(flat, minlength=VOCAB ** NEW).reshape((VOCAB,) * NEW)


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square p-value of counts [rows, cells] against expected counts of the same shape: the cells of
    expected count under 5 in some row are pooled into one, with the next smallest while it holds under 5; cells - 1
    degrees of freedom (one row: goodness of fit; two: homogeneity, (2 - 1)(cells - 1))."""
    order = np.argsort(expected.min(0))
    small = int((expected.min(0) < 5).sum())
    last = max(small - 1, int(np.argmax(np.cumsum(expected[:, order], 1).min(0) >= 5)))  # cells order[:last + 1]

    def pool(x: np.ndarray) -> np.ndarray:
        x = x[:, order].astype(np.float64)
        return np.concatenate([x[:, :last + 1].sum(1, keepdims=True), x[:, last + 1:]], 1)

    o, e = pool(observed), pool(expected)
    return float(chi2.sf(((o - e) ** 2 / e).sum(), o.shape[1] - 1))


def against_law(tokens: np.ndarray, joint: np.ndarray) -> dict[str, float]:
    got, want = tables(counts(tokens)), tables(joint)
    return {k: chi_square_p(got[k][None], len(tokens) * want[k][None]) for k in got}


def homogeneity_p(a: np.ndarray, b: np.ndarray) -> float:
    """Whether two samples' counts over the same cells come from one law (the two-sample chi-square)."""
    o = np.stack([a, b]).astype(np.float64)
    return chi_square_p(o, o.sum(1, keepdims=True) * o.sum(0, keepdims=True) / o.sum())


def two_sample(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    ta, tb = tables(counts(a)), tables(counts(b))
    return {k: homogeneity_p(ta[k], tb[k]) for k in ta}


def test_the_chi_square_has_power():
    """The statistic itself: a sample of the law passes, against the law and against another sample of it; one
    drawn from a law 0.15 away in total variation fails both ways."""
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    q = p + np.array([-0.15, 0.15, 0, 0, 0, 0, 0, 0])
    same, again, other = rng.multinomial(N, p), rng.multinomial(N, p), rng.multinomial(N, q)
    assert chi_square_p(same[None], N * p[None]) > 1e-3 and homogeneity_p(same, again) > 1e-3
    assert chi_square_p(other[None], N * p[None]) < ALPHA and homogeneity_p(same, other) < ALPHA


def test_the_law_depends_on_the_context(law):
    """The premise of the pair tests: t2's distribution after one t1 is far from that after another, and far from
    uniform."""
    first = law.sum((2, 3))  # [t1, t2]
    cond = first / first.sum(1, keepdims=True)
    tv = 0.5 * np.abs(cond[:, None] - cond[None]).sum(-1)
    assert tv.max() > 0.3 and 0.5 * np.abs(cond - 1 / VOCAB).sum(-1).min() > 0.1


@pytest.mark.parametrize("mode", list(SEEDS))
def test_samples_follow_the_targets_law(samples, law, mode):
    tokens, stats = samples[mode]
    p = against_law(tokens, law)
    assert min(p.values()) >= ALPHA, (mode, p)
    if mode == "plain":
        assert "spec_drafts" not in stats
        return
    # proposals are verified, and some are rejected: the acceptance rule is exercised both ways
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert stats["spec_method"] == mode
    p = two_sample(tokens, samples["plain"][0])
    assert min(p.values()) >= ALPHA, (mode, "against plain", p)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_seeded_requests_repeat_their_tokens(model, dirs, samples, mode):
    """A rerun of the first RERUN requests with the same seed (a smaller batch): the same tokens, speculating or not
    (the verifier draws what plain decoding draws at each token index)."""
    want = samples[mode][0][:RERUN]
    again, stats = sample(model, speculative(mode, dirs[1]), SEEDS[mode], RERUN)
    assert stats["spec_accepted_tokens"] > 0
    assert (again == want).all(), np.flatnonzero((again != want).any(1))
    plain, _ = sample(model, None, SEEDS[mode], RERUN)
    assert (plain == want).all(), np.flatnonzero((plain != want).any(1))
