"""SGLang's /generate shaping (launch/gateway/sglang_shape.py), in process: GenerateReqInput's fields to a submit,
a Lockstep output to SGLang's answer (text, output_ids, meta_info with [logprob, id, null] triples, finish_reason
{type: stop|length|abort}, weight_version, token counts), memory tags; refusals name their field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.errors import Code
from cluster.outputs import GenerationOutput, RequestStatus
from launch.gateway.errors import HttpError
from launch.gateway.sglang_shape import GenerateBody, answer, finish_reason, memory_tags, submit_params


def test_body_to_submit():
    body = GenerateBody(input_ids=[1, 2, 3], return_logprob=True,
                        sampling_params={"max_new_tokens": 8, "temperature": 0.0, "stop": "x", "stop_token_ids": [9],
                                         "skip_special_tokens": False, "no_stop_trim": True})
    assert body.prompts() == ([{"input_ids": [1, 2, 3]}], False)
    params = submit_params(body, 2, text=True)
    assert params == {"max_new_tokens": 8, "do_sample": False, "stop": ["x"], "eos_token_id": [2, 9],
                      "return_text": True, "logprobs": True}
    sampled = submit_params(GenerateBody(text=["a", "b"], sampling_params={"temperature": 0.5, "top_k": 4,
                                                                          "ignore_eos": True}), 2, text=True)
    assert sampled["temperature"] == 0.5 and sampled["top_k"] == 4 and sampled["eos_token_id"] == -1
    assert GenerateBody(text=["a", "b"]).prompts()[1] is True
    assert GenerateBody(input_ids=[[1], [2]]).rids(2, "f") == ["f-0", "f-1"]
    scoring = submit_params(GenerateBody(input_ids=[1, 2], return_logprob=True, logprob_start_len=0), None, False)
    assert scoring["prompt_logprobs"] == 0


def test_refusals_name_the_field():
    with pytest.raises(HttpError) as e:
        GenerateBody(input_ids=[1], text="a").prompts()
    assert e.value.param == "text" and e.value.code == Code.BAD_FIELD
    with pytest.raises(HttpError) as e:
        GenerateBody(input_ids=[[1], [2]], rid=["a"]).rids(2, "f")
    assert e.value.param == "rid"
    with pytest.raises(ValidationError, match="json_schema"):
        GenerateBody(input_ids=[1], sampling_params={"json_schema": "{}"})
    with pytest.raises(HttpError):
        memory_tags(["gpu"])
    assert memory_tags(None) == ["kv_cache", "weights"] and memory_tags(["cuda_graph", "kv_cache"]) == ["kv_cache"]


def output(reason: str, status: RequestStatus = RequestStatus.FINISHED, **kw) -> GenerationOutput:
    return GenerationOutput("r1", prompt_ids=[1, 2, 3], generated_tokens=[5, 6], logprobs=[-0.5, float("-inf")],
                            status=status, finish_reason=reason, text="hi", **kw)


def test_output_to_answer():
    body = GenerateBody(input_ids=[1, 2, 3], return_logprob=True)
    got = answer(output("length"), body, "v7", 0.25)
    assert got == {"text": "hi", "output_ids": [5, 6], "meta_info": {
        "id": "r1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "cached_tokens": 0, "weight_version": "v7", "e2e_latency": 0.25,
        "output_token_logprobs": [[-0.5, 5, None], [-9999.0, 6, None]]}}
    assert "output_token_logprobs" not in answer(output("length"), GenerateBody(input_ids=[1]), "v", 0)["meta_info"]
    assert finish_reason(output("stop")) == {"type": "stop", "matched": 6}
    assert finish_reason(output("stop", stop_string="hi")) == {"type": "stop", "matched": "hi"}
    assert finish_reason(output("abort", RequestStatus.CANCELLED))["type"] == "abort"
    assert finish_reason(output("cancelled", RequestStatus.CANCELLED))["type"] == "abort"
    assert finish_reason(output(None, RequestStatus.DECODING)) is None
    scored = answer(output("length", prompt_logprobs=[None, -1.0, -2.0], prompt_top_logprobs=[[], [], []]),
                    GenerateBody(input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=1), "v", 0)
    assert scored["meta_info"]["input_token_logprobs"] == [[-1.0, 2, None], [-2.0, 3, None]]
