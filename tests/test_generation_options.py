"""transformers' generation options (min_new_tokens, min_length, no_repeat_ngram_size, bad_words_ids, sequence_bias,
forced_bos/eos_token_id, suppress_tokens, begin_suppress_tokens) per request: greedy outputs equal transformers'
`generate` with the same GenerationConfig, through the Python API at TP=1 with overlap on and off (per-request
kwargs, resumed requests, a GenerationConfig), through a TP=2 server's `sampling` map; bad values are refused
with their codes. Each option's case is made from the plain output so that the option changes it."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster.errors import Code
from cluster.protocol import ProtocolError, parse_submit
from tests.conftest import per_request_manager
from tests.serving import fast_config, serve
from tests.workloads import mixed_prompts

VOCAB = 256  # small: the random model repeats itself, so no-repeat n-grams change its output
NEW = 12
EOS = 2  # the made checkpoint's EOS


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_generate(hf, prompt: list[int], **options) -> list[int]:
    """transformers' greedy generate with these GenerationConfig options (EOS: EOS unless they set one)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0, **{"eos_token_id": EOS, **options})
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=gen,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def cases(hf) -> dict[str, tuple[list[int], dict, list[int], list[int]]]:
    """name -> (prompt, options, transformers' output with them, its output with only their eos_token_id)."""
    prompts = mixed_prompts(VOCAB)
    long, one = prompts[3], prompts[0][:1]
    b, b1 = hf_generate(hf, long), hf_generate(hf, one)
    fb = (b1[0] + 1) % VOCAB
    with_bos = hf_generate(hf, one, forced_bos_token_id=fb)
    made = {
        "min_new_tokens": (long, dict(eos_token_id=b[2], min_new_tokens=8)),
        "min_length": (long, dict(eos_token_id=[b[2], 250], min_length=len(long) + 7)),
        "no_repeat_ngram_size": (long, dict(no_repeat_ngram_size=2)),
        "bad_words_ids": (long, dict(bad_words_ids=[[b[1], b[2]], [251], [EOS]])),
        "sequence_bias": (long, dict(sequence_bias=[[[b[0], b[1]], -40.0], [[b[4]], 0.25], [[7, 8, 9], 3.0]])),
        "forced_bos_token_id": (one, dict(forced_bos_token_id=fb)),
        "forced_eos_token_id": (long, dict(forced_eos_token_id=[(b[-1] + 5) % VOCAB, (b[-1] + 1) % VOCAB])),
        "suppress_tokens": (long, dict(suppress_tokens=[b[0], b[3]])),
        "begin_suppress_tokens": (long, dict(begin_suppress_tokens=[b[0]])),
        # a one-token prompt with a forced BOS: the tokens are suppressed at the second step, not the first
        "begin_after_forced_bos": (one, dict(forced_bos_token_id=fb, begin_suppress_tokens=[with_bos[1]])),
        "all_at_once": (long, dict(no_repeat_ngram_size=3, repetition_penalty=1.3, suppress_tokens=[b[5]],
                                   sequence_bias=[[[b[0]], -1.5]], bad_words_ids=[[b[2], b[3]]],
                                   eos_token_id=b[1], min_new_tokens=4, forced_eos_token_id=EOS)),
    }
    out = {}
    for name, (prompt, options) in made.items():
        plain = {"eos_token_id": options["eos_token_id"]} if "eos_token_id" in options else {}
        if name == "begin_after_forced_bos":
            plain["forced_bos_token_id"] = fb
        ref, without = hf_generate(hf, prompt, **options), hf_generate(hf, prompt, **plain)
        assert ref != without, f"{name}: the option does not change transformers' output; the case tests nothing"
        out[name] = (prompt, options, ref, without)
    return out


def lockstep_kwargs(options: dict) -> dict:
    return {"eos_token_id": EOS, **options}


@pytest.fixture(scope="module")
def model(model_dir):
    return cluster.load(model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_each_option_matches_transformers_per_request(model, cases, overlap):
    cfg = cluster.ContinuousBatchingConfig(per_request_processors=True, page_size=16, use_async_batching=overlap)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        ids = {name: m.add_request(p, max_new_tokens=NEW, **lockstep_kwargs(o)) for name, (p, o, _, _) in cases.items()}
        plain = {name: m.add_request(p, max_new_tokens=NEW, eos_token_id=o.get("eos_token_id", EOS))
                 for name, (p, o, _, _) in cases.items() if name != "begin_after_forced_bos"}
        resumed = {name: m.add_request(p, max_new_tokens=NEW, resume_tokens=ref[:3], **lockstep_kwargs(o))
                   for name, (p, o, ref, _) in cases.items() if len(ref) > 4}
        got = {rid: m.get_result(rid, timeout=120) for rid in [*ids.values(), *plain.values(), *resumed.values()]}
    for name, (_, _, ref, without) in cases.items():
        assert got[ids[name]].generated_tokens == ref, name
        if name in plain:
            assert got[plain[name]].generated_tokens == without, name
        if name in resumed:
            assert got[resumed[name]].generated_tokens == ref, f"{name} (resumed after 3 tokens)"
    assert len(resumed) >= 8


def test_options_from_a_generation_config(model, hf, cases):
    """A GenerationConfig's options apply to every request (no per_request_processors needed), with no warning
    that they are dropped."""
    import warnings

    from transformers import GenerationConfig

    prompts = [cases["no_repeat_ngram_size"][0], cases["forced_bos_token_id"][0]]
    options = dict(no_repeat_ngram_size=2, suppress_tokens=[cases["suppress_tokens"][2][0]], min_length=6,
                   bad_words_ids=[[11, 12]])
    gen = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=EOS, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = model.generate_batch(prompts, generation_config=gen)
    for i, p in enumerate(prompts):
        assert out[f"req_{i}"].generated_tokens == hf_generate(hf, p, **options)


# ---------------------------------------------------------------- TP=2, the options in the wire's `sampling` map
@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, tp=2, config=fast_config(), forked=True) as s:
        yield s


