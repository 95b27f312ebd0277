"""One rank of the n-samples tests at TP=2 (tests/test_samples.py): every rank runs every scenario in order;
each rank writes a JSON record next to `out`.

- `greedy`: generate_batch with num_return_sequences=N_SAMPLES (top_k=1 sampling: transformers' GenerationConfig
  refuses greedy with n > 1), serial and overlapped: every sample's tokens, the output order, the stats.
- `seeded`: the same with temperature sampling and an engine seed, then the children's ids submitted as ordinary
  requests through one manager (no n): a child must draw what an independent request of its id draws.
- `pressure`: a cache too small for a group of GROUP samples (preemption by recompute, then with a host pool),
  a child cancelled after its first token, and a parent cancelled before its fork: the free page count at the end.
"""

from __future__ import annotations

import json
import sys

from transformers import GenerationConfig

import cluster
from cluster.samples import child_id

N_SAMPLES, NEW_TOKENS, PAGE = 4, 12, 16
GROUP = 8  # samples of the pressure scenario
SEED = 2027


def prompts(vocab: int) -> list[list[int]]:
    """Lengths 40 (its last page partly filled at the fork: copied), 33 (two full pages: nothing copied), 5 (only
    a partial page) and 1 (nothing to share)."""
    return [[(7 * i + 3 * n) % (vocab - 3) + 3 for i in range(n)] for n in (40, 33, 5, 1)]


def config(**extra) -> cluster.ContinuousBatchingConfig:
    return cluster.ContinuousBatchingConfig(**{"page_size": PAGE, "max_batch_tokens": 64, "seed": SEED, **extra})


def greedy_config() -> GenerationConfig:
    return GenerationConfig(do_sample=True, top_k=1, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                            num_return_sequences=N_SAMPLES)


def sampled_config(n: int = N_SAMPLES) -> GenerationConfig:
    return GenerationConfig(do_sample=True, temperature=1.3, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                            num_return_sequences=n)


def batch(model, gen: GenerationConfig, **extra) -> dict:
    out = model.generate_batch(prompts(model.config.vocab_size), generation_config=gen,
                               continuous_batching_config=config(**extra))
    assert all(o.error is None for o in out.values()), [o.error for o in out.values()]
    return {"ids": list(out), "tokens": [o.generated_tokens for o in out.values()], "stats": model.last_stats}


def independent(model, ids: list[str]) -> dict[str, list[int]]:
    """The children's ids as ordinary requests (sampled_config without n), each with its prompt."""
    ps = prompts(model.config.vocab_size)
    m = model.init_continuous_batching(sampled_config(1), config())
    m.wants_results = True
    m.start()
    for rid in ids:
        m.add_request(ps[int(rid.split("__")[0].split("_")[1])], request_id=rid)
    got = finals(m, len(ids))
    m.stop()
    m.destroy()
    return {k: v.generated_tokens for k, v in got.items()}


def finals(m, n: int) -> dict:
    got = {}
    while len(got) < n:
        out = m.get_result(timeout=120)
        assert out is not None, f"only {len(got)} of {n} outputs came"
        if out.is_finished():
            got[out.request_id] = out
    return got


def pressure(model, **extra) -> dict:
    """GROUP greedy samples of a 40-token prompt in 9 pages of 16 (each sample needs 4 at its longest), a child
    cancelled after its first token; a second group whose parent is cancelled before its fork."""
    p = prompts(model.config.vocab_size)[0]
    gen = GenerationConfig(do_sample=True, top_k=1, max_new_tokens=20, eos_token_id=None)
    m = model.init_continuous_batching(gen, config(num_blocks=9, max_batch_tokens=48, **extra))
    m.wants_results = True
    m.start()
    rec: dict = {}
    if m.is_driver:
        m.add_request(p, request_id="g", num_return_sequences=GROUP, streaming=True)
        first = m.get_result(child_id("g", 2), timeout=120)
        m.cancel_request(child_id("g", 2))
        m.hold_scheduling(True)  # no step between the add and the cancel: "h" ends before its fork
        m.add_request(p, request_id="h", num_return_sequences=3)
        m.cancel_request("h")  # its children go on alone
        m.hold_scheduling(False)
        rec["cancelled_child_first_tokens"] = len(first.generated_tokens)
    got = finals(m, GROUP + 3)
    rec["outputs"] = {k: [int(o.status), o.generated_tokens, o.finish_reason] for k, o in sorted(got.items())}
    rec["stats"] = m.stats()
    m.stop()
    m.destroy()
    return rec


if __name__ == "__main__":
    model_dir, out_path = sys.argv[1:3]
    model = cluster.load(model_dir)
    rec = {"greedy": batch(model, greedy_config()),
           "greedy_overlap": batch(model, greedy_config(), use_async_batching=True, decode_burst=4),
           "seeded": batch(model, sampled_config())}
    rec["independent"] = independent(model, [i for i in rec["seeded"]["ids"] if "__child#" in i])
    rec["pressure"] = pressure(model)
    rec["pressure_offload"] = pressure(model, cpu_offload_space=0.01)
    with open(f"{out_path}.rank{model.groups.rank}", "w") as f:
        json.dump(rec, f)
