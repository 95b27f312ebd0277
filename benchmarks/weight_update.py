"""Hot weight update latency: time from the update request to the resumed loop, for each source, next to
the time to read the same bytes from a warm page cache (the floor).

    python benchmarks/weight_update.py --model models/small [--tp 1] [--repeats 3]

Sources measured:
- checkpoint: `Client.update_weights(dir)` against a running `lockstep serve` (every rank reads its slices);
- push: a trainer process pushes the same tensors through the update group (`launch.weight_push`);
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
    from launch.weight_push import push_weights
    from tests.serving import serve

    floor, nbytes = floor_read_seconds(second)
    state = {}
    for f in sorted(second.glob("*.safetensors")):
        state.update(load_file(str(f)))
    rows = []
    with serve(model_dir, tp=args.tp, ready_timeout=300) as server:
        client = Client(server.address, timeout=600)
        client.generate([1, 2, 3], max_new_tokens=2)
        times = {"checkpoint": [], "push": []}
        for i in range(args.repeats):
            target = second if i % 2 == 0 else model_dir
            start = time.perf_counter()
            r = client.update_weights(str(target))
            times["checkpoint"].append(time.perf_counter() - start)
            assert r["ok"], r
            start = time.perf_counter()
            r = push_weights(client, state)
            times["push"].append(time.perf_counter() - start)
            assert r["ok"], r
        client.close()
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

    print(f"\ncheckpoint {second}: {nbytes / 2**20:.1f} MiB, tp={args.tp}, {args.repeats} repeats, "
          f"cpus={os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'source':<20}{'median s':>10}{'min s':>10}{'x floor':>10}")
    print(f"{'floor: warm read':<20}{floor:>10.3f}{floor:>10.3f}{1.0:>10.1f}")
    for name, values in rows:
        med = statistics.median(values)
        print(f"{name:<20}{med:>10.3f}{min(values):>10.3f}{med / floor:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
