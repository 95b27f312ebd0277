"""Prompt logprobs (`prompt_logprobs`, driver/engine/prompt_scores.py): every prompt token's logprob and its
position's top-k equal transformers' log-softmax of the prompt's logits (float32, 1e-4), in serial and overlapped
steps, with chunked prefill, for a prompt whose prefix another request left in the cache (it is recomputed), and
for a family that post-processes its logits (native and generic); out of range is bad_field; n > 1 and resumed
prompts are refused. At TP=2: tests/test_http_openai.py (echo + logprobs), tests/test_lm_eval.py."""

from __future__ import annotations

import pytest
import torch

import cluster
from cluster.errors import Code, RequestRejected

PROMPT = [1, 17, 33, 250, 9, 44, 81, 3, 200, 7, 12, 99, 150, 61, 5, 8, 2, 140, 33, 71, 19, 230, 4, 56, 90, 11,
          67, 31, 245, 18, 6, 77, 128, 40, 10, 222, 13, 58, 95, 20]  # 40 tokens: 2.5 pages of 16
TOP = 3


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama", seed=3)


def reference(model_dir, prompt: list[int]) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """transformers' log-softmax of the prompt: each prompt token's logprob (from the second), and the top-k."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logsm = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    chosen = logsm.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    values, ids = logsm.topk(TOP, dim=-1)
    return chosen, values, ids


def check_against(out, ref) -> None:
    chosen, values, ids = ref
    assert out.prompt_logprobs[0] is None and list(out.prompt_top_logprobs[0]) == []
    assert out.prompt_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    for i, alts in enumerate(out.prompt_top_logprobs[1:]):
        assert [t for t, _ in alts] == ids[i].tolist()
        assert [lp for _, lp in alts] == pytest.approx(values[i].tolist(), abs=1e-4)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_equal_transformers(model_dir, overlap):
    """Chunked prefill (16-token budget: three chunks), and a cached prefix: a first request fills the prefix cache,
    the scoring request recomputes it (no cached page taken), and a later plain request does reuse it."""
    ref = reference(model_dir, PROMPT)
    model = cluster.load(model_dir)
    cfg = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=16, use_async_batching=overlap)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        first = m.get_result(m.add_request(PROMPT, max_new_tokens=3, eos_token_id=-1), timeout=60)
        hits = m.engine.blocks.prefix_hit_blocks
        scored = m.get_result(m.add_request(PROMPT, max_new_tokens=3, eos_token_id=-1, prompt_logprobs=TOP),
                              timeout=60)
        assert m.engine.blocks.prefix_hit_blocks == hits  # the scoring request took no cached page
        again = m.get_result(m.add_request(PROMPT, max_new_tokens=3, eos_token_id=-1), timeout=60)
        assert m.engine.blocks.prefix_hit_blocks > hits  # ... though the cache held the prefix
        zero = m.get_result(m.add_request(PROMPT[:20], max_new_tokens=1, eos_token_id=-1, prompt_logprobs=0),
                            timeout=60)
    check_against(scored, ref)
    assert first.prompt_logprobs is None and again.prompt_logprobs is None
    assert scored.generated_tokens == first.generated_tokens == again.generated_tokens
    assert zero.prompt_logprobs[1:] == pytest.approx(ref[0][:19], abs=1e-4)
    assert all(list(t) == [] for t in zero.prompt_top_logprobs)


@pytest.mark.parametrize("arch", ["gemma2", "granite"])
def test_prompt_logprobs_score_the_familys_logits(make_checkpoint, arch):
    """The shards score the logits sampling sees: Gemma 2's final softcap (a native family: `CausalLM.project`),
    granite's logits scaling (the generic path: transformers' own forward gives the logits)."""
    model_dir = make_checkpoint(arch)
    ref = reference(model_dir, PROMPT)
    model = cluster.load(model_dir)
    cfg = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=16)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        scored = m.get_result(m.add_request(PROMPT, max_new_tokens=1, eos_token_id=-1, prompt_logprobs=TOP),
                              timeout=60)
    check_against(scored, ref)


def test_prompt_logprobs_batched_with_decodes(model_dir):
    """A scoring request joins a batch that decodes other requests: both are exact, in one manager."""
    ref = reference(model_dir, PROMPT)
    model = cluster.load(model_dir)
    cfg = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=24, use_async_batching=True)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        plain_alone = m.get_result(m.add_request(PROMPT[:9], max_new_tokens=12, eos_token_id=-1), timeout=60)
        busy = m.add_request(PROMPT[:9], max_new_tokens=12, eos_token_id=-1)
        scored = m.add_request(PROMPT, max_new_tokens=2, eos_token_id=-1, prompt_logprobs=TOP)
        busy_out, scored_out = m.get_result(busy, timeout=60), m.get_result(scored, timeout=60)
    check_against(scored_out, ref)
    assert busy_out.generated_tokens == plain_alone.generated_tokens


def test_prompt_logprobs_refusals(model_dir):
    model = cluster.load(model_dir)
    with model.continuous_batching_context_manager(
            continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16)) as m:
        for bad in (21, -1, "2"):
            with pytest.raises(RequestRejected) as e:
                m.add_request(PROMPT, max_new_tokens=1, prompt_logprobs=bad)
            assert e.value.code == Code.BAD_FIELD and "prompt_logprobs" in e.value.message
        with pytest.raises(RequestRejected) as e:
            m.build_request(PROMPT, max_new_tokens=2, prompt_logprobs=0, num_return_sequences=2)
        assert e.value.code == Code.UNSUPPORTED
        with pytest.raises(RequestRejected) as e:
            m.build_request(PROMPT, max_new_tokens=4, prompt_logprobs=0, resume_tokens=[5])
        assert e.value.code == Code.UNSUPPORTED


def test_echo_logprobs_shape_and_wire_field():
    """The gateway's echo shaping (launch/gateway/echo_logprobs.py) and the submit's range check, in process."""
    from cluster.outputs import GenerationOutput
    from cluster.protocol import ProtocolError, parse_submit
    from launch.gateway.echo_logprobs import joined, prompt_logprobs

    out = GenerationOutput("r", prompt_ids=[5, 6, 7], prompt_logprobs=[None, -1.5, float("-inf")],
                           prompt_top_logprobs=[[], [[9, -0.5]], [[8, -0.1]]])
    got = prompt_logprobs(out, lambda t: f"<{t}>")
    assert got == {"tokens": ["<5>", "<6>", "<7>"], "token_logprobs": [None, -1.5, -9999.0], "text_offset": [0, 3, 6],
                   "top_logprobs": [None, {"<9>": -0.5, "<6>": -1.5}, {"<8>": -0.1, "<7>": -9999.0}]}
    both = joined(got, {"tokens": ["<1>"], "token_logprobs": [-0.2], "text_offset": [9], "top_logprobs": [{}]})
    assert both["tokens"][-1] == "<1>" and len(both["token_logprobs"]) == 4
    assert parse_submit({"input_ids": [1], "prompt_logprobs": 3}).prompt_logprobs == 3
    assert parse_submit({"input_ids": [1]}).prompt_logprobs is None
    for bad in (21, -1, "2", True):
        with pytest.raises(ProtocolError) as e:
            parse_submit({"input_ids": [1], "prompt_logprobs": bad})
        assert e.value.code == Code.BAD_FIELD


def test_runner_returns_scored_positions_after_sampled_rows(make_checkpoint):
    """The runner's logits: sampled rows' last positions, then every position of each SCORE_ALL row; a decode-only
    plan replayed by a graph (CPU stand-in) gives what the eager runner gives."""
    import numpy as np

    from cluster.plan import SAMPLE_LAST, SCORE_ALL, StepPlan
    from tests.test_graphs import decode_plan, graph_runner, prefill_plan

    model = cluster.load(make_checkpoint("qwen3"))
    runner, eager = graph_runner(model)
    lens = [5, 19, 33]
    for r in (runner, eager):
        r.execute(prefill_plan(lens))
    plan = decode_plan([7, 8, 9], [n + 1 for n in lens], sample=[SAMPLE_LAST, SCORE_ALL, SAMPLE_LAST | SCORE_ALL])
    got, want = runner.execute(plan), eager.execute(plan)
    assert got.shape == (4, model.config.vocab_size) and runner.graph_stats["replays"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], got[3])  # row 2: sampled (second) and scored (last) at its one position
    whole = eager.execute(decode_plan([7, 8, 9], [n + 1 for n in lens]))  # every row sampled
    torch.testing.assert_close(got[[0, 2, 1]], whole, rtol=1e-5, atol=1e-5)  # rows 0, 1, 2 by their positions
    chunk = StepPlan(input_ids=np.arange(5, 15, dtype=np.int32), q_lens=np.array([1, 9], np.int32),
                     kv_lens=np.array([lens[0] + 2, 9], np.int32), sample=np.array([SAMPLE_LAST, SCORE_ALL], np.int32),
                     block_tables=np.stack([np.arange(0, 8), np.arange(24, 32)]).astype(np.int32))
    assert eager.execute(chunk).shape == (1 + 9, model.config.vocab_size)
