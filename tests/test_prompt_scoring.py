"""Prompt scores on the vocabulary shards (worker/prompt_scoring.py): each shard's reduction, combined on rank 0,
equals the full logits' log-softmax (the target's logprob, the top k with equal logits by lowest id, also at the
k-th place), with padded shards, targets in every shard and none, at TP 1 to 3; the plan carries the targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.plan import SAMPLE_LAST, SCORE_ALL, SCORE_PROMPT, StepPlan, logits_rows, plan_from_parts
from worker.layers import ParallelLMHead, Shard
from worker.prompt_scoring import CHUNK_ROWS, combine, reduce_chunk, score_on_shards, score_targets


def full_scores(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """From the whole [n, V] logits: each target's logprob (-inf for none), the top k (value, then lowest id)."""
    logsm = logits.log_softmax(-1)
    chosen = torch.where(targets >= 0, logsm.gather(1, targets.clamp(0)[:, None])[:, 0], float("-inf"))
    ids = np.stack([np.lexsort((np.arange(row.shape[0]), -row))[:k] for row in logsm.numpy()])
    return chosen, np.take_along_axis(logsm.numpy(), ids, 1), ids


def on_shards(logits: torch.Tensor, targets: torch.Tensor, tp: int, k: int):
    """Each of `tp` vocabulary shards (the last padded with logits larger than any real one) reduced, combined."""
    vocab = logits.shape[1]
    rows = -(-vocab // tp)
    padded = torch.cat([logits, logits.new_full((logits.shape[0], rows * tp - vocab), 1e4)], 1)
    parts = []
    for rank in range(tp):
        start = rank * rows
        cols = max(0, min(rows, vocab - start))
        parts.append(reduce_chunk(padded[:, start:start + cols], targets, start, vocab, k))
    return combine(torch.stack(parts), k)


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("ties", [False, True])
def test_shards_combine_to_the_full_log_softmax(tp, ties):
    gen = torch.Generator().manual_seed(tp + 10 * ties)
    vocab, n, k = 37, 24, 5
    logits = (torch.randint(0, 3, (n, vocab), generator=gen).float() if ties  # ties everywhere, across the cut too
              else torch.randn(n, vocab, generator=gen) * 3)
    rows = -(-vocab // tp)
    targets = torch.tensor([(i * 7) % vocab for i in range(n - 2)] + [-1, vocab - 1])  # in every shard; none
    assert {int(t) // rows for t in targets if t >= 0} == set(range(tp))
    got = on_shards(logits, targets, tp, k)
    chosen, values, ids = full_scores(logits, targets, k)
    torch.testing.assert_close(got.chosen, chosen, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.top_values.numpy(), values, rtol=0, atol=1e-5)
    assert got.top_ids.tolist() == ids.tolist()
    assert on_shards(logits, targets, tp, 0).top_ids.shape == (n, 0)


def test_small_shards_pad_after_every_real_token():
    """A k larger than a shard (7 tokens over 3 ranks: 3, 3, 1 columns): its padding never enters the top k."""
    logits = torch.full((2, 7), float("-inf"))
    logits[0, 6], logits[1, 2] = 1.0, 0.0
    got = on_shards(logits, torch.tensor([6, 2]), 3, 7)
    assert got.top_ids.tolist() == [[6, 0, 1, 2, 3, 4, 5], [2, 0, 1, 3, 4, 5, 6]]
    assert got.chosen.tolist() == [0.0, 0.0]


def test_score_on_shards_projects_in_chunks():
    """TP=1 through the LM head: more positions than a chunk, the same as the whole projection's log-softmax."""
    gen = torch.Generator().manual_seed(0)
    head = ParallelLMHead(50, 16, Shard(), torch.float32)
    head.weight.data.copy_(torch.randn(50, 16, generator=gen))
    hidden = torch.randn(CHUNK_ROWS + 9, 16, generator=gen)
    targets = torch.randint(0, 50, (hidden.shape[0],), generator=gen)
    got = score_on_shards(head, head, hidden, targets, 3)
    chosen, values, ids = full_scores(head(hidden), targets, 3)
    torch.testing.assert_close(got.chosen, chosen, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.top_values.numpy(), values, rtol=0, atol=1e-5)
    assert got.top_ids.tolist() == ids.tolist()


def test_plan_carries_the_targets():
    """Row 1 (SCORE_PROMPT) scores its next input ids, then `score_next`; row 2 (the prompt's end) ends in -1."""
    plan = StepPlan(input_ids=np.array([5, 10, 11, 12, 20, 21], np.int32), q_lens=np.array([1, 3, 2], np.int32),
                    kv_lens=np.array([9, 3, 8], np.int32), block_tables=np.zeros((3, 1), np.int32),
                    sample=np.array([SAMPLE_LAST | SCORE_ALL, SCORE_PROMPT, SCORE_PROMPT | SAMPLE_LAST], np.int32),
                    score_next=np.array([13, -1], np.int32), score_top=4)
    back = plan_from_parts(plan.header(), plan.payload(), b"")
    assert back.score_next.tolist() == [13, -1] and back.score_top == 4 and back.input_ids.tolist() == list(
        plan.input_ids)
    assert [r.tolist() for r in logits_rows(back.sample, back.q_lens)] == [[0, 2], [0], [1, 2]]
    assert score_targets(back).tolist() == [11, 12, 13, 21, -1]
    plain = plan_from_parts(StepPlan().header(), None, b"")
    assert plain.score_next.shape == (0,) and plain.score_top == 0
