"""`top_logprobs` on the manager API (driver/engine/top_logprobs.py): every token's most probable alternatives,
equal to transformers' top-k log-softmax for greedy rows, the same in serial and overlapped steps; out of range is
bad_field naming it."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster.errors import Code, RequestRejected

PROMPT = [1, 17, 33, 250, 9]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama", seed=3)


def test_top_logprobs_equal_transformers_and_overlap(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = cluster.load(model_dir)
    runs = []
    for overlap in (False, True):
        cfg = cluster.ContinuousBatchingConfig(page_size=16, use_async_batching=overlap)
        with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
            greedy = m.get_result(m.add_request(PROMPT, max_new_tokens=5, top_logprobs=4, eos_token_id=-1), timeout=60)
            plain = m.get_result(m.add_request(PROMPT, max_new_tokens=5, eos_token_id=-1), timeout=60)
            with pytest.raises(RequestRejected) as e:
                m.add_request(PROMPT, max_new_tokens=2, top_logprobs=21)
            assert e.value.code == Code.BAD_FIELD and "top_logprobs" in e.value.message
        assert plain.top_logprobs is None and greedy.generated_tokens == plain.generated_tokens
        runs.append(greedy.top_logprobs)
    assert runs[0] == runs[1]
    ids = PROMPT + greedy.generated_tokens
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1].double()
    values, top = torch.topk(logits.log_softmax(-1), 4)
    for i, alts in enumerate(greedy.top_logprobs):
        assert [t for t, _ in alts] == top[i].tolist() and alts[0][0] == greedy.generated_tokens[i]
        assert [lp for _, lp in alts] == pytest.approx(values[i].tolist(), abs=2e-5)
        assert alts[0][1] == greedy.logprobs[i]
