"""The object `cluster.load` returns, on every rank at TP=2 under torchrun: what transformers scripts touch
(parameters under transformers' names, this rank's shard of each, changed in place inside a pause), and
generate_batch's checks, which must raise the same error on every rank before any step.

Every rank writes `<out>.rank<N>` after every step (a test reads how far things went)."""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

import cluster

PROMPTS = [[1, 4, 9, 16, 25, 36], [1, 2, 3], [7, 7, 7, 7, 7, 7, 7, 7], [5, 1000, 17], [300, 301]]
CFG = dict(page_size=16, max_batch_tokens=64, cpu_group_timeout=20)
ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
COL_SPLIT = ("o_proj.weight", "down_proj.weight")


def my_part(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's part of a full tensor by the plain TP layout (written here, independently of Lockstep):
    rows split for column-parallel tensors and the vocabulary, columns for row-parallel weights, else whole.
    It holds for the tiny llama (4 heads, 2 KV heads, everything divisible by 2)."""
    if any(k in name for k in COL_SPLIT):
        dim = 1
    elif any(k in name for k in ROW_SPLIT):
        dim = 0
    else:
        return full
    n = full.shape[dim] // world
    return full.narrow(dim, rank * n, n)


def outcome(call) -> dict:
    try:
        out = call()
        return {"raised": None, "n": len(out), "tokens": [o.generated_tokens for o in out.values()]}
    except Exception as e:  # compared by type name, code and text across ranks
        return {"raised": type(e).__name__, "code": getattr(e, "code", None), "message": str(e)}


def main(dir_a: str, dir_b: str, out: str) -> None:
    model = cluster.load(dir_a)
    rank, world = model.groups.rank, model.groups.world_size
    rec: dict = {"rank": rank}

    def save() -> None:
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump(rec, f)

    cb = cluster.ContinuousBatchingConfig(**CFG)
    # generate_batch's checks: the same ValueError on every rank, nothing hangs
    rec["too_long"] = outcome(lambda: model.generate_batch([PROMPTS[0], [3] * 1000], max_new_tokens=100,
                                                           continuous_batching_config=cb))
    save()
    rec["unknown_kwarg"] = outcome(lambda: model.generate_batch(PROMPTS[:2], max_new_tokens=4, foo=1,
                                                                continuous_batching_config=cb))
    save()
    # a batch larger than max_queue_size is fed as room appears
    small_queue = cluster.ContinuousBatchingConfig(max_queue_size=2, **CFG)
    rec["small_queue"] = outcome(lambda: model.generate_batch(PROMPTS, max_new_tokens=8,
                                                              continuous_batching_config=small_queue))
    save()

    # the model object
    rec["eval_is_self"] = model.eval() is model
    rec["dtype"], rec["device"] = str(model.dtype), str(model.device)
    rec["model_type"] = model.config.model_type
    rec["generation_config"] = type(model.generation_config).__name__
    named = dict(model.named_parameters())
    rec["names"] = list(named)
    rec["all_parameters"] = all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    rec["n_parameters"] = len(list(model.parameters()))
    sd = model.state_dict()
    rec["state_dict_names"] = sorted(sd)
    full_a, full_b = (load_file(os.path.join(d, "model.safetensors")) for d in (dir_a, dir_b))
    rec["shard_mismatch"] = [n for n, t in sd.items() if not torch.equal(t, my_part(n, full_a[n], rank, world))]
    rec["shard_of_mismatch"] = [n for n in sd if not torch.equal(model.shard_of(n, full_b[n]),
                                                                 my_part(n, full_b[n], rank, world))]
    save()

    with model.continuous_batching_context_manager(continuous_batching_config=cb) as m:
        ids = m.add_requests(PROMPTS, max_new_tokens=8)
        before = [m.get_result(i, timeout=60).generated_tokens for i in ids] if ids else None
        with m.pause():  # every rank copies B's values into its parameters in place
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(my_part(name, full_b[name], rank, world))
        ids = m.add_requests(PROMPTS, max_new_tokens=8)
        after = [m.get_result(i, timeout=60).generated_tokens for i in ids] if ids else None
    rec["before"], rec["after"] = before, after
    rec["state_dict_is_b"] = all(torch.equal(t, my_part(n, full_b[n], rank, world))
                                 for n, t in model.state_dict().items())
    save()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
