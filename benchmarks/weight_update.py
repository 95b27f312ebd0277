"""Hot weight update latency: time from the update request to the resumed loop, for each source, next to
the time to read the same bytes from a warm page cache (the floor).

    python benchmarks/weight_update.py --model models/small [--tp 1] [--repeats 3]

Sources measured:
- checkpoint: `Client.update_weights(dir)` against a running `lockstep serve` (every rank reads its slices);
- push: a trainer process pushes the same tensors through the update group (`launch.weight_push`);
- handles: this process as a colocated trainer, its tensors in shared memory (`launch.weight_handles`), only
  handles on the wire; beside its floor, a memcpy of the same bytes in one process;
- partial checkpoint: `Client.update_weights(dir, partial=True)` of a checkpoint holding only the MLP weights,
  beside its own floor (a warm read of that checkpoint's bytes);
- in-process: `manager.update_weights(state_dict)` inside `manager.pause()` (TP=1, this process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def floor_read_seconds(model_dir: Path) -> tuple[float, int]:
    """Read every safetensors byte twice; the second (warm page cache) read is the floor."""
    files = sorted(model_dir.glob("*.safetensors"))
    total = 0
    for _ in range(2):
        start = time.perf_counter()
        total = 0
        for f in files:
            with open(f, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    total += len(chunk)
        took = time.perf_counter() - start
    return took, total


def floor_copy_seconds(nbytes: int, repeats: int = 3) -> float:
    """One memcpy of `nbytes` between two warm buffers in this process (the best of `repeats`)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return min(times)


def partial_checkpoint(model_dir: Path, state: dict) -> Path:
    """A checkpoint next to `model_dir` holding only `state`'s MLP weights (made once)."""
    out = model_dir.parent / (model_dir.name + "-mlp")
    if not (out / "model.safetensors").exists():
        from safetensors.torch import save_file

        out.mkdir(exist_ok=True)
        save_file({k: v for k, v in state.items() if ".mlp." in k}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(REPO / "models" / "small"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        from launch.make_model import make_model

        make_model(model_dir, arch="llama", size="small", seed=0)
    second = model_dir.parent / (model_dir.name + "-b")
    if not (second / "config.json").exists():
        from launch.make_model import make_model

        make_model(second, arch="llama", size="small", seed=1)

    from safetensors.torch import load_file

    from cluster.client import Client
    from launch.weight_handles import SharedBuckets, update_weights_by_handle
    from launch.weight_push import push_weights
    from tests.serving import serve

    nbytes = floor_read_seconds(second)[1]
    state = {}
    for f in sorted(second.glob("*.safetensors")):
        state.update(load_file(str(f)))
    partial_dir = partial_checkpoint(second, state)
    partial_bytes = floor_read_seconds(partial_dir)[1]
    rows = []
    with serve(model_dir, tp=args.tp, ready_timeout=300) as server, SharedBuckets(state) as shared:
        client = Client(server.address, timeout=600)
        client.generate([1, 2, 3], max_new_tokens=2)
        times: dict[str, list[float]] = {"checkpoint": [], "push": [], "handles": [], "partial checkpoint": []}
        calls = {"checkpoint": lambda i: client.update_weights(str(second if i % 2 == 0 else model_dir)),
                 "push": lambda i: push_weights(client, state),
                 "handles": lambda i: update_weights_by_handle(client, shared),
                 "partial checkpoint": lambda i: client.update_weights(str(partial_dir), partial=True)}
        floor_runs: dict[str, list[float]] = {"read": [], "copy": [], "partial read": []}
        for i in range(args.repeats + 1):  # the first round warms every path up and is not counted
            for name, call in calls.items():
                start = time.perf_counter()
                r = call(i)
                if i:
                    times[name].append(time.perf_counter() - start)
                assert r["ok"], r
            if i:  # the floors beside each round, so a loaded machine weighs on both alike
                floor_runs["read"].append(floor_read_seconds(second)[0])
                floor_runs["copy"].append(floor_copy_seconds(nbytes))
                floor_runs["partial read"].append(floor_read_seconds(partial_dir)[0])
        client.close()
    floor, copy_floor, partial_floor = (statistics.median(floor_runs[k]) for k in ("read", "copy", "partial read"))
    floors = {"handles": copy_floor, "partial checkpoint": partial_floor}
    rows += [(k, v) for k, v in times.items()]

    import cluster

    model = cluster.load(model_dir)
    with model.continuous_batching_context_manager() as m:
        inproc = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            with m.pause():
                r = m.update_weights(state)
            inproc.append(time.perf_counter() - start)
            assert r["ok"], r
    rows.append(("in-process (tp=1)", inproc))

    print(f"\ncheckpoint {second}: {nbytes / 2**20:.1f} MiB (MLP only: {partial_bytes / 2**20:.1f} MiB), "
          f"tp={args.tp}, {args.repeats} repeats, cpus={os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'source':<20}{'median s':>10}{'min s':>10}{'floor s':>10}{'x floor':>10}  floor")
    for name, values in rows:
        med, base = statistics.median(values), floors.get(name, floor)
        what = {"handles": "memcpy of the bytes", "partial checkpoint": "warm read of its bytes"}.get(
            name, "warm read of the checkpoint")
        print(f"{name:<20}{med:>10.3f}{min(values):>10.3f}{base:>10.3f}{med / base:>10.2f}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
