"""`logprobs_mode` (driver/engine/logprobs_mode.py), vLLM's four modes, per request and as the preset's default:
each equals a transformers reference computed the same way (raw: the model's logits; processed: after temperature
and top-k; *_logprobs: log-softmax of those), top_logprobs too, in serial and overlapped steps; an unknown mode is
bad_field (request) or ValueError (preset)."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster.errors import Code, RequestRejected
from driver.engine.logits_processing import SampleRow
from driver.engine.logprobs_mode import reported
from driver.engine.request import SamplingParams

PROMPT = [1, 17, 33, 250, 9, 44, 81]
TEMPERATURE, TOP_K, NEW = 0.7, 5, 6
MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama", seed=3)


def expected(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The reference figures of `mode` over the vocabulary: temperature then top-k for the processed ones."""
    x = logits.double()
    if mode.startswith("processed"):
        x = x / TEMPERATURE
        x = x.masked_fill(x < x.topk(TOP_K).values[..., -1:], float("-inf"))
    return x.log_softmax(-1) if mode.endswith("logprobs") else x


@pytest.mark.parametrize("overlap", [False, True])
def test_modes_equal_transformers_reference(model_dir, overlap):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = cluster.load(model_dir)
    cfg = cluster.ContinuousBatchingConfig(page_size=16, per_request_processors=True, use_async_batching=overlap,
                                           logprobs_mode="raw_logprobs")
    sampling = dict(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, seed=11, max_new_tokens=NEW,
                    eos_token_id=-1, top_logprobs=3)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        ids = {mode: m.add_request(PROMPT, logprobs_mode=mode, **sampling) for mode in MODES}
        default = m.get_result(m.add_request(PROMPT, **sampling), timeout=60)
        outs = {mode: m.get_result(rid, timeout=60) for mode, rid in ids.items()}
        with pytest.raises(RequestRejected) as e:
            m.add_request(PROMPT, max_new_tokens=1, logprobs_mode="raw")
        assert e.value.code == Code.BAD_FIELD and "logprobs_mode" in e.value.message
    tokens = outs["raw_logprobs"].generated_tokens
    assert all(o.generated_tokens == tokens for o in outs.values())  # the mode changes reports, not choices
    assert default.logprobs == outs["raw_logprobs"].logprobs  # the preset's default
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
    for mode, out in outs.items():
        want = expected(logits, mode)
        assert out.logprobs == pytest.approx(want.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist(),
                                             abs=1e-4), mode
        for i, alts in enumerate(out.top_logprobs):
            values, top = want[i].topk(3)
            assert [t for t, _ in alts] == top.tolist(), mode
            assert [v for _, v in alts] == pytest.approx(values.tolist(), abs=1e-4), mode


def test_mixed_batch_and_preset_check():
    """Rows of every mode in one batch each get their own figures; a preset's unknown mode is a ValueError."""
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 4)
    processed = logits / 2
    rows = [SampleRow("r", SamplingParams(), 0, 0, logprobs=True, top=1, logprobs_mode=m) for m in MODES]
    chosen, top = reported(logits, processed, rows, torch.tensor([1, 1, 1, 1]))
    want = [processed[0].log_softmax(-1)[1], logits[0].log_softmax(-1)[1], processed[0, 1], logits[0, 1]]
    assert chosen.tolist() == pytest.approx([float(w) for w in want])
    assert top.ids[:, 0].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="logprobs_mode"):
        cluster.ContinuousBatchingConfig(logprobs_mode="logits")
