"""The HTTP gateway's logic in this process (the fast tier's): every error code has a status and an OpenAI-shaped
body, and logprobs survive JSON. tests/test_http.py and tests/test_http_openai.py run it against a TP=2 server."""

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
