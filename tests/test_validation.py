"""Bad input to generate_batch raises ValueError naming the request and the problem, before any step runs."""

from __future__ import annotations

import pytest

import cluster
from tests.conftest import per_request_manager
from worker.runner import ModelRunner


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return cluster.load(make_checkpoint("llama"))


@pytest.mark.parametrize("inputs,kwargs,message", [
    ([[5, 6], []], {}, r"inputs\[1\]: the prompt is empty"),
    ([[5, 6], [7, 4096]], {}, r"inputs\[1\]: token id 4096 at position 1 is outside the vocabulary"),
    ([[5, -1]], {}, r"inputs\[0\]: token id -1"),
    ([[5, 6]], {"max_new_tokens": -3}, r"max_new_tokens=-3"),
    ([[5] * 1024], {}, r"inputs\[0\]: the prompt has 1024 tokens; the model's context is 1024"),
    ([["a", 5]], {}, r"inputs\[0\]: token 0 is 'a'"),
])
def test_bad_input_raises_before_any_step(model, monkeypatch, inputs, kwargs, message):
    calls = []
    monkeypatch.setattr(ModelRunner, "execute", lambda self, plan: calls.append(plan))
    with pytest.raises(ValueError, match=message):
        model.generate_batch(inputs, **kwargs)
    assert calls == []


def test_good_input_after_bad_input_still_works(model):
    with pytest.raises(ValueError):
        model.generate_batch([[]])
    out = model.generate_batch([[5, 6, 7]], max_new_tokens=3)
    assert len(out["req_0"].generated_tokens) == 3


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="page_size"):
        cluster.ContinuousBatchingConfig(page_size=0)
    with pytest.raises(ValueError, match="scheduler_type"):
        cluster.ContinuousBatchingConfig(scheduler_type="lifo")


def test_unsupported_architecture_is_refused(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 10}))
    with pytest.raises(cluster.ModelRefused, match="model_type 't5': an encoder-decoder model"):
        cluster.load(tmp_path)


# ---------------------------------------------------------------- sampling values, caps and the cache (manager API)
@pytest.fixture(scope="module")
def manager(model):
    m = per_request_manager(model)
    yield m
    m.destroy()


def rejected(manager, monkeypatch, *args, **kwargs):
    """The error add_request raises, checking that nothing ran and nothing was queued."""
    calls = []
    monkeypatch.setattr(ModelRunner, "execute", lambda self, plan: calls.append(plan))
    with pytest.raises(ValueError) as e:
        manager.add_request(*args, **kwargs)
    assert calls == [] and manager.inbox.empty() and not manager.requests
    return e.value


HOSTILE = [("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_p", 0), ("top_p", 1.5), ("top_p", float("nan")),
           ("temperature", float("nan")), ("temperature", -1.0), ("temperature", float("inf")),
           ("temperature", 0.0), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
           ("repetition_penalty", float("nan")), ("repetition_penalty", float("inf")), ("seed", 2 ** 70),
           ("seed", -2 ** 63 - 1), ("seed", 1.0), ("do_sample", 1)]


@pytest.mark.parametrize("name,value", HOSTILE, ids=[f"{n}={v!r}" for n, v in HOSTILE])
def test_sampling_values_out_of_range_are_bad_field(manager, monkeypatch, name, value):
    e = rejected(manager, monkeypatch, [5, 6, 7], max_new_tokens=2, **{"do_sample": True, name: value})
    assert getattr(e, "code", None) == "bad_field"
    assert f"{name}=" in str(e) and " must be " in str(e), str(e)  # names the parameter and its range


@pytest.mark.parametrize("kwargs", [dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_p=1), dict(top_p=1e-6),
                                    dict(temperature=0.0, do_sample=False), dict(temperature=3),
                                    dict(repetition_penalty=1e-3), dict(seed=2 ** 63 - 1), dict(seed=-2 ** 63)])
def test_sampling_values_in_range_are_accepted(manager, kwargs):
    req = manager.build_request([5, 6, 7], max_new_tokens=2, **kwargs)
    assert req.sampling.top_k == (0 if kwargs.get("top_k") == -1 else kwargs.get("top_k", 0))


@pytest.mark.parametrize("gen_kwargs,name", [(dict(do_sample=True, top_k=-2), "top_k"),
                                             (dict(do_sample=True, top_p=0.0), "top_p"),
                                             (dict(do_sample=True, temperature=float("nan")), "temperature"),
                                             (dict(do_sample=True, temperature=0.0), "temperature"),
                                             (dict(repetition_penalty=-1.0), "repetition_penalty")])
def test_generation_config_values_are_checked_before_anything_runs(model, monkeypatch, gen_kwargs, name):
    from transformers import GenerationConfig

    calls = []
    monkeypatch.setattr(ModelRunner, "execute", lambda self, plan: calls.append(plan))
    with pytest.raises(ValueError, match=name):
        model.generate_batch([[5, 6, 7]], generation_config=GenerationConfig(max_new_tokens=2, **gen_kwargs))
    assert calls == []


