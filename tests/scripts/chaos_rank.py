"""Manager-level chaos on every rank (run under torchrun at TP=2): each scenario is a fresh manager on the
same model, and rank 0 (or every rank) records what happened for tests/test_chaos_loop.py to judge.

Scenarios: `heartbeat` (a held scheduler flooded with adds and cancels for three control timeouts),
`pause_gate` (a pause entered before any loop ran must not release a later one), `add_after_stop`,
`pause_reentry` (pauses back to back, a collective inside each), `worker_call` (a worker's update call
whose tensors arrive after the driver's CALL), and `worker_dies`
(LOCKSTEP_FAULTS kills rank 1's loop; the driver must name rank 1).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import cluster
from tests.workloads import mixed_prompts

CFG = dict(page_size=16, max_batch_tokens=64)


def config(**extra) -> cluster.ContinuousBatchingConfig:
    return cluster.ContinuousBatchingConfig(**(CFG | extra))


def heartbeat(model, rec: dict) -> None:
    m = model.init_continuous_batching(continuous_batching_config=config(cpu_group_timeout=2.0))
    m.start()
    if model.groups.is_driver:
        prompts = mixed_prompts(model.config.vocab_size)
        m.hold_scheduling(True)
        end, n = time.monotonic() + 6.0, 0
        while time.monotonic() < end:  # the inbox is never empty for long
            m.cancel_request(m.add_request(prompts[2], max_new_tokens=2))
            n += 1
            time.sleep(0.02)
        m.hold_scheduling(False)
        rid = m.add_request(prompts[3], max_new_tokens=4)
        out = m.get_result(rid, timeout=30)
        rec["heartbeat"] = {"flood": n, "status": None if out is None else int(out.status),
                            "tokens": None if out is None else out.generated_tokens, "error": repr(m.loop_error)}
    m.stop()
    m.destroy()


def pause_gate(model, rec: dict) -> None:
    m = model.init_continuous_batching(continuous_batching_config=config())
    with m.pause():  # no loop runs yet: nothing to park
        pass
    m.start()
    if model.groups.rank == 1:
        time.sleep(1.0)  # this rank's caller comes late: its loop must wait for it
    entered = threading.Event()

    def hold() -> None:
        with m.pause():
            rec["pause_gate_loop_alive"] = m.is_running()  # parked, not ended: the pause really holds it
            entered.set()
            time.sleep(0.3)

    threading.Thread(target=hold, daemon=True).start()
    rec["pause_gate_entered"] = entered.wait(15)
    m.stop()
    m.destroy()


def add_after_stop(model, rec: dict) -> None:
    m = model.init_continuous_batching(continuous_batching_config=config())
    m.start()
    m.stop()
    if model.groups.is_driver:
        t0 = time.monotonic()
        try:
            m.add_request([1, 2, 3], max_new_tokens=2)
            rec["add_after_stop"] = "accepted"
        except RuntimeError as e:
            rec["add_after_stop"] = type(e).__name__
        rec["add_after_stop_s"] = time.monotonic() - t0
    m.destroy()


def worker_call(model, rec: dict, dir_b: str) -> None:
    tensors = full_tensors(dir_b)
    m = model.init_continuous_batching(continuous_batching_config=config())
    m.start()
    if model.groups.rank == 1:
        time.sleep(2.0)  # the driver's CALL reaches this rank's loop before its caller hands the tensors over
    t0 = time.monotonic()
    result = m.update_weights(tensors)
    rec["worker_call"] = {"ok": bool(result.get("ok")), "seconds": time.monotonic() - t0}
    m.stop()
    m.destroy()


def pause_reentry(model, rec: dict, dir_a: str) -> None:
    """Pauses back to back with a collective inside each (an in-place update to the weights it already has):
    a caller that leaves one pause and enters the next before its loop wakes must get a park of its own."""
    tensors = full_tensors(dir_a)
    m = model.init_continuous_batching(continuous_batching_config=config(cpu_group_timeout=10.0))
    m.start()
    t0, done = time.monotonic(), 0
    for _ in range(6):
        with m.pause():
            m.update_weights(tensors)
        done += 1
    rec["pause_reentry"] = {"done": done, "seconds": time.monotonic() - t0}
    if model.groups.is_driver:
        rid = m.add_request(mixed_prompts(model.config.vocab_size)[3], max_new_tokens=4)
        rec["pause_reentry"]["tokens"] = m.get_result(rid, timeout=30).generated_tokens
    m.stop()
    m.destroy()


def full_tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def worker_dies(model, rec: dict) -> None:
    m = model.init_continuous_batching(continuous_batching_config=config(cpu_group_timeout=3.0))
    m.start()
    t0 = time.monotonic()
    if model.groups.is_driver:
        ids = m.add_requests(mixed_prompts(model.config.vocab_size)[:4], max_new_tokens=60)
        outs = [m.get_result(i, timeout=40) for i in ids]
        rec["worker_dies"] = [None if o is None else [int(o.status), o.error, getattr(o, "error_code", None)]
                              for o in outs]
    else:  # this rank's caller lives on (as a user's script would) while its loop is dead
        m.join(timeout=40)
        rec["worker_loop_error"] = repr(m.loop_error)
        time.sleep(8)
    rec["worker_dies_s"] = time.monotonic() - t0


def main() -> None:
    dir_a, dir_b, out, scenarios = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    # worker_dies: the device group's timeout must pass while the dead loop's process still lives
    model = cluster.load(dir_a, cpu_group_timeout=float(os.environ.get("CHAOS_GROUP_TIMEOUT", "300")))
    rec: dict = {"rank": model.groups.rank}
    for name in scenarios:
        if name == "worker_call":
            worker_call(model, rec, dir_b)
        elif name == "pause_reentry":
            pause_reentry(model, rec, dir_a)
        else:
            globals()[name](model, rec)
        with open(f"{out}.rank{model.groups.rank}", "w") as f:  # after each scenario: a later hang keeps it
            json.dump(rec, f)
    sys.stdout.flush()
    os._exit(0)  # a scenario may leave the group broken on purpose: do not wait in its teardown


if __name__ == "__main__":
    main()
