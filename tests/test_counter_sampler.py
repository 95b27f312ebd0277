"""Counter-based sampling: a seeded request's token depends only on (its seed, token index, logits); a request
without its own seed is keyed by the engine's seed and its request id.

The same tokens alone or in a batch of requests with other parameters, at TP=1 and TP=2, and after a restart
that gives the earlier tokens back as prompt; everything the sampler makes lives on the logits' device; the
sampled tokens follow softmax(logits / temperature), and top-k / top-p never let a masked token through.
"""

from __future__ import annotations

import time

import pytest
import torch

from driver.engine.request import Request, SamplingParams
from driver.engine.sampler import Sampler
from tests.conftest import read_json, run_ranks

FULL = SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=3)
OTHERS = [SamplingParams(), SamplingParams(repetition_penalty=1.5), SamplingParams(do_sample=True, seed=9),
          SamplingParams(do_sample=True, temperature=1.7, top_k=2), SamplingParams(do_sample=True, top_p=0.3),
          SamplingParams(do_sample=True, temperature=0.5, top_k=0, top_p=0.99, repetition_penalty=0.8),
          SamplingParams(do_sample=True, top_k=1)]


def request(rid: str, params: SamplingParams, prompt: list[int] | None = None, logprobs: bool = True) -> Request:
    return Request(rid, prompt or [1, 2, 3, 4, 5, 2], 64, sampling=params, return_logprobs=logprobs)


def step_logits(step: int, rows: int, vocab: int = 97) -> torch.Tensor:
    """The same logits for every row at a step (a fixed function of the step)."""
    return (torch.randn(vocab, generator=torch.Generator().manual_seed(step)) * 3).expand(rows, vocab).clone()


def outcomes(sampler: Sampler, logits: torch.Tensor, reqs: list[Request]) -> list[tuple]:
    """(token, logprob, error) per row; an older sampler that returned (tokens, logprobs) reads the same."""
    got = sampler(logits, reqs)
    if isinstance(got, tuple) and len(got) == 2 and len(got[0]) == len(reqs):
        return [(tok, lp, None) for tok, lp in zip(*got)]
    return [(d.token, d.logprob, d.error) for d in got]


def run(sampler: Sampler, reqs: list[Request], steps: int, first_step: int = 0) -> None:
    for step in range(first_step, first_step + steps):
        for req, (token, logprob, error) in zip(reqs, outcomes(sampler, step_logits(step, len(reqs)), reqs)):
            assert error is None, error
            req.generated.append(token)
            req.logprobs.append(logprob)


# ---------------------------------------------------------------- (a) batch composition
def test_a_request_samples_the_same_alone_and_among_seven_others():
    alone = request("target", FULL)
    run(Sampler(seed=None), [alone], 12)
    crowd = [request(f"other_{i}", p) for i, p in enumerate(OTHERS)]
    target = request("target", FULL)
    run(Sampler(seed=None), crowd[:3] + [target] + crowd[3:], 12)
    assert target.generated == alone.generated
    assert target.logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    assert len(set(alone.generated)) > 1  # it did sample


def test_the_config_seed_keys_requests_without_their_own():
    def tokens(seed, rid="r"):
        req = request(rid, SamplingParams(do_sample=True, temperature=2.0))
        run(Sampler(seed=seed), [req], 10)
        return req.generated

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(6)
    assert tokens(5, "r") != tokens(5, "s")  # the request id keys the noise too
    assert tokens(None) != tokens(None)  # no seed anywhere: a random key per request


def test_a_requests_own_seed_alone_keys_its_noise():
    """As a seed does in OpenAI's API and vLLM: the same seed samples the same tokens, whatever the request id
    (and the engine's seed); another seed samples others."""
    def tokens(own_seed, rid, config_seed=None):
        req = request(rid, SamplingParams(do_sample=True, temperature=2.0, seed=own_seed))
        run(Sampler(seed=config_seed), [req], 10)
        return req.generated

    assert tokens(7, "a") == tokens(7, "b") == tokens(7, "c", config_seed=3)
    assert tokens(7, "a") != tokens(8, "a")


def test_top_k_zero_and_minus_one_both_mean_off():
    def tokens(top_k):
        req = request("k", SamplingParams(do_sample=True, temperature=1.5, top_k=top_k, seed=8))
        run(Sampler(seed=None), [req], 10)
        return req.generated

    assert tokens(-1) == tokens(0) == tokens(97)  # 97: the whole vocabulary
    assert tokens(-1) != tokens(2)


# ---------------------------------------------------------------- (c) restart invariance
@pytest.mark.parametrize("params", [FULL, SamplingParams(do_sample=True, seed=4)], ids=["all-processors", "plain"])
def test_a_restarted_request_samples_what_the_uninterrupted_one_did(params):
    whole = request("r7", params)
    run(Sampler(seed=1), [whole], 8)
    for k in range(8):
        again = request("r7", params, prompt=whole.prompt_ids + whole.generated[:k])
        again.resumed_tokens = k  # its last k prompt tokens were generated before the restart
        run(Sampler(seed=1), [again], 1, first_step=k)  # a fresh sampler, as in a restarted process
        assert again.generated == [whole.generated[k]], k


