"""OpenAI compatibility against one TP=2 `lockstep serve --http`, with the official `openai` client, to the standard
of vLLM's server tests (issue 27): range checks into 400s naming the field, text_offsets while a stop string holds
text back, logprobs=0, stream_options without stream, GET /v1/models/{id}, logit_bias and the presence and
frequency penalties against a reference computed from transformers' logits, top_logprobs equal to transformers'
top-k log-softmax, echo."""

from __future__ import annotations

import math

import openai
import pytest

from cluster.errors import Code
from tests.test_http import PROMPT_IDS, http, model_dir, oai, server, tok  # noqa: F401  (the shared fixtures)

pytestmark = pytest.mark.slow  # the shared TP=2 server (tests/test_http_shapes.py: the gateway's logic in process)
NEW = 10


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int]):
    """transformers' float32 next-token logits after `ids`."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


def reference(hf, prompt: list[int], new: int, bias: dict[int, float] | None = None, frequency: float = 0.0,
              presence: float = 0.0) -> list[int]:
    """Greedy tokens with OpenAI's logit_bias and penalties applied to transformers' logits (EOS ignored)."""
    out: list[int] = []
    for _ in range(new):
        x = hf_logits(hf, prompt + out)
        for t, b in (bias or {}).items():
            x[t] += b
        for t in set(out):
            x[t] -= out.count(t) * frequency + presence
        out.append(int(x.argmax()))
    return out


def refused(fn, param: str, code: str = Code.BAD_FIELD) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    assert e.value.body["code"] == code and e.value.body["param"] == param, e.value.body
    return e.value.body


# ------------------------------------------------------------------ items 1, 4, 5: ranges, stream_options, models
def test_out_of_range_fields_are_400s_naming_them(server, oai, model_dir):
    name = model_dir.name
    for seed in (1 << 63, -(1 << 63) - 1, 1 << 70):
        refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2, seed=seed), "seed")
    assert oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2, seed=(1 << 63) - 1,
                                  temperature=1.0).usage.completion_tokens == 2
    refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=1 << 64), "max_tokens")
    refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2, presence_penalty=2.5),
            "presence_penalty")
    refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2, logprobs=21), "logprobs")
    refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2, logit_bias={"x": 1}),
            "logit_bias")
    refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2, logit_bias={"5": 101}),
            "logit_bias")
    status, body = http(server, "POST", "/v1/completions", {"model": name, "prompt": PROMPT_IDS, "max_tokens": 2,
                                                             "logit_bias": {str(10 ** 6): 1}})
    assert status == 400 and body["error"]["code"] == Code.BAD_FIELD and body["error"]["param"] == "logit_bias"
    refused(lambda: oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, logprobs=True, top_logprobs=21), "top_logprobs")
    # stream_options only with stream=true, as OpenAI and vLLM
    refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2,
                                           stream_options={"include_usage": True}), "stream_options")
    for field, value in (("functions", [{"name": "f", "parameters": {}}]), ("audio", {"voice": "x", "format": "wav"})):
        refused(lambda: oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, extra_body={field: value}), field, Code.UNSUPPORTED)
    # suffix is still refused, as `unsupported`
    refused(lambda: oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=2, suffix="x"), "suffix",
            Code.UNSUPPORTED)


def test_models_by_id(oai, model_dir):
    card = oai.models.retrieve(model_dir.name)
    assert card.id == model_dir.name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


# ------------------------------------------------------------------ items 2, 3: text_offset, logprobs=0
def test_streamed_text_offsets_equal_the_whole_ones_under_a_stop_string(oai, model_dir):
    name = model_dir.name
    free = oai.completions.create(model=name, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 4]  # its first characters hold text back while they may begin it
    kwargs = dict(model=name, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0, stop=[stop], logprobs=0)
    whole = oai.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(**kwargs, stream=True) if c.choices]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    assert whole.logprobs.text_offset == [sum(map(len, whole.logprobs.tokens[:i]))
                                          for i in range(len(whole.logprobs.tokens))]
    # logprobs=0: one top_logprobs entry per token, the chosen one (OpenAI's and vLLM's answer)
    assert [list(d.items()) for d in whole.logprobs.top_logprobs] == [
        [(t, lp)] for t, lp in zip(whole.logprobs.tokens, whole.logprobs.token_logprobs)]


# ------------------------------------------------------------------ item 6: bias, penalties, top_logprobs, echo
def test_logit_bias_and_penalties_equal_transformers_reference(oai, tok, hf, model_dir):
    plain = reference(hf, PROMPT_IDS, NEW)
    bias = {plain[0]: -100.0, plain[1]: -50.0, 300: 4.0}
    cases = [({"logit_bias": {str(t): b for t, b in bias.items()}}, reference(hf, PROMPT_IDS, NEW, bias=bias)),
             ({"frequency_penalty": 1.5}, reference(hf, PROMPT_IDS, NEW, frequency=1.5)),
             ({"presence_penalty": 1.2}, reference(hf, PROMPT_IDS, NEW, presence=1.2)),
             ({"presence_penalty": -0.5, "frequency_penalty": 0.7, "logit_bias": {"300": 3.0}},
              reference(hf, PROMPT_IDS, NEW, bias={300: 3.0}, frequency=0.7, presence=-0.5))]
    assert any(want != plain for _, want in cases[1:3]), "the penalties must change this prompt's tokens"
    for fields, want in cases:
        assert want != plain or fields.get("presence_penalty", 0) < 0
        for stream in (False, True):
            r = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0,
                                       stream=stream, extra_body={"ignore_eos": True}, **fields)
            text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
            assert text == tok.decode(want, skip_special_tokens=True), (fields, stream)


def test_top_logprobs_equal_transformers_top_k(oai, tok, hf, model_dir):
    import torch

    messages = [{"role": "user", "content": "What is a tensor?"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    chosen = reference(hf, ids, 6)
    want = []
    for i in range(6):
        values, top = torch.topk(hf_logits(hf, ids + chosen[:i]).log_softmax(-1), 20)
        want.append(list(zip(top.tolist(), values.tolist())))
    for k in (1, 5, 20):
        r = oai.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=k, extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        assert len(content) == 6
        for i, entry in enumerate(content):
            assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t, _ in want[i][:k]]
            assert all(math.isclose(a.logprob, lp, abs_tol=2e-5) for a, (_, lp) in zip(entry.top_logprobs, want[i]))
            assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    r = oai.completions.create(model=model_dir.name, prompt=ids, max_tokens=6, temperature=0, logprobs=5,
                               stream=True, extra_body={"ignore_eos": True})
    tops = [d for c in r for d in c.choices[0].logprobs.top_logprobs]
    assert len(tops) == 6
    assert [v for d in tops for v in sorted(d.values(), reverse=True)] == pytest.approx(
        [lp for w in want for _, lp in w[:5]], abs=2e-5)


def test_echo(oai, tok, model_dir):
    text = tok.decode(PROMPT_IDS, skip_special_tokens=True)
    plain = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
    r = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == text + plain.choices[0].text
    chunks = oai.completions.create(model=model_dir.name, prompt=[text, "def f"], max_tokens=4,
                                    temperature=0, echo=True, stream=True)
    got: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            got[ch.index] = got.get(ch.index, "") + ch.text
    assert got[0].startswith(text) and got[1].startswith("def f") and len(got) == 2
    refused(lambda: oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=2, echo=True,
                                           logprobs=1, stream=True), "stream", Code.UNSUPPORTED)


LONG_PROMPT = [(7 * i * i + 13 * i + 1) % 2000 + 2 for i in range(300)]  # past max_batch_tokens 256: two chunks


def test_echo_logprobs_equal_transformers_at_tp2(oai, hf, model_dir):
    """Prompt logprobs (echo + logprobs, as lm-evaluation-harness asks them) equal transformers' log-softmax of the
    prompt (1e-4, float32) at TP=2: a prompt chunked over two prefill steps whose prefix an earlier request left in
    the cache; max_tokens 0 scores alone (no completion token)."""
    import torch

    with torch.no_grad():
        logsm = hf(torch.tensor([LONG_PROMPT])).logits[0, :-1].float().log_softmax(-1)
    want = logsm.gather(1, torch.tensor(LONG_PROMPT[1:])[:, None])[:, 0].tolist()
    name = model_dir.name
    first = oai.completions.create(model=name, prompt=LONG_PROMPT, max_tokens=1, temperature=0)
    for limit in (1, 0):
        r = oai.completions.create(model=name, prompt=LONG_PROMPT, max_tokens=limit, temperature=0, echo=True,
                                   logprobs=2)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(LONG_PROMPT) + limit
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(LONG_PROMPT)] == pytest.approx(want, abs=1e-4)
        assert all(len(d) in (2, 3) and max(d.values()) >= v for d, v in zip(lp.top_logprobs[1:], want))
        assert r.usage.completion_tokens == limit and r.usage.prompt_tokens == len(LONG_PROMPT)
        assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == oai.completions.create(model=name, prompt=LONG_PROMPT, max_tokens=1, echo=True,
                                                       temperature=0).choices[0].text[:len(r.choices[0].text)]
    assert first.choices[0].text


# ------------------------------------------------------------------ structured outputs
def test_structured_outputs_follow_their_schema(server, oai, model_dir):
    """Every output of every schema parses and validates: greedy and sampled, streamed and not, at TP=2."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from tests.schemas import SCHEMAS

    messages = [{"role": "user", "content": "Describe a user as JSON."}]

    def texts(schema: dict, stream: bool, sampled: bool) -> list[tuple[str, str]]:
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
        kwargs = dict(model=model_dir.name, messages=messages, max_tokens=160, response_format=fmt, stream=stream,
                      n=2 if sampled else 1, temperature=1.0 if sampled else 0, seed=5 if sampled else None)
        r = oai.chat.completions.create(**kwargs)
        if not stream:
            return [(c.message.content, c.finish_reason) for c in r.choices]
        got: dict[int, list] = {}
        for chunk in r:
            for c in chunk.choices:
                entry = got.setdefault(c.index, ["", None])
                entry[0] += c.delta.content or ""
                entry[1] = c.finish_reason or entry[1]
        return [tuple(got[i]) for i in sorted(got)]

    cases = [(s, stream, sampled) for s in SCHEMAS for stream in (False, True) for sampled in (False, True)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: texts(*c), cases))
    for (schema, stream, sampled), outs in zip(cases, results):
        assert len(outs) == (2 if sampled else 1)
        for text, reason in outs:
            assert reason == "stop", (schema, stream, sampled, text)
            jsonschema.validate(json.loads(text), schema)
    # any object: a random model may write one key forever, this prompt's greedy answer ends
    r = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=200, temperature=0,
                               extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def test_regex_grammar_and_refusals(server, oai, model_dir):
    import re

    from cluster.client import Client

    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for stream in (False, True):
        r = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=20, temperature=1.0, n=3,
                                   seed=1, stream=stream, extra_body={"guided_regex": pattern})
        texts: dict[int, str] = {}
        for c in (r if stream else [r]):
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert len(texts) == 3 and all(re.fullmatch(pattern, t) for t in texts.values()), texts
    r = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                               extra_body={"guided_grammar": 'start: "yes" | "no" | "maybe"'})
    assert r.choices[0].text in ("yes", "no", "maybe")
    with Client(server.address, timeout=60) as c:  # the wire's own field
        out = c.generate(PROMPT_IDS, max_new_tokens=20, return_text=True, structured_output={"regex": pattern})
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop"
    for fmt, problem in (({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "wat"}}}, "wat"),
                         ({"type": "json_schema"}, "json_schema")):
        body = refused(lambda: oai.chat.completions.create(model=model_dir.name, max_tokens=4, response_format=fmt,
                                                           messages=[{"role": "user", "content": "hi"}]),
                       "response_format")
        assert problem in body["message"], body
    body = refused(lambda: oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=4,
                                                  extra_body={"guided_regex": "a(b"}), "guided_regex")
    assert "unclosed group" in body["message"]


def test_logprobs_mode_and_token_ids_at_tp2(oai, hf, model_dir):
    """vLLM's `logprobs_mode` per request (raw: the model's log-softmax; processed: after temperature) and
    `return_token_ids` (prompt and completion ids in each choice) at TP=2, against transformers' logits."""
    import torch

    outs = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        r = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=5, temperature=0.7, seed=5,
                                   logprobs=1, extra_body={"logprobs_mode": mode, "return_token_ids": True})
        outs[mode] = r.choices[0]
    tokens = outs["raw_logprobs"].token_ids
    assert outs["processed_logprobs"].token_ids == tokens and len(tokens) == 5
    assert outs["raw_logprobs"].prompt_token_ids == PROMPT_IDS
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT_IDS + tokens])).logits[0, len(PROMPT_IDS) - 1:-1].double()
    for mode, scale in (("raw_logprobs", 1.0), ("processed_logprobs", 0.7)):
        want = (logits / scale).log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        assert outs[mode].logprobs.token_logprobs == pytest.approx(want, abs=1e-4), mode
    chat = oai.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0, extra_body={"return_token_ids": True})
    assert chat.prompt_token_ids == chat.choices[0].prompt_token_ids and len(chat.choices[0].token_ids) <= 3
