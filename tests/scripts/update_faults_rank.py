"""Weight updates that one rank refuses or fails, at TP=2 under torchrun, with the manager's loop running.

Run with LOCKSTEP_FAULTS = FAULTS (below): rank 1 refuses its first four updates (a tensor whose values
raise an exception with an empty message, an injected fault through the front door's path and again through
every rank's caller, an injected exception with an empty message), then holds a wrong weight version, then
an update goes through (loop path) and another inside a pause, and the eighth fails half-way through the
copy on rank 1 (after five updates that each follow a pause at once: a caller must not take its loop's parking,
which lasts a moment after the pause, for a pause of its own). Every rank writes what each update did to `<out>.rank<N>` after every step, so a test
reads how far things went even if a step hangs or crashes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from safetensors.torch import load_file

import cluster
from tests.scripts.update_rank import prompts

FAULTS = ("stage_weights:rank=1:attempt=2,stage_weights:rank=1:attempt=3,stage_weights_silent:rank=1:attempt=4,"
          "apply_weights:rank=1:attempt=13")


class NoMessage:
    """A tensor stand-in of the right shape whose values cannot be read: reading them raises ValueError()
    with an empty message (no fault point needed, so this case also runs on older code)."""

    def __init__(self, t):
        self.t = t

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, index):
        return self

    @property
    def shape(self):
        raise ValueError()


def outcome(update, *args) -> dict:
    """What an update did on this rank: returned (its result) or raised (type name, code, rank, message)."""
    try:
        return {"raised": None, "result": update(*args)}
    except Exception as e:  # the test checks the type's name and code, so this also runs on older code
        return {"raised": type(e).__name__, "code": getattr(e, "code", None), "rank": getattr(e, "rank", None),
                "message": str(e)}


def barrier(out: str, name: str, rank: int, world: int = 2, timeout: float = 60.0) -> None:
    """Every rank writes `<out>.<name>.rank<N>` and waits until all have: a barrier that uses no process
    group (the manager's loop owns those while it runs)."""
    open(f"{out}.{name}.rank{rank}", "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f"{out}.{name}.rank{r}") for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every rank arrived in {timeout:.0f}s")
        time.sleep(0.01)


def main(dir_a: str, dir_b: str, out: str) -> None:
    model = cluster.load(dir_a)
    rank = model.groups.rank
    rec: dict = {"rank": rank}

    def save() -> None:
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump(rec, f)

    def generate(m, key: str) -> None:
        ids = m.add_requests(prompts(3, 5), max_new_tokens=8)
        if ids is not None:
            rec[key] = [m.get_result(i, timeout=60).generated_tokens for i in ids]

    cfg = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=128, cpu_group_timeout=20)
    m = model.init_continuous_batching(continuous_batching_config=cfg)
    m.warmup()
    m.start()
    try:
        # 0. inside a pause, rank 1's tensors hold one that raises an exception with an empty message
        state = load_file(os.path.join(dir_b, "model.safetensors"))
        if rank == 1:
            name = "model.layers.1.mlp.down_proj.weight"
            state[name] = NoMessage(state[name])
        with m.pause():
            rec["no_message"] = outcome(m.update_weights, state)
        save()
        # 1. through the front door's path (the driver alone asks): a dict naming the refusing rank
        if m.is_driver:
            from worker.weights import UpdateCall

            got, done = {}, threading.Event()
            m.update_weights_async(UpdateCall("checkpoint", path=dir_b),
                                   lambda r: (got.update(r), done.set()))
            rec["async"] = got if done.wait(60) else "no answer"
        save()
        # 2. and 3. every rank's caller raises the same error naming rank 1; nothing changed
        rec["refused"] = outcome(m.update_weights, dir_b)
        save()
        rec["silent"] = outcome(m.update_weights, dir_b)
        save()
        # 4. rank 1 holds another weight version than the driver: it votes against, naming both numbers.
        # The driver's call starts the update on every rank, so rank 1 changes its version before the driver
        # calls, and changes it back before the driver's next update (file barriers: the groups are the loop's).
        if rank == 1:
            m.updates.version = 7
        barrier(out, "version_set", rank)
        rec["version"] = outcome(m.update_weights, dir_b)
        if rank == 1:
            m.updates.version = 0
        barrier(out, "version_reset", rank)
        generate(m, "still_a")
        save()
        # 5. an update that goes through; every rank's version moves to 1
        rec["applied"] = outcome(m.update_weights, dir_b)
        rec["version_after_applied"] = getattr(getattr(m, "updates", None), "version", None)
        generate(m, "after_b")
        save()
        # 6. an update right after a pause goes through the loop, B again (versions 2 to 6). Each pause here
        # follows an update: cluster/pause.py merges a worker's pause that follows another at once into it.
        rec["after_pause"] = []
        for _ in range(5):
            with m.pause():
                pass
            rec["after_pause"].append(outcome(m.update_weights, dir_b))
        save()
        # 7. inside a pause (no plan carries the version: the driver's is fetched); back to A, version 7
        with m.pause():
            rec["paused"] = outcome(m.update_weights, dir_a)
        rec["version_after_paused"] = getattr(getattr(m, "updates", None), "version", None)
        generate(m, "after_a")
        save()
        # 8. rank 1 fails half-way through the copy: weights now differ; every rank raises, the loop ends
        inflight = m.add_request(prompts(1, 6)[0], max_new_tokens=400)
        rec["diverged"] = outcome(m.update_weights, dir_b)
        m.join(timeout=30)
        rec["loop_running_after"] = m.is_running()
        if inflight is not None:
            final = m.get_result(inflight, timeout=30)
            rec["inflight"] = None if final is None else {"status": int(final.status), "error": final.error}
        rec["again"] = outcome(m.update_weights, dir_a)
        save()
    finally:
        m.stop(block=True, timeout=30)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
