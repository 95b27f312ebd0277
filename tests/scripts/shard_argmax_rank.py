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


def main(out: str, how: str) -> None:
    from cluster.dist import init_groups
    from cluster.host_all_reduce import HostAllReduce
    from driver.engine.logits_processing import SampleRow
    from driver.engine.request import SamplingParams
    from driver.engine.sampler import pick
    from worker.layers import ParallelLMHead, Shard

    groups = init_groups(cpu_group_timeout=60.0, device="cpu")
    rank, size = groups.rank, groups.world_size
    host = HostAllReduce.join(groups) if how == "host" else None
    head = ParallelLMHead(VOCAB, 4, Shard(rank, size, groups.device_group, host), torch.float32)
    full = edge_logits(size)
    local = full[:, head.start:head.start + head.rows]
    chosen = head.argmax(local)
    every = [torch.empty_like(chosen.tokens) for _ in range(size)]
    dist.all_gather(every, chosen.tokens, group=groups.device_group)
    gathered = head.gather(local)
    if rank == 0:
        rows = [SampleRow(f"r{i}", SamplingParams(), 0, 0) for i in range(full.shape[0])]
        picks = pick(gathered, rows)
        record = {"tokens": [e.tolist() for e in every], "best": chosen.best.tolist(),
                  "pick_tokens": picks.tokens.tolist(), "pick_invalid": picks.invalid.tolist(),
                  "gathered_width": gathered.shape[-1], "host": host is not None}
        with open(out, "w") as f:
            json.dump(record, f)
    if host is not None:
        host.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gloo")
