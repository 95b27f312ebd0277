"""A script written against transformers' continuous-batching API. It runs unchanged on Lockstep: only the
line that loads the model differs (`cluster.load(path)` in place of `AutoModelForCausalLM.from_pretrained`).

    python docs/examples/transformers_api.py transformers models/tiny-llama
    python docs/examples/transformers_api.py lockstep models/tiny-llama
    torchrun --nproc-per-node 2 docs/examples/transformers_api.py lockstep models/tiny-llama

It prints one JSON line of the tokens it generated (rank 0 only under torchrun).
"""

import json
import os
import sys

from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig


def load(engine: str, path: str):
    if engine == "lockstep":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
        import cluster

        return cluster.load(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype="float32")


def wait_for(manager, request_id):
    """The final output of one request (get_result returns None while others are ahead of it)."""
    while True:
        result = manager.get_result(request_id=request_id, timeout=1)
        if result is not None and result.is_finished():
            return result


def main(engine: str, path: str) -> None:
    model = load(engine, path)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=0)
    # a KV cache the size of the job (both engines otherwise size theirs from free memory: GBs on a CPU host)
    cache = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)
    prompts = [[1, 5, 9, 13, 17], [1, 7, 7, 7], [1, 300, 200, 100, 50, 25]]

    # 1. one call for a whole batch
    batch = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cache)
    tokens = {"batch": [out.generated_tokens for out in batch.values()]}

    # 2. the manager: requests one by one, then a pause (where weights could be updated in place)
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cache) as manager:
        rid = manager.add_request([1, 4, 4, 4, 4], max_new_tokens=6)
        if rid is not None:  # the TP driver
            tokens["request"] = wait_for(manager, rid).generated_tokens
        with manager.pause():
            pass
        rid = manager.add_request([1, 8, 16], max_new_tokens=6)
        if rid is not None:
            tokens["after_pause"] = wait_for(manager, rid).generated_tokens

    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(tokens))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