@pytest.mark.slow
def test_options_over_the_wire_at_tp2(server, cases):
    names = ["min_new_tokens", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "forced_eos_token_id",
             "begin_after_forced_bos", "all_at_once"]
    with cluster.Client(server.address) as c:
        rids = {n: c.submit(cases[n][0], max_new_tokens=NEW, **lockstep_kwargs(cases[n][1])) for n in names}
        for n in names:
            assert c.result(rids[n], timeout=120).generated_tokens == cases[n][2], n
        with pytest.raises(cluster.ClientError) as e:
            c.generate([5, 6, 7], max_new_tokens=2, bad_words_ids=[[VOCAB]])
        assert e.value.code == Code.BAD_FIELD


# ---------------------------------------------------------------- bad values: typed rejections
BAD = [("min_new_tokens", -1), ("min_new_tokens", 1.5), ("min_length", True), ("no_repeat_ngram_size", 65),
       ("bad_words_ids", [[]]), ("bad_words_ids", [[VOCAB]]), ("bad_words_ids", [[1]] * 1025),
       ("bad_words_ids", [list(range(33))]), ("bad_words_ids", [5]), ("sequence_bias", [[[3], float("nan")]]),
       ("sequence_bias", [[[3], float("inf")]]), ("sequence_bias", [[[3]]]), ("sequence_bias", [[[], 1.0]]),
       ("forced_bos_token_id", VOCAB), ("forced_bos_token_id", -1), ("forced_eos_token_id", []),
       ("forced_eos_token_id", [4, VOCAB]), ("suppress_tokens", [-3]), ("suppress_tokens", list(range(1025))),
       ("begin_suppress_tokens", "7")]


@pytest.fixture(scope="module")
def manager(model):
    m = per_request_manager(model)
    yield m
    m.destroy()


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_option_values_are_bad_field(manager, name, value):
    with pytest.raises(ValueError) as e:
        manager.build_request([5, 6, 7], max_new_tokens=2, **{name: value})
    assert getattr(e.value, "code", None) == Code.BAD_FIELD
    assert f"{name}=" in str(e.value) and " must be " in str(e.value), str(e.value)


def test_forced_tokens_all_suppressed_are_refused(manager):
    with pytest.raises(ValueError) as e:
        manager.build_request([5, 6, 7], max_new_tokens=2, forced_eos_token_id=[4, 5], suppress_tokens=[5, 4, 9])
    assert e.value.code == Code.BAD_FIELD and "forced_eos_token_id" in str(e.value)
    req = manager.build_request([5, 6, 7], max_new_tokens=2, forced_eos_token_id=[4, 5], suppress_tokens=[5],
                                sequence_bias={(3, 4): -1.0, (3, 4, 5): 2})
    assert req.sampling.forced_eos_token_id == (4, 5) and req.sampling.sequence_bias == (((3, 4), -1.0),
                                                                                        ((3, 4, 5), 2.0))


@pytest.mark.slow
def test_wire_types_and_the_unsupported_code(model):
    ok = parse_submit({"input_ids": [1], "sampling": {"bad_words_ids": [[1, 2]], "forced_eos_token_id": [2],
                                                      "sequence_bias": [[[3], -1.0]], "min_new_tokens": 3}})
    assert ok.sampling["bad_words_ids"] == [[1, 2]]
    for name, value in [("min_new_tokens", "3"), ("bad_words_ids", 4), ("forced_eos_token_id", 1.0)]:
        with pytest.raises(ProtocolError) as e:
            parse_submit({"input_ids": [1], "sampling": {name: value}})
        assert e.value.code == Code.BAD_FIELD
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    try:
        with pytest.raises(ValueError) as e:
            m.build_request([5, 6, 7], max_new_tokens=2, strict_processors=True, no_repeat_ngram_size=2)
        assert e.value.code == Code.UNSUPPORTED
    finally:
        m.destroy()
