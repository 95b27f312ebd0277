"""The HTTP gateway's logic in this process (the fast tier's): every error code has a status and an OpenAI-shaped
body, logprobs survive JSON, a text prompt gets one BOS. tests/test_http.py, tests/test_http_openai.py and
tests/test_lm_eval.py run it against a TP=2 server."""

from __future__ import annotations

from cluster.errors import Code
from launch.gateway.errors import STATUS, HttpError, status_of


def test_every_code_has_a_status():
    codes = [v for k, v in vars(Code).items() if k.isupper()]
    assert set(codes) <= set(STATUS)
    assert status_of(Code.QUEUE_FULL) == status_of(Code.CLIENT_LIMIT) == 429
    assert status_of(Code.STOPPED) == status_of(Code.RANK_FAILED) == status_of(Code.SERVER_GONE) == 503
    assert HttpError(Code.BAD_FIELD, "x", "n").body() == {
        "error": {"message": "x", "type": "invalid_request_error", "param": "n", "code": "bad_field"}}


def test_logprobs_json_can_carry():
    """-inf (a token a filter dropped) as -9999.0, NaN (a token delivered before a resume) as null: Starlette's
    JSON refuses both, which made such an answer a 500."""
    from launch.gateway.echo_logprobs import MIN_LOGPROB, finite

    assert finite(float("nan")) is None and finite(float("-inf")) == MIN_LOGPROB and finite(-1.5) == -1.5


def test_a_text_prompt_gets_one_bos(make_checkpoint):
    """lm-evaluation-harness's text requests are its token requests decoded, BOS included: the gateway sends such a
    prompt without its BOS text, so the front door's encoding (which prepends BOS) gives the tokens lm-eval counted
    (vLLM's would hold two); echo still answers the prompt as sent, token ids go as they are."""
    from transformers import AutoTokenizer

    from launch.gateway.openai_schema import CompletionRequest
    from launch.gateway.openai_serving import Model, OpenAIServing

    tok = AutoTokenizer.from_pretrained(make_checkpoint("llama"))  # every tiny checkpoint has this tokenizer
    ids = tok("Return the value")["input_ids"]
    text = tok.decode(ids)
    assert ids[0] == tok.bos_token_id and text.startswith(tok.bos_token)
    serving = OpenAIServing(None, Model("m", None, tok))
    choices, _ = serving.parts(CompletionRequest(model="m", prompt=[text, "Return the value"], echo=True), chat=False)
    assert [tok(c.source["text"])["input_ids"] for c in choices] == [ids, ids]
    assert [c.echo for c in choices] == [text, "Return the value"]
    choices, _ = serving.parts(CompletionRequest(model="m", prompt=[ids], echo=True), chat=False)
    assert choices[0].source == {"input_ids": ids} and choices[0].echo == "Return the value"
    assert Model("m", None).prompt_source(text) == {"text": text}  # no tokenizer: nothing known of a BOS