def test_top_k_minus_one_means_no_top_k(model):
    from transformers import GenerationConfig

    def sample(top_k):
        gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=top_k, max_new_tokens=8, eos_token_id=None)
        out = model.generate_batch([[5, 6, 7], [9, 10]], generation_config=gen,
                                   continuous_batching_config=cluster.ContinuousBatchingConfig(seed=3))
        return [o.generated_tokens for o in out.values()]

    assert sample(-1) == sample(0)
    assert all(len(t) == 8 for t in sample(-1))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(eos_token_id=list(range(65))), "eos_token_id"),
    (dict(eos_token_id=[1, 2048]), "eos_token_id"),
    (dict(eos_token_id=-2), "eos_token_id"),
    (dict(eos_token_id=[1, "a"]), "eos_token_id"),
    (dict(request_id="x" * 257), "request_id"),
    (dict(priority=1 << 31), "priority"),
    (dict(priority=-(1 << 31) - 1), "priority"),
    (dict(priority=1.0), "priority"),
    (dict(priority=True), "priority"),
])
def test_caps_on_eos_lists_and_request_ids(manager, monkeypatch, kwargs, needle):
    e = rejected(manager, monkeypatch, [5, 6, 7], max_new_tokens=2, **kwargs)
    assert getattr(e, "code", None) == "bad_field" and needle in str(e)
    assert "x" * 257 not in str(e)


def test_caps_at_their_limits_are_accepted(manager):
    req = manager.build_request([5, 6, 7], request_id="r" * 256, max_new_tokens=2, eos_token_id=list(range(64)))
    assert req.request_id == "r" * 256 and len(req.eos_token_ids) == 64
    # -1 is transformers' "no EOS" placeholder (the serving benchmark sends it): accepted, and it matches nothing
    assert manager.build_request([5, 6, 7], max_new_tokens=2, eos_token_id=-1).eos_token_ids == frozenset()
    assert manager.build_request([5], max_new_tokens=2, eos_token_id=[-1, 2047]).eos_token_ids == {2047}
    for p in (-(1 << 31), 0, (1 << 31) - 1):  # priority: a 32-bit integer, lower first
        assert manager.build_request([5, 6, 7], max_new_tokens=2, priority=p).priority == p
    assert manager.build_request([5, 6, 7], max_new_tokens=2).priority == 0


def test_request_that_can_never_fit_the_cache_is_refused_at_add_time(manager, monkeypatch):
    # 4 pages of 16: 60 prompt tokens + 6 new ones need the K/V of 65 tokens -> 5 pages
    e = rejected(manager, monkeypatch, list(range(3, 63)), max_new_tokens=6)
    assert getattr(e, "code", None) == "exceeds_kv_cache"
    assert "4" in str(e) and "5" in str(e)


def test_request_that_just_fits_the_cache_runs_to_the_end(model, make_checkpoint):
    from tests.conftest import hf_greedy

    prompt = list(range(3, 63))  # 60 + 5 new tokens: the K/V of 64 tokens, exactly 4 pages
    out = model.generate_batch([prompt], max_new_tokens=5, continuous_batching_config=cluster.ContinuousBatchingConfig(
        page_size=16, num_blocks=4))
    assert out["req_0"].status == cluster.RequestStatus.FINISHED
    assert out["req_0"].generated_tokens == hf_greedy(make_checkpoint("llama"), [prompt], 5)[0]


# ---------------------------------------------------------------- the door (cluster/protocol.py, no torch)
def submit_msg(**fields):
    return {"v": 1, "kind": "submit", "mid": 1, "input_ids": [5, 6], **fields}


@pytest.mark.parametrize("fields,needle", [
    (dict(eos_token_id=list(range(1000))), "eos_token_id"),
    (dict(eos_token_id=[1, True]), "eos_token_id"),
    (dict(request_id="x" * 10_000), "request_id"),
    (dict(sampling={"top_k": "5"}), "top_k"),
    (dict(sampling={"temperature": True}), "temperature"),
    (dict(priority="high"), "priority"),
    (dict(priority=1.5), "priority"),
])
def test_parse_submit_refuses_oversized_and_mistyped_fields(fields, needle):
    from cluster import protocol as P

    with pytest.raises(P.ProtocolError) as e:
        P.parse_submit(submit_msg(**fields))
    assert e.value.code == "bad_field" and needle in e.value.message and len(e.value.message) < 200


def test_parse_submit_accepts_fields_at_their_caps():
    from cluster import protocol as P

    s = P.parse_submit(submit_msg(eos_token_id=list(range(64)), request_id="r" * 256, sampling={"top_k": -1}))
    assert s.request_id == "r" * 256 and len(s.eos_token_id) == 64 and s.sampling == {"top_k": -1}
    assert s.priority == 0 and P.parse_submit(submit_msg(priority=-7)).priority == -7
