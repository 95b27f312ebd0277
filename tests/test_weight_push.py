"""Weight updates from outside the cluster: a trainer process pushing tensors through the update group at
TP=2 (applied, refused, a rank's peak memory bounded by its shard plus one bucket, nothing left behind after
pushes in a row), and `lockstep update-weights` from the command line; `lockstep generate` offline from JSONL."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from cluster.client import Client
from tests.conftest import REPO, hf_greedy
from tests.serving import rank_pid, serve

PROMPTS = [[1, 4, 9, 16, 25, 36], [1, 2, 3], [7, 7, 7, 7, 7, 7, 7, 7]]


def trainer(address: str, dir_b: str, out: "mp.Queue", drop: str = "") -> None:
    """A separate process with its own copy of B's weights, as a training loop would have them (less the
    tensor `drop`, if named); puts push_weights' result, or the error it raised, in `out`."""
    from safetensors.torch import load_file

    from launch.weight_push import push_weights

    state = load_file(os.path.join(dir_b, "model.safetensors"))
    state.pop(drop, None)
    with Client(address) as c:
        try:
            out.put(push_weights(c, state, bucket_bytes=1 << 20))
        except Exception as e:  # by type name and code: the test process need not import torch's side
            out.put({"raised": type(e).__name__, "code": getattr(e, "code", None), "rank": getattr(e, "rank", None),
                     "message": str(e)})


def push(address: str, dir_b: str, drop: str = "") -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=trainer, args=(address, dir_b, q, drop))
    p.start()
    result = q.get(timeout=180)
    p.join(30)
    return result


@pytest.mark.slow
def test_trainer_pushes_weights_tp2(make_checkpoint, tmp_path):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    with serve(dir_a, tp=2) as s, Client(s.address) as c:
        assert [c.generate(p, max_new_tokens=8).generated_tokens for p in PROMPTS] == \
            [t[:8] for t in hf_greedy(dir_a, PROMPTS, 8)]
        # a push that lacks a tensor: every serving rank refuses, the trainer's push_weights raises
        refused = push(s.address, str(dir_b), drop="model.layers.0.mlp.up_proj.weight")
        assert refused["raised"] == "WeightUpdateError" and refused["code"] == "weight_update_failed", refused
        assert refused["rank"] == 0 and "rank 1: the push lacks 1 tensor(s)" in refused["message"], refused
        result = push(s.address, str(dir_b))
        assert result["ok"] and result["version"] == 1, result
        outs = [c.generate(p, max_new_tokens=8) for p in PROMPTS]
        assert [o.generated_tokens for o in outs] == [t[:8] for t in hf_greedy(dir_b, PROMPTS, 8)]
        assert all(o.weight_versions == [(0, 1)] for o in outs)
        assert c.stats()["weight_version"] == 1

        env = dict(os.environ, PYTHONPATH=str(REPO))
        cli = subprocess.run([sys.executable, "-m", "launch.cli", "update-weights", "--address", s.address,
                              str(dir_a)], capture_output=True, text=True, timeout=120, env=env)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["version"] == 2
        assert [c.generate(p, max_new_tokens=8).generated_tokens for p in PROMPTS] == \
            [t[:8] for t in hf_greedy(dir_a, PROMPTS, 8)]
        bad = subprocess.run([sys.executable, "-m", "launch.cli", "update-weights", "--address", s.address,
                              str(tmp_path / "missing")], capture_output=True, text=True, timeout=120, env=env)
        # refused: a non-zero exit naming the ranks (a result on stdout, or the client's error on stderr)
        assert bad.returncode != 0 and "rank 1:" in bad.stdout + bad.stderr, (bad.stdout, bad.stderr)


BIG = dict(hidden_size=512, intermediate_size=4096)  # about 110 MB of float32: memory shows above the noise


@pytest.fixture(scope="module")
def big(make_checkpoint):
    """A TP=2 server on checkpoint A (BIG) and this process as the trainer: (server, client, dirs, states)."""
    from safetensors.torch import load_file

    dirs = [make_checkpoint("llama", **BIG), make_checkpoint("llama", seed=1, **BIG)]
    states = [load_file(os.path.join(d, "model.safetensors")) for d in dirs]
    with serve(dirs[0], tp=2) as s, Client(s.address) as c:
        yield s, c, dirs, states


def proc_status(pid: int, key: str) -> int:
    """A size field of /proc/PID/status (VmRSS, VmHWM), in bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


@pytest.mark.slow
def test_a_push_stages_a_shard_plus_one_bucket(big):
    """Each rank's peak resident memory during a push (VmHWM, reset just before) grows by about its shard of
    the model plus one bucket, not by the whole model received into new tensors."""
    from launch.weight_push import push_weights

    s, c, dirs, states = big
    pids = [rank_pid(s, r) for r in range(2)]
    model_bytes = sum(t.nbytes for t in states[1].values())
    bucket = 1 << 20
    bound = model_bytes // 2 + bucket + (20 << 20)  # a rank's shard (norms are tiny) + one bucket + noise
    for i in range(2):
        rss = []
        for p in pids:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")  # reset the peak to the current resident size
            rss.append(proc_status(p, "VmRSS"))
        assert push_weights(c, states[1 - i], bucket_bytes=bucket)["ok"]
        extra = [proc_status(p, "VmHWM") - r for p, r in zip(pids, rss)]
        assert max(extra) <= bound, f"push {i}: peak grew by {[e >> 20 for e in extra]} MB, bound {bound >> 20} MB"


def proc_counts(pid: int | str) -> tuple[int, int]:
    """(threads, open file descriptors) of a process."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_pushes_in_a_row_leave_nothing_behind(big):
    """Eight pushes from this process (the trainer) into a TP=2 server: the update group is torn down on
    every member after each push, so no rank and not the trainer keeps its threads or sockets; each push
    is applied (the version moves) and the last one's weights serve."""
    from launch.weight_push import push_weights

    s, c, dirs, states = big
    pids = ["self"] + [rank_pid(s, r) for r in range(2)]
    first = push_weights(c, states[1], bucket_bytes=1 << 20)["version"]  # warm: lazily made threads
    before = [proc_counts(p) for p in pids]
    for i in range(8):
        assert push_weights(c, states[i % 2], bucket_bytes=1 << 20)["version"] == first + i + 1
    after = [proc_counts(p) for p in pids]
    for who, (t0, f0), (t1, f1) in zip(("trainer", "rank 0", "rank 1"), before, after):
        assert t1 <= t0 + 2 and f1 <= f0 + 4, f"{who}: threads {t0} -> {t1}, fds {f0} -> {f1}"
    assert [c.generate(p, max_new_tokens=8).generated_tokens for p in PROMPTS] == \
        [t[:8] for t in hf_greedy(dirs[1], PROMPTS, 8)]


@pytest.mark.slow
def test_offline_generate_from_jsonl(make_checkpoint, tmp_path):
    model = make_checkpoint("qwen3")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "--model", str(model), "--tp", "2",
                           "--input", str(src), "--output", str(dst), "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["generated_tokens"] for r in rows] == [t[:8] for t in hf_greedy(model, PROMPTS, 8)]
