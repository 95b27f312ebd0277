"""Hot weight updates under load on every rank (TP=1 directly, TP=2 under torchrun): checkpoint A -> B with
kv_policy=recompute and keep, bad updates that must change nothing, and one rank's tensors of a wrong shape.
Rank 0 writes a record the test checks against transformers."""

from __future__ import annotations

import json
import random
import shutil
import sys
import time

import cluster

N_INFLIGHT = 32


def prompts(n: int, seed: int, vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def wait_tokens(m, at_least: int) -> None:
    if m.is_driver:
        while m.stats()["tokens_generated"] < at_least:
            time.sleep(0.005)


def collect(m, ids) -> list[dict]:
    if not m.is_driver:
        return []
    outs = [m.get_result(i, timeout=300) for i in ids]
    return [{"id": o.request_id, "prompt": o.prompt_ids, "tokens": o.generated_tokens, "status": int(o.status),
             "versions": [list(v) for v in o.weight_versions]} for o in outs]


def refused(update, *args) -> dict:
    """The error a refused update raises on this rank, as a record (or what it returned, if it did not raise)."""
    try:
        return {"raised": None, **update(*args)}
    except Exception as e:  # the test checks the type's name and code (so this runs on older code too)
        return {"raised": type(e).__name__, "code": getattr(e, "code", None), **getattr(e, "result", {})}


def run(dir_a: str, dir_b: str, work: str) -> dict:
    model = cluster.load(dir_a)
    rec: dict = {"rank": model.groups.rank}
    cfg = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=64)
    truncated = f"{work}/truncated-rank{model.groups.rank}"
    shutil.copytree(dir_b, truncated, dirs_exist_ok=True)
    with open(f"{truncated}/model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 4096)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        # 1. A -> B under load, in-flight KV recomputed
        ids = m.add_requests(prompts(N_INFLIGHT, 1), max_new_tokens=24)
        wait_tokens(m, 2 * N_INFLIGHT)
        rec["recompute"] = m.update_weights(dir_b, kv_policy="recompute")
        after = m.add_requests(prompts(4, 2), max_new_tokens=16)
        rec["inflight_recompute"], rec["after_b"] = collect(m, ids), collect(m, after)
        # 2. B -> A under load, in-flight KV kept
        mark = m.stats().get("tokens_generated", 0)
        ids = m.add_requests(prompts(N_INFLIGHT, 3), max_new_tokens=24)
        wait_tokens(m, mark + 2 * N_INFLIGHT)
        rec["keep"] = m.update_weights(dir_a, kv_policy="keep")
        rec["inflight_keep"] = collect(m, ids)
        # 3. bad updates change nothing anywhere
        rec["missing"] = refused(m.update_weights, f"{work}/no-such-checkpoint")
        rec["truncated"] = refused(m.update_weights, truncated)
        with m.pause():  # rank 1 (or rank 0 alone at TP=1) hands over a tensor of the wrong shape
            state = {k: v.clone() for k, v in
                     __import__("transformers").AutoModelForCausalLM.from_pretrained(dir_b).state_dict().items()}
            if model.groups.rank == model.groups.world_size - 1:
                state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"][:, :-1]
            rec["wrong_shape"] = refused(m.update_weights, state)
        still_a = m.add_requests(prompts(4, 4), max_new_tokens=16)
        rec["still_a"] = collect(m, still_a)
        rec["stats"] = m.stats()
    return rec


if __name__ == "__main__":
    record = run(sys.argv[1], sys.argv[2], sys.argv[3])
    with open(f"{sys.argv[3]}/update.rank{record['rank']}.json", "w") as f:
        json.dump(record, f)