# ---------------------------------------------------------------- (d) device and dtype
def test_the_sampler_makes_nothing_off_the_logits_device():
    """Everything the sampler creates follows the logits: with factory functions defaulting to the meta device, a
    tensor made without device= would be on meta and every CPU row would fail."""
    logits = step_logits(0, 1 + len(OTHERS), vocab=300)

    def draws():
        reqs = [request("target", FULL)] + [request(f"o{i}", p) for i, p in enumerate(OTHERS)]
        return outcomes(Sampler(seed=2), logits, reqs)

    want = draws()
    with torch.device("meta"):
        got = draws()
    assert [error for _, _, error in got] == [None] * len(got)
    assert got == want


def test_picks_are_on_the_logits_device_as_int64_and_float32():
    from driver.engine.logits_processing import SampleRow
    from driver.engine.sampler import pick

    rows = [SampleRow("a", FULL, key=2 ** 64 - 1, index=3, seen=(1, 2), logprobs=True),
            SampleRow("b", SamplingParams(do_sample=True, top_p=0.5), key=7, index=0),
            SampleRow("c", SamplingParams(), key=0, index=1)]
    picks = pick(torch.empty(3, 300, dtype=torch.bfloat16, device="meta"), rows)
    assert [t.device.type for t in picks[:3]] == ["meta"] * 3 and picks.top is None
    assert (picks.tokens.dtype, picks.logprobs.dtype, picks.invalid.dtype) == (torch.int64, torch.float32, torch.bool)
    assert picks.tokens.shape == picks.logprobs.shape == (3,)


# ---------------------------------------------------------------- the noise itself
def test_the_noise_hash_is_exact_integer_arithmetic():
    """cn.noise_bits equals the hash on Python integers (no int64 overflow, nothing device-dependent)."""
    from driver.engine import counter_noise as cn

    def mix(x):
        x ^= x >> cn.S1
        x = (x * cn.C1) & cn.M32
        x ^= x >> cn.S2
        x = (x * cn.C2) & cn.M32
        return x ^ (x >> cn.S3)

    def absorb(state, word):
        return mix(((state ^ word) + cn.GOLDEN) & cn.M32)

    keys = [0, 1, 2 ** 32 - 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 0xDEADBEEFCAFEBABE]
    index = [0, 1, 2 ** 31, 2 ** 32 - 1, 17, 5, 123456]
    bits = cn.noise_bits(torch.tensor([cn.signed64(k) for k in keys]), torch.tensor(index), 300)
    for i, (k, n) in enumerate(zip(keys, index)):
        state = absorb(absorb(absorb(cn.ROW_SALT, k >> 32), k & cn.M32), n)
        assert bits[i].tolist() == [absorb(state, absorb(cn.VOCAB_SALT, v)) for v in range(300)]


def test_uniforms_never_reach_zero_or_one():
    from driver.engine.counter_noise import M32, uniform

    u = uniform(torch.tensor([0, 1, 511, 512, M32 - 1, M32]))
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


# ---------------------------------------------------------------- (e) the distribution
def sample_many(logits: torch.Tensor, params: SamplingParams, n: int = 20000) -> torch.Tensor:
    """Token counts over n token indices of one request (fixed key), the same logits at every index."""
    from driver.engine.counter_noise import request_key
    from driver.engine.logits_processing import SampleRow
    from driver.engine.sampler import pick

    key = request_key(12345, None, "stats")
    rows = [SampleRow("stats", params, key, index) for index in range(n)]
    tokens = pick(logits.expand(n, -1), rows).tokens
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.2, -2.0])


def test_sampled_tokens_follow_softmax_of_logits_over_temperature():
    for temperature in (0.7, 1.0, 1.6):
        counts = sample_many(LOGITS, SamplingParams(do_sample=True, temperature=temperature))
        # 99.9% quantile of chi-square with 9 degrees of freedom: 27.88
        assert chi_square(counts, (LOGITS / temperature).softmax(-1)) < 27.88, (temperature, counts)


def test_top_k_and_top_p_never_return_masked_tokens():
    probs = LOGITS.softmax(-1)
    top3 = probs.topk(3).indices
    counts = sample_many(LOGITS, SamplingParams(do_sample=True, top_k=3))
    assert set(counts.nonzero()[:, 0].tolist()) == set(top3.tolist())
    kept = torch.zeros_like(probs).index_fill(0, top3, 1.0) * probs
    assert chi_square(counts, kept / kept.sum()) < 13.82  # 2 degrees of freedom, 99.9%

    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = order[mass_before <= 0.6]  # top-p keeps a token while the mass before it is at most top_p
    counts = sample_many(LOGITS, SamplingParams(do_sample=True, top_p=0.6))
    assert set(counts.nonzero()[:, 0].tolist()) == set(nucleus.tolist())


