"""TP parity with the compiled forwards: every rank runs generate_batch with the compile configs given as JSON;
rank 0 writes the tokens and what was compiled, rank 1 its own tokens.

    compile_rank.py OUT_PATH MODEL_DIR PROMPTS_JSON CONFIG_JSON NEW_TOKENS
"""

import json
import sys

import cluster


def main(out_path: str, model_dir: str, prompts: list[list[int]], fields: dict, new_tokens: int) -> None:
    model = cluster.load(model_dir)
    out = model.generate_batch(prompts, continuous_batching_config=cluster.ContinuousBatchingConfig(**fields),
                               max_new_tokens=new_tokens, persistent_manager=True)
    manager = model.persistent_manager
    forward = manager.runner.forwards
    result = {"tokens": [o.generated_tokens for o in out.values()],
              "shapes": {name: list(f.compile_s) for name, f in forward.compiled.items()},
              "warm_up_s": forward.warm_up_s}
    manager.destroy()
    rank = model.groups.rank
    with open(out_path + (f".rank{rank}" if rank else ""), "w") as f:
        json.dump(result, f)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]))
