"""TRL's vllm-serve shapes (launch/gateway/trl_shape.py), in process: the sampling fields with generation_kwargs
over them as TRL's server builds vLLM's SamplingParams, refusals naming the field, vLLM's ranked logprobs (the top k,
then the chosen token where it is not among them), completions contiguous per prompt, and get_sequence_logprobs'
json and binary answers read back the way TRL's VLLMClient reads them."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from cluster.errors import Code
from cluster.outputs import GenerationOutput, RequestStatus
from launch.gateway.errors import HttpError
from launch.gateway.trl_shape import (ChatRequest, GenerateRequest, SequenceLogprobsRequest, completions_answer,
                                      ranked, sequence_logprobs_binary, sequence_logprobs_json, structured_output,
                                      submit_params)


def refused(call) -> HttpError:
    with pytest.raises(HttpError) as e:
        call()
    return e.value


def test_sampling_fields_to_a_submit():
    body = GenerateRequest(prompts=[[1, 2]], n=4, temperature=0.7, top_k=0, max_tokens=8, logprobs=2,
                           generation_kwargs={"seed": 5, "stop_token_ids": [9], "min_tokens": 2, "top_p": 0.9,
                                              "skip_special_tokens": False})
    s = body.sampling()
    assert s.n == 4 and s.top_p == 0.9  # generation_kwargs over the fields, as TRL's server does
    assert submit_params(s, None, 2) == {
        "max_new_tokens": 8, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 5, "min_new_tokens": 2,
        "eos_token_id": [2, 9], "logprobs": True, "top_logprobs": 2, "logprobs_mode": "processed_logprobs"}
    plain = submit_params(GenerateRequest(prompts=["a"], temperature=0.0, logprobs=None).sampling(), None, 2)
    assert plain == {"max_new_tokens": 16, "do_sample": False}  # TRL's default max_tokens; no logprobs asked
    assert GenerateRequest(prompts=["a", "b"]).sources() == [{"text": "a"}, {"text": "b"}]
    assert GenerateRequest(prompts=[[1], [2, 3]], images=[None, None]).sources()[1] == {"input_ids": [2, 3]}
    chat = ChatRequest(messages=[[{"role": "user", "content": "hi"}]], tools=[{"type": "function"}],
                       chat_template_kwargs={"enable_thinking": False})
    assert chat.template_kwargs() == {"add_generation_prompt": True, "tools": [{"type": "function"}],
                                      "enable_thinking": False}


def test_refusals_name_the_field():
    e = refused(lambda: GenerateRequest(prompts=["a"], generation_kwargs={"best_of": 2}).sampling())
    assert (e.code, e.param) == (Code.UNSUPPORTED, "generation_kwargs.best_of")
    e = refused(lambda: GenerateRequest(prompts=["a"], generation_kwargs={"n": 0}).sampling())
    assert (e.code, e.param) == (Code.BAD_FIELD, "generation_kwargs.n")
    e = refused(lambda: submit_params(GenerateRequest(prompts=["a"], min_p=0.1).sampling(), None, None))
    assert (e.code, e.param) == (Code.UNSUPPORTED, "min_p")
    assert refused(lambda: GenerateRequest(prompts=["a"], images=[["png"]]).sources()).param == "images"
    e = refused(lambda: SequenceLogprobsRequest(sequences=[[1, 2]], prompt_lengths=[1]).check())
    assert e.param == "top_logprobs"  # TRL's default of 100 is beyond vLLM's and Lockstep's 20
    assert refused(lambda: SequenceLogprobsRequest(sequences=[[1, 2]], prompt_lengths=[3],
                                                   top_logprobs=1).check()).param == "prompt_lengths"


def test_structured_outputs():
    s = GenerateRequest(prompts=["a"], generation_kwargs={"structured_outputs": {"json": '{"type": "object"}'}})
    assert structured_output(s.sampling(), None) == {"json_schema": {"type": "object"}}
    assert structured_output(s.sampling(), "[0-9]+") == {"regex": "[0-9]+"}  # TRL's regex field wins
    choice = GenerateRequest(prompts=["a"], generation_kwargs={"structured_outputs": {"choice": ["a+", "b"]}})
    assert structured_output(choice.sampling(), None) == {"regex": r"(?:a\+)|(?:b)"}
    tag = GenerateRequest(prompts=["a"], generation_kwargs={"structured_outputs": {"structural_tag": "x"}})
    assert refused(lambda: structured_output(tag.sampling(), None)).code == Code.UNSUPPORTED


def test_ranked_logprobs_are_vllms():
    assert ranked(5, -0.5, None) == ([-0.5], [5])  # logprobs=0: the chosen token alone
    assert ranked(5, -0.5, [(5, -0.5), (7, -1.0)]) == ([-0.5, -1.0], [5, 7])  # among the top: in its place
    assert ranked(9, -3.0, [(5, -0.5), (7, -1.0)]) == ([-0.5, -1.0, -3.0], [5, 7, 9])  # beyond: after them
    assert ranked(9, float("nan"), [(5, float("-inf"))]) == ([-9999.0, None], [5, 9])


def sample(rid: str, tokens: list[int], prompt: list[int]) -> GenerationOutput:
    return GenerationOutput(rid, prompt_ids=prompt, generated_tokens=tokens, logprobs=[-0.25] * len(tokens),
                            top_logprobs=[[(99, -0.1)]] * len(tokens), status=RequestStatus.FINISHED)


def test_completions_contiguous_per_prompt():
    groups = [[sample(f"p{p}s{i}", [10 * p + i], [p]) for i in range(3)] for p in range(2)]
    got = completions_answer(groups, logprobs=True)
    assert got["prompt_ids"] == [[0], [1]]
    assert got["completion_ids"] == [[0], [1], [2], [10], [11], [12]]
    assert got["logprob_token_ids"][1] == [[99, 1]] and got["logprobs"][1] == [[-0.1, -0.25]]
    assert completions_answer(groups, logprobs=False)["logprobs"] is None


def scored() -> list[GenerationOutput]:
    """Two scored sequences: [1, 2, 3] (prompt 1) and [4, 5] (prompt 0), top 2 alternatives a position."""
    a = GenerationOutput("a", prompt_ids=[1, 2, 3], prompt_logprobs=[None, -1.0, -2.0],
                         prompt_top_logprobs=[(), [(2, -1.0), (8, -1.5)], [(8, -0.5), (9, -1.5)]])
    b = GenerationOutput("b", prompt_ids=[4, 5], prompt_logprobs=[None, -0.1],
                         prompt_top_logprobs=[(), [(5, -0.1), (6, -3.0)]])
    return [a, b]


def test_sequence_logprobs_json():
    got = sequence_logprobs_json(scored(), [1, 0])
    assert got["logprobs"] == [[[-1.0, -1.5], [-0.5, -1.5, -2.0]], [[], [-0.1, -3.0]]]
    assert got["logprob_token_ids"] == [[[2, 8], [8, 9, 3]], [[], [5, 6]]]
    assert got["logprobs_b64"] is None and got["shape"] is None  # the response model's other fields, null


def decode(response: dict) -> dict:
    """TRL's VLLMClient._decode_binary_logprobs, as it reads the answer (numpy, native order)."""
    shape, lengths = response["shape"], response["completion_lengths"]

    def arr(key: str, dtype, width: int) -> np.ndarray:
        return np.frombuffer(base64.b64decode(response[key]), dtype=dtype).reshape([shape[0], shape[1], width])
    top, ids = arr("logprobs_b64", np.float32, shape[2]), arr("token_ids_b64", np.int32, shape[2])
    actual, actual_ids = arr("actual_logprobs_b64", np.float32, 1), arr("actual_token_ids_b64", np.int32, 1)
    return {"logprobs": [top[i, :n].tolist() for i, n in enumerate(lengths)],
            "logprob_token_ids": [ids[i, :n].tolist() for i, n in enumerate(lengths)],
            "actual_logprobs": [actual[i, :n].tolist() for i, n in enumerate(lengths)],
            "actual_token_ids": [actual_ids[i, :n].tolist() for i, n in enumerate(lengths)]}


def test_sequence_logprobs_binary_as_trls_client_reads_it():
    response = sequence_logprobs_binary(scored(), [1, 0], top_k=2)
    assert response["shape"] == [2, 2, 2] and response["completion_lengths"] == [2, 2]
    got = decode(response)
    assert got["logprobs"] == [[[-1.0, -1.5], [-0.5, -1.5]], [[-np.inf, -np.inf], [pytest.approx(-0.1), -3.0]]]
    assert got["logprob_token_ids"] == [[[2, 8], [8, 9]], [[0, 0], [5, 6]]]
    assert got["actual_logprobs"] == [[[-1.0], [-2.0]], [[-np.inf], [pytest.approx(-0.1)]]]
    assert got["actual_token_ids"] == [[[2], [3]], [[0], [5]]]
    empty = sequence_logprobs_binary([], [], top_k=3)
    assert empty["shape"] == [0, 0, 3] and decode(empty)["logprobs"] == []
