"""One torchrun launch of the TP parity test for several checkpoints: every rank runs every scenario of every
checkpoint through generate_batch in every mode of tests/workloads.py MODES that runs it (MODE_SCENARIOS);
rank 0 writes the outputs, rank 1 its own tokens. One launch for all of them
saves a process start, an import of torch and a group rendezvous per checkpoint.

    parity_rank.py OUT_PREFIX NAME=DIR[=MODE,MODE[=SCENARIO,SCENARIO[=OPTION,OPTION]]] ...
        ->   OUT_PREFIX.NAME.json and OUT_PREFIX.NAME.json.rank1

(without =MODE,... a checkpoint runs every mode; without =SCENARIO,... every scenario). Options: `ep`, loaded with
expert parallelism; `updates:WORK`, then tests/moe_updates.py's weight updates from the sources in WORK, each rank
writing its record to OUT_PREFIX.NAME.updates.rank<r>.json.
"""

import json
import sys

import cluster
from tests.moe_updates import run_updates
from tests.workloads import MODES, NEW_TOKENS, SCENARIOS, mode_fields, prompts_for, runs_of


def run(model_dir: str, out_path: str, modes: list[str], scenarios: list[str], expert_parallel: bool,
        updates: str | None = None) -> None:
    model = cluster.load(model_dir, expert_parallel=expert_parallel)
    results = {}
    for key, (fields, kind), mode in [(f"{name}/{mode}", SCENARIOS[name], mode)
                                      for name, mode in runs_of(modes, scenarios)]:
        prompts = prompts_for(kind, model.config.vocab_size)
        config = cluster.ContinuousBatchingConfig(**fields, **mode_fields(mode, model_dir))
        out = model.generate_batch(prompts, continuous_batching_config=config, max_new_tokens=NEW_TOKENS)
        results[key] = {"tokens": [o.generated_tokens for o in out.values()],
                         "status": [int(o.status) for o in out.values()], "stats": model.last_stats}
        assert len(out) == len(prompts), (model.groups.rank, key, len(out))  # every rank gets the same dict
    rank = model.groups.rank
    if rank == 1:
        with open(out_path + ".rank1", "w") as f:
            json.dump({k: v["tokens"] for k, v in results.items()}, f)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    if updates:
        with open(out_path.removesuffix(".json") + f".updates.rank{rank}.json", "w") as f:
            json.dump(run_updates(model, updates), f)
    host = model.model.shard.host is not None  # the forward's all-reduce through shared memory (one host)
    print(f"rank {rank} done with {model_dir} host_all_reduce={host}", flush=True)


if __name__ == "__main__":
    prefix = sys.argv[1]
    for spec in sys.argv[2:]:
        name, model_dir, *chosen = spec.split("=")
        modes = chosen[0].split(",") if chosen else list(MODES)
        scenarios = chosen[1].split(",") if len(chosen) > 1 else list(SCENARIOS)
        options = chosen[2].split(",") if len(chosen) > 2 else []
        updates = next((o.removeprefix("updates:") for o in options if o.startswith("updates:")), None)
        run(model_dir, f"{prefix}.{name}.json", modes, scenarios, "ep" in options, updates)