def test_top_p_on_a_few_candidates_drops_what_the_full_sort_drops():
    """On the CPU top-p ranks only the most probable tokens where they suffice: the same drops as ranking all."""
    from driver.engine.logits_processing import ranked_drops

    base = torch.randn(8, 32000, generator=torch.Generator().manual_seed(1))
    probs = (base * torch.tensor([0.3, 1.0, 3.0, 4.0, 6.0, 10.0, 3.0, 1.0])[:, None]).softmax(-1)  # flat to peaked
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.95, 0.99, 0.8, 1.0, 0.2])[:, None]
    got = ranked_drops(probs, top_p, 32000)
    assert torch.equal(got, ranked_drops(probs, top_p, 32000, tries=()))
    assert not got[6].any()  # top_p = 1 drops nothing
    kept = (~got).sum(-1)
    assert kept.min() < 256 < kept.max()  # some rows fit the first candidates, some need more


def test_greedy_rows_take_the_argmax_of_their_penalised_logits():
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(0))
    reqs = [request(f"g{i}", SamplingParams(repetition_penalty=p), prompt=list(range(i * 7, i * 7 + 40)))
            for i, p in enumerate([1.0, 1.3, 0.7, 2.0])]
    for row, req, (token, logprob, _) in zip(logits, reqs, outcomes(Sampler(seed=None), logits, reqs)):
        seen = torch.tensor(sorted(set(req.tokens)))
        want = row.clone()
        p = req.sampling.repetition_penalty
        want[seen] = torch.where(row[seen] < 0, row[seen] * p, row[seen] / p)
        assert token == int(want.argmax())
        assert logprob == pytest.approx(float(want.log_softmax(-1)[token]), abs=1e-5)


# ---------------------------------------------------------------- (b) TP=1 and TP=2, through the serving path
@pytest.fixture(scope="module")
def tp1_tokens(make_checkpoint):
    import cluster
    from tests.scripts.sampling_rank import MIXED, mixed_requests

    model = cluster.load(make_checkpoint("llama"))
    return {"all": mixed_requests(model, list(MIXED)), "alone": mixed_requests(model, ["target"])}


def test_served_seeded_tokens_do_not_depend_on_the_batch(tp1_tokens):
    assert tp1_tokens["alone"]["target"] == tp1_tokens["all"]["target"]
    assert len(set(tp1_tokens["all"]["target"])) > 1


@pytest.mark.slow
def test_seeded_tokens_are_the_same_at_tp1_and_tp2(make_checkpoint, tmp_path, tp1_tokens):
    proc = run_ranks("sampling_rank.py", ["mixed", str(make_checkpoint("llama")), str(tmp_path / "rec")], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    tp2 = read_json(f"{tmp_path / 'rec'}.rank0")["mixed"]["tokens"]
    assert tp2 == tp1_tokens["all"]


# ---------------------------------------------------------------- speed, printed (nothing asserted about time)
def todays_row_loop(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """The sampler this one replaced, for the timing line: per row, process the logits and draw with the
    request's own CPU torch.Generator."""
    out = []
    for row, req in zip(logits, reqs):
        p = req.sampling
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.tokens)))
            row = row.clone()
            row[seen] = torch.where(row[seen] < 0, row[seen] * p.repetition_penalty, row[seen] / p.repetition_penalty)
        if p.do_sample:
            row = row / p.temperature
            if 0 < p.top_k < row.shape[-1]:
                row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
            if p.top_p < 1.0:
                values, order = torch.sort(row, descending=True)
                probs = values.softmax(-1)
                drop = probs.cumsum(-1) - probs > p.top_p
                row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
            gen = torch.Generator().manual_seed(len(out))
            tok = int(torch.multinomial(row.softmax(-1), 1, generator=gen))
        else:
            tok = int(row.argmax())
        float(row.log_softmax(-1)[tok])
        out.append(tok)
    return out


@pytest.mark.slow
def test_batched_sampler_timing_against_todays_row_loop(capsys):
    logits = torch.randn(64, 32000, generator=torch.Generator().manual_seed(0)) * 3
    lines = []
    for name, params in [("greedy", SamplingParams()), ("temperature", SamplingParams(do_sample=True, temperature=0.8)),
                         ("top-k+top-p+penalty", SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.95,
                                                                repetition_penalty=1.1)),
                         ("top-p", SamplingParams(do_sample=True, temperature=0.8, top_p=0.95))]:
        reqs = [request(f"r{i}", params, prompt=list(range(i, i + 200))) for i in range(64)]
        timings = {}
        for label, fn in (("batched", lambda reqs=reqs: Sampler(seed=1)(logits, reqs)),
                          ("row_loop", lambda reqs=reqs: todays_row_loop(logits, reqs))):
            fn()
            start = time.perf_counter()
            for _ in range(2):
                fn()
            timings[label] = (time.perf_counter() - start) / 2 * 1000
        lines.append(f"sampler 64x32000 {name}: batched={timings['batched']:.1f}ms "
                     f"row_loop={timings['row_loop']:.1f}ms")
        if not params.do_sample:  # greedy: the very tokens of today's loop
            assert [t for t, _, _ in outcomes(Sampler(seed=1), logits, reqs)] == todays_row_loop(logits, reqs)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
