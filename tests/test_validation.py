"""Bad input to generate_batch raises ValueError naming the request and the problem, before any step runs."""

from __future__ import annotations

import pytest

import cluster
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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        cluster.load(tmp_path)
