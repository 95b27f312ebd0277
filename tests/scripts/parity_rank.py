"""One rank of the TP parity test: run every scenario through generate_batch, rank 0 writes the outputs."""

import json
import sys

import cluster
from tests.workloads import NEW_TOKENS, SCENARIOS, prompts_for

model_dir, out_path = sys.argv[1], sys.argv[2]
model = cluster.load(model_dir)
results = {}
for name, (fields, kind) in SCENARIOS.items():
    prompts = prompts_for(kind, model.config.vocab_size)
    out = model.generate_batch(prompts, continuous_batching_config=cluster.ContinuousBatchingConfig(**fields),
                               max_new_tokens=NEW_TOKENS)
    results[name] = {"tokens": [o.generated_tokens for o in out.values()],
                     "status": [int(o.status) for o in out.values()], "stats": model.last_stats}
    # every rank gets the same dict
    assert len(out) == len(prompts), (model.groups.rank, name, len(out))
    if model.groups.rank == 1:
        results[name]["tokens_rank1"] = [o.generated_tokens for o in out.values()]
if model.groups.rank == 1:
    with open(out_path + ".rank1", "w") as f:
        json.dump({k: v["tokens_rank1"] for k, v in results.items()}, f)
if model.groups.rank == 0:
    with open(out_path, "w") as f:
        json.dump(results, f)
print(f"rank {model.groups.rank} done")
