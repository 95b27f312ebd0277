"""Text in and out: the made tokenizer, the incremental detokenizer and stop strings (unit, TP=1), then text
submits, streamed text, stop strings, finish reasons and logprobs against one TP=2 server."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import pytest

from cluster import protocol as P
from cluster.client import Client
from cluster.outputs import GenerationOutput, RequestStatus
from driver.frontdoor.text_output import Detokenizer, TextOutput
from launch.make_tokenizer import make_tokenizer
from tests.conftest import hf_greedy
from tests.serving import fast_config, serve

VOCAB = 2048
PROMPT = "Return the value of the attribute"
N = 24
LONG = 400  # a request that a stop string must cut short


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB))


def byte_ids(tok: Any, text: str) -> list[int]:
    """One token per UTF-8 byte of `text` (the byte-level alphabet), so a multi-byte character is split."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    return tok.convert_tokens_to_ids([chars[b] for b in text.encode()])


def stream_text(text: TextOutput, tokens: list[int]) -> tuple[list[str], GenerationOutput]:
    """Feed `tokens` one output per token (the last one final) as the desk does; the streamed deltas and the
    last output."""
    deltas = []
    for i in range(1, len(tokens) + 1):
        out = GenerationOutput("r", generated_tokens=tokens[:i], logprobs=[-0.5] * i, weight_versions=[(0, 7)],
                               status=RequestStatus.FINISHED if i == len(tokens) else RequestStatus.DECODING)
        if text.update(out) or out.is_finished():
            return deltas, out
        deltas.append(text.take_delta())
    raise AssertionError("no final output")


# ---------------------------------------------------------------- the tokenizer
def test_made_tokenizer_loads_round_trips_and_chats(tok):
    assert len(tok) == VOCAB
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<s>", "</s>"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for text in ("def f(x):\n    return x + 1", "naïve café, 3 € and 😀", "  two  spaces "):
        ids = tok(text)["input_ids"]
        assert ids[0] == 1 and max(ids) < VOCAB
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok("Return the value of the attribute")["input_ids"]) < 12  # merges learnt from docstrings
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    assert tok.decode(ids) == chat and ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 3


@pytest.mark.slow
def test_a_32k_made_tokenizer_gives_nearly_every_id_text(tmp_path):
    """The small model's vocabulary: the docstrings alone run out of merges at about 14.8k tokens, so the stdlib's
    sources are learnt too; a random model's tokens then decode to text, as a hub tokenizer's do (before, 17k of
    the 32k ids were reserved special tokens that decode to "", and first-text timings over HTTP meant little)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path, 32000))
    assert len(tok) == 32000
    ids = random.Random(0).sample(range(32000), 2000)
    empty = sum(tok.decode([i], skip_special_tokens=True) == "" for i in ids)
    assert empty <= 20, f"{empty} of 2000 ids decode to no text"


@pytest.mark.slow
def test_make_model_writes_a_tokenizer_unless_told_not_to(tmp_path, capsys):
    from transformers import AutoConfig, AutoTokenizer

    from launch.cli import main

    assert main(["make-model", str(tmp_path / "with"), "--set", "vocab_size=1000"]) == 0
    assert main(["make-model", str(tmp_path / "without"), "--no-tokenizer"]) == 0
    path = tmp_path / "with"
    assert len(AutoTokenizer.from_pretrained(path)) == AutoConfig.from_pretrained(path).vocab_size == 1000
    assert not (tmp_path / "without" / "tokenizer.json").exists()


# ---------------------------------------------------------------- the detokenizer
def test_detokenizer_never_emits_a_broken_character(tok):
    text = "a€b😀c"
    ids = byte_ids(tok, text)
    assert len(ids) == len(text.encode())
    d = Detokenizer(tok)
    deltas = [d.add(i) for i in ids]
    assert "".join(deltas) + d.flush() == text
    assert deltas == ["a", "", "", "€", "b", "", "", "", "😀", "c"]


def test_detokenizer_pieces_join_to_decode(tok):
    rng = random.Random(0)
    specials = [0, 1, 2, 3, VOCAB - 1]
    for _ in range(150):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(VOCAB) for _ in range(rng.randrange(1, 25))]
        d = Detokenizer(tok)
        pieces = [d.add(i) for i in ids]
        assert all(not p.endswith("\ufffd") for p in pieces)
        assert "".join(pieces) + d.flush() == tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- stop strings
def test_stop_string_ends_trims_and_is_never_streamed(tok):
    ids = tok("Hello world, stop here please")["input_ids"][1:]
    text = TextOutput.make(tok, ["stop here"])
    deltas, out = stream_text(text, ids)
    assert out.text == "Hello world, " and "".join(deltas) + text.take_delta() == out.text
    assert (out.status, out.finish_reason, out.stop_string) == (RequestStatus.FINISHED, "stop", "stop here")
    assert "stop here" in tok.decode(out.generated_tokens) and "stop here" not in tok.decode(out.generated_tokens[:-1])
    assert out.generated_tokens == ids[:len(out.generated_tokens)] and len(out.generated_tokens) < len(ids)
    assert len(out.logprobs) == len(out.generated_tokens) and out.weight_versions == [(0, 7)]


def test_earliest_stop_wins_and_a_split_character_matches(tok):
    ids = byte_ids(tok, "x€y") + tok("zz end")["input_ids"][1:]
    deltas, out = stream_text(TextOutput.make(tok, ["end", "€"]), ids)
    assert (out.text, out.stop_string, len(out.generated_tokens)) == ("x", "€", 4)
    _, out = stream_text(TextOutput.make(tok, ["nothing"]), ids)
    assert (out.text, out.finish_reason, out.stop_string) == ("x€yzz end", None, None)


def test_resumed_text_continues_where_the_client_was(tok):
    ids = tok("Hello world, stop here please")["input_ids"][1:]
    fresh = TextOutput.make(tok, ["stop here"])
    deltas = []
    for i in range(1, 4):
        fresh.update(GenerationOutput("r", generated_tokens=ids[:i]))
        deltas.append(fresh.take_delta())
    resumed = TextOutput.make(tok, ["stop here"], resumed=ids[:3])
    assert resumed.streamed == len("".join(deltas))
    rest, out = stream_text(resumed, ids)
    assert "".join(deltas + rest) + resumed.take_delta() == out.text == "Hello world, "


def test_stop_field_is_checked():
    base = {"v": 1, "kind": "submit", "input_ids": [1, 2]}
    assert P.parse_submit(base | {"stop": ["a", "bc"], "logprobs": True}).stop == ["a", "bc"]
    assert not P.parse_submit(base).wants_text and P.parse_submit(base | {"return_text": True}).wants_text
    for bad in ("abc", [""], ["x" * 257], ["a"] * 17, [1]):
        with pytest.raises(P.ProtocolError) as e:
            P.parse_submit(base | {"stop": bad})
        assert e.value.code == "bad_field"
    with pytest.raises(P.ProtocolError):
        P.parse_submit(base | {"logprobs": "yes"})


# ---------------------------------------------------------------- a TP=2 server
@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def server(model):
    with serve(model, tp=2, config=fast_config(), forked=True) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model):
    """transformers' greedy tokens for PROMPT, and their text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(PROMPT)["input_ids"]
    tokens = hf_greedy(model, [ids], N)[0]
    return ids, tokens, tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.slow
