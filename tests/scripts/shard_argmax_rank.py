"""One rank of the shard-argmax test: the LM head's greedy choice on the vocab shards against the driver's on the
gathered logits, for logits built to catch the edge cases (`edge_logits`). Rank 0 writes a JSON record to OUT:
every rank's tokens and best logits (all-gathered), and the sampler's tokens and invalid rows on the gathered
logits.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

VOCAB = 11  # odd: at TP=2 the last shard holds one padding column


def edge_logits(size: int) -> torch.Tensor:
    """[8, rows * size] logits (padding columns included): random rows, a tie across shards, a tie inside a shard,
    a NaN, all -inf, +inf, and a padding column larger than every real logit in every row."""
    rows = -(-VOCAB // size)
    x = torch.randn(8, rows * size, generator=torch.Generator().manual_seed(3))
    x[:, VOCAB:] = 100.0  # padding must never win
    x[0, 2] = x[0, 8] = 50.0  # equal maxima on both shards at TP=2: the lower id
    x[1, 7] = x[1, 9] = 50.0  # equal maxima in one shard
    x[2, 3] = float("nan")
    x[3, :VOCAB] = float("-inf")
    x[4, 5] = float("inf")
    return x


def main(out: str) -> None:
    from driver.engine.logits_processing import SampleRow
    from driver.engine.request import SamplingParams
    from driver.engine.sampler import pick
    from worker.layers import ParallelLMHead, Shard

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    head = ParallelLMHead(VOCAB, 4, Shard(rank, size, dist.group.WORLD), torch.float32)
    full = edge_logits(size)
    local = full[:, head.start:head.start + head.rows]
    chosen = head.argmax(local)
    every = [torch.empty_like(chosen.tokens) for _ in range(size)]
    dist.all_gather(every, chosen.tokens)
    gathered = head.gather(local)
    if rank == 0:
        rows = [SampleRow(f"r{i}", SamplingParams(), 0, 0) for i in range(full.shape[0])]
        picks = pick(gathered, rows)
        record = {"tokens": [e.tolist() for e in every], "best": chosen.best.tolist(),
                  "pick_tokens": picks.tokens.tolist(), "pick_invalid": picks.invalid.tolist(),
                  "gathered_width": gathered.shape[-1]}
        with open(out, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
