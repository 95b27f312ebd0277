"""Structured outputs on the manager API (driver/engine/structured.py): the token mask holds for every schema, is
exact across overlapped scheduling and multi-step bursts (constrained rows need their history: they never run
with tokens in flight nor in a burst, while the unconstrained rows beside them may), and across a resume; a bad
spec is refused naming the problem; the mask is expanded by tensor ops."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch

import cluster
from cluster.errors import Code, RequestRejected
from tests.schemas import SCHEMAS

PROMPTS = [[1, 17, 33 + i, 250, 9] for i in range(6)]
PATTERN = r"[0-9]{3}-[a-z]{2,4}"


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama", seed=3)


@pytest.fixture(scope="module")
def model(model_dir):
    return cluster.load(model_dir)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def workload() -> list[tuple[list[int], dict]]:
    """Constrained rows (each schema, greedy and sampled; a regex) beside unconstrained sampled ones, one with a
    logit_bias and one with OpenAI's penalties."""
    out = []
    for k, schema in enumerate(SCHEMAS):
        for i, sampled in enumerate((False, True)):
            kw = {"do_sample": True, "temperature": 1.0, "seed": 10 * k + i} if sampled else {}
            out.append((PROMPTS[k], kw | {"structured_output": {"json_schema": schema}}))
    out.append((PROMPTS[3], {"structured_output": {"regex": PATTERN}, "do_sample": True, "seed": 4}))
    out += [(p, {"do_sample": True, "temperature": 1.0, "seed": i}) for i, p in enumerate(PROMPTS)]
    # OpenAI's bias (no history: bursts) and penalties (history), exact across the modes too
    out += [(PROMPTS[0], {"logit_bias": [[300, 4.0], [17, -100.0]]}),
            (PROMPTS[1], {"do_sample": True, "seed": 9, "presence_penalty": 0.8, "frequency_penalty": 1.1,
                          "max_new_tokens": 30})]  # short: while a row needs its history, nobody bursts
    return out


def run(model, overlap: bool, burst: int = 1, resume_at: dict[int, list[int]] | None = None) -> tuple[list[list[int]], int]:
    cfg = cluster.ContinuousBatchingConfig(per_request_processors=True, page_size=16, use_async_batching=overlap,
                                           decode_burst=burst)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        rids = []
        for i, (prompt, kw) in enumerate(workload()):
            kw = dict(kw)
            new = kw.pop("max_new_tokens", 120)
            if resume_at and i in resume_at:
                rids.append(m.submit(m.build_request(prompt, f"r{i}", new, resume_tokens=resume_at[i], **kw)))
            else:
                rids.append(m.add_request(prompt, f"r{i}", new, **kw))
        outs = [m.get_result(r, timeout=120) for r in rids]
        bursts = m.engine.num_burst_forwards
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    return [o.generated_tokens for o in outs], bursts


def test_every_output_follows_its_spec_and_overlap_bursts_and_resume_are_exact(model, tok):
    serial, _ = run(model, overlap=False)
    cases = workload()
    for (prompt, kw), tokens in zip(cases, serial):
        spec = kw.get("structured_output")
        if spec is None:
            continue
        text = tok.decode(tokens, skip_special_tokens=True)
        if "regex" in spec:
            assert re.fullmatch(PATTERN, text), text
        else:
            jsonschema.validate(json.loads(text), spec["json_schema"])
    overlapped, _ = run(model, overlap=True)
    assert overlapped == serial
    burst, bursts = run(model, overlap=True, burst=4)
    assert burst == serial and bursts > 0  # the unconstrained rows burst; the constrained ones never do
    # a resume after a restart: the constrained requests go on from their delivered tokens, to the same answer
    # (and the penalties count the resumed tokens: the last row)
    rows = [*range(7), len(serial) - 1]
    resumed, _ = run(model, overlap=True, resume_at={i: serial[i][:len(serial[i]) // 2] for i in rows})
    assert resumed == serial


def test_a_complete_grammar_ends_the_request_even_with_eos_ignored(model, tok):
    cfg = cluster.ContinuousBatchingConfig(per_request_processors=True, page_size=16)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        out = m.get_result(m.add_request(PROMPTS[0], max_new_tokens=12, eos_token_id=-1,
                                         structured_output={"regex": "[0-9]{3}"}), timeout=60)
    assert out.finish_reason == "stop" and re.fullmatch("[0-9]{3}", tok.decode(out.generated_tokens,
                                                                               skip_special_tokens=True))


def test_a_generation_config_constrains_every_request(model, model_dir, tok):
    from transformers import GenerationConfig

    gc = GenerationConfig.from_pretrained(model_dir)
    gc.structured_output = {"regex": PATTERN}
    cfg = cluster.ContinuousBatchingConfig(page_size=16)
    with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cfg) as m:
        outs = [m.get_result(m.add_request(p, max_new_tokens=16), timeout=60) for p in PROMPTS[:3]]
    assert all(re.fullmatch(PATTERN, tok.decode(o.generated_tokens, skip_special_tokens=True)) for o in outs)


def test_bad_specs_are_refused_naming_the_problem(model):
    cfg = cluster.ContinuousBatchingConfig(per_request_processors=True, page_size=16)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        for spec, problem in (({"json_schema": {"type": "wat"}}, "Invalid type: wat"),
                              ({"regex": "a(b"}, "unclosed group"), ({"grammar": "start: foo"}, "unknown name"),
                              ({"json": {}}, "exactly one of"), ({"json_object": 1}, "json_object must be true")):
            with pytest.raises(RequestRejected) as e:
                m.add_request(PROMPTS[0], max_new_tokens=4, structured_output=spec)
            assert e.value.code == Code.BAD_FIELD and problem in e.value.message, e.value.message


def test_without_llguidance_a_structured_request_is_unsupported(monkeypatch):
    from driver.engine.structured import grammar_of

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(RequestRejected) as e:
        grammar_of({"regex": "a"})
    assert e.value.code == Code.UNSUPPORTED and "pip install" in e.value.message


def test_the_mask_expands_bits_as_llguidance_lays_them_out():
    from driver.engine.structured import mask_rows

    vocab = 70  # wider than two words and not a multiple of 32
    allowed = torch.rand(3, vocab) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmasks = [w.to(torch.int32) for w in (words - (words >> 31 << 32))]  # as int32 words, the sign bit included
    x = torch.randn(3, vocab + 5)  # logits wider than the tokenizer: the rest is never allowed
    masked = mask_rows(x, bitmasks)
    want = torch.cat([allowed, torch.zeros(3, 5, dtype=torch.bool)], 1)
    assert torch.equal(masked.isfinite(), want) and torch.equal(masked[want], x[want])