def test_text_submit_matches_transformers(server, reference):
    ids, tokens, text = reference
    with Client(server.address) as c:
        out = c.generate(text=PROMPT, max_new_tokens=N)
        plain = c.generate(ids, max_new_tokens=N)
    assert out.prompt_ids == ids and out.generated_tokens == tokens and out.text == text
    assert out.finish_reason == ("stop" if tokens[-1] == 2 else "length")
    assert plain.generated_tokens == tokens and plain.text is None and plain.finish_reason == out.finish_reason


@pytest.mark.slow
def test_streamed_text_grows_to_the_final_text(server, reference):
    _, tokens, text = reference
    with Client(server.address) as c:
        outs = list(c.stream(text=PROMPT, max_new_tokens=N))
    assert len(outs) == len(tokens) and outs[-1].text == text and outs[-1].generated_tokens == tokens
    for a, b in zip(outs, outs[1:]):
        assert b.text.startswith(a.text)
    assert all(o.text is not None and not o.text.endswith("\ufffd") for o in outs[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True])
def test_stop_strings_end_and_trim(server, reference, model, streaming):
    from transformers import AutoTokenizer

    _, tokens, text = reference
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text)) if "\ufffd" not in text[i:i + 3])
    want = text[:text.find(stop)]
    with Client(server.address) as c:
        before = c.stats()["tokens_generated"]
        if streaming:  # a long request: the stop string must end it on the server too
            outs = list(c.stream(text=PROMPT, max_new_tokens=LONG, stop=["@never@", stop]))
            assert all(want.startswith(o.text) for o in outs)
            out = outs[-1]
        else:
            out = c.generate(text=PROMPT, max_new_tokens=LONG, stop=[stop], request_id="stopped")
        assert (out.text, out.finish_reason, out.stop_string) == (want, "stop", stop)
        n = len(out.generated_tokens)
        assert out.generated_tokens == tokens[:n] and n < len(tokens)
        tok = AutoTokenizer.from_pretrained(model)
        assert stop in tok.decode(tokens[:n]) and stop not in tok.decode(tokens[:n - 1])
        deadline = time.monotonic() + 30
        while c.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.stats()["running"] == 0 and c.stats()["tokens_generated"] - before < LONG // 2
        assert c.generate(text=PROMPT, max_new_tokens=2, request_id="stopped").generated_tokens == tokens[:2]


@pytest.mark.slow
def test_finish_reasons_and_logprobs(server, reference, model):
    ids, tokens, _ = reference
    with Client(server.address) as c:
        short = c.generate(ids, max_new_tokens=3, logprobs=True)
        eos = c.generate(ids, max_new_tokens=N, eos_token_id=tokens[4])
        streamed = list(c.stream(ids, max_new_tokens=4, logprobs=True, return_text=True))
        quiet = list(c.stream(ids, max_new_tokens=3))
    assert (short.generated_tokens, short.finish_reason) == (tokens[:3], "length")
    assert len(short.logprobs) == 3 and all(math.isfinite(x) and x <= 0 for x in short.logprobs)
    assert eos.generated_tokens == tokens[:tokens.index(tokens[4]) + 1] and eos.finish_reason == "stop"
    assert all(len(o.logprobs) == len(o.generated_tokens) for o in streamed)
    assert streamed[-1].logprobs[:3] == pytest.approx(short.logprobs, abs=1e-4)
    assert streamed[-1].text is not None and quiet[0].text is None and quiet[0].logprobs == []
