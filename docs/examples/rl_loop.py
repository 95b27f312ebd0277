"""An RL training loop on Lockstep: a trainer process improves a tiny policy by policy gradient on rewards from
rollouts that Lockstep serves at TP=2, pausing it, pushing the new weights and resuming it every step.

    python docs/examples/rl_loop.py --out /tmp/rl                  # 20 steps; writes rl_loop.png and rl_loop.json
    python docs/examples/rl_loop.py --out /tmp/rl --steps 3 --tp 2 # what tests/test_rl_loop.py runs

The task (docs/examples/rl_copy_task.py): copy K tokens; the reward is the share copied right. The starting
policy is trained by supervised steps for a moment only, so greedy decoding copies some tokens and sampling at
temperature 1 copies fewer. Every step:

1. rollouts: BATCH prompts, each sampled N times with one prefill (`n=N`), seeded, `max_weight_lag` set;
   the next step's rollouts are submitted before this step's weights are pushed (one step off-policy, the way
   asynchronous RL trainers overlap generation and training), so some are in flight during the push;
2. the trainer's update: REINFORCE with the group's mean reward as baseline (GRPO's advantage), on
   transformers' own LlamaForCausalLM, teacher-forced over the sampled tokens;
3. the sync: `client.pause(mode="keep")` (in-flight rollouts keep their KV), `push_weights` (every rank or
   none), `client.resume()`; its wall time is the step's sync time.

It prints a table (step, mean reward, greedy reward, loss, sync seconds, weight version, requests, stale) and
writes a PNG plot of reward and sync time per step (matplotlib) and a JSON record of every rollout: its tokens,
the weight version of every token and its finish reason, which tests/test_rl_loop.py checks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: cluster, launch
sys.path.insert(0, str(HERE))  # rl_copy_task

import torch  # noqa: E402

import rl_copy_task as task  # noqa: E402
from cluster.client import Client  # noqa: E402
from cluster.samples import sample_ids  # noqa: E402
from launch.local_server import local_server  # noqa: E402
from launch.weight_push import push_weights  # noqa: E402

PRESET = """
[continuous_batching]
page_size = 16
num_blocks = 64
max_batch_tokens = 256
cpu_group_timeout = 30.0
"""


def submit_rollouts(client: Client, prompts: list[list[int]], n: int, seed: int, max_weight_lag: int) -> list:
    """Every prompt sampled n times with one prefill: (prompt, the ids of its n samples) per prompt."""
    groups = []
    for i, prompt in enumerate(prompts):
        rid = client.submit(prompt, max_new_tokens=task.K, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            seed=seed * 1000 + i, n=n, max_weight_lag=max_weight_lag, eos_token_id=None)
        groups.append((prompt, sample_ids(rid, n)))
    return groups


def collect(client: Client, groups: list) -> list[dict]:
    """Wait for every sample of every group: one record each (tokens, per-token versions, finish reason)."""
    records = []
    for g, (prompt, ids) in enumerate(groups):
        for rid in ids:
            out = client.result(rid, timeout=300)
            tokens = list(out.generated_tokens)
            records.append(dict(group=g, request_id=rid, prompt=prompt, tokens=tokens,
                                versions=[out.version_of_token(i) for i in range(len(tokens))],
                                finish_reason=out.finish_reason, reward=task.reward(prompt, tokens)))
    return records


def policy_gradient_step(model, optimizer, records: list[dict]) -> float:
    """REINFORCE over the finished (not stale) samples, each token credited with the reward still to come from it
    (its own and the later positions' matches), less the same figure's mean over the samples of its prompt
    (GRPO's group baseline, per position). Returns the loss."""
    usable = [r for r in records if r["finish_reason"] != "stale" and len(r["tokens"]) == task.K]
    if not usable:
        return float("nan")
    to_come = torch.tensor([task.matches(r["prompt"], r["tokens"]) for r in usable], dtype=torch.float32)
    to_come = to_come.flip(-1).cumsum(-1).flip(-1) / task.K  # [samples, K]: the reward from each token on
    groups = torch.tensor([r["group"] for r in usable])
    baseline = torch.stack([to_come[groups == g].mean(0) for g in groups.tolist()])
    seqs = torch.tensor([r["prompt"] + r["tokens"] for r in usable])
    start = len(usable[0]["prompt"])
    logits = model(seqs[:, :-1]).logits[:, start - 1:]
    logp = torch.log_softmax(logits, -1).gather(-1, seqs[:, start:, None]).squeeze(-1)  # [samples, K]
    loss = -((to_come - baseline) * logp).sum(-1).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def sync(client: Client, model) -> tuple[float, dict]:
    """Pause every rank (in-flight requests keep their KV), push the weights, resume: (seconds, update result)."""
    t0 = time.perf_counter()
    client.pause(mode="keep")
    try:
        result = push_weights(client, {k: v.detach() for k, v in model.state_dict().items()})
    finally:
        client.resume()
    return time.perf_counter() - t0, result


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(steps, [r["reward"] for r in rows], marker="o", label="sampled (T=1)")
    a.plot(steps, [r["greedy"] for r in rows], marker="s", label="greedy")
    a.set(xlabel="step", ylabel="mean reward", title="reward", ylim=(0, 1.05))
    a.legend()
    b.bar(steps, [r["sync_s"] for r in rows])
    b.set(xlabel="step", ylabel="seconds", title="sync (pause + push + resume)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the policy, rl_loop.png, rl_loop.json")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="prompts a step")
    p.add_argument("--n", type=int, default=4, help="samples a prompt (one prefill each group)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pretrain-steps", type=int, default=40, help="supervised steps of the starting policy")
    p.add_argument("--max-weight-lag", type=int, default=1, help="versions a rollout may lag (docs/weights.md)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import LlamaForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    policy_dir = task.make_policy(args.out / "policy", steps=args.pretrain_steps, seed=args.seed)
    model = LlamaForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    held_out = task.make_prompts(random.Random(args.seed + 1), 64)
    rows, rollouts = [], []
    with local_server(policy_dir, args.tp, PRESET, env={"OMP_NUM_THREADS": "1"}) as server, \
            Client(server.address) as client:
        pending = submit_rollouts(client, task.make_prompts(rng, args.batch), args.n, 0, args.max_weight_lag)
        for step in range(args.steps):
            records = collect(client, pending)
            greedy = task.mean_reward(model.eval(), held_out)
            loss = policy_gradient_step(model.train(), optimizer, records)
            # the next step's rollouts start now, under the weights about to be replaced
            pending = submit_rollouts(client, task.make_prompts(rng, args.batch), args.n, step + 1,
                                      args.max_weight_lag)
            sync_s, result = sync(client, model)
            for r in records:
                r["step"] = step
            rollouts += records
            scored = [r["reward"] for r in records if r["finish_reason"] != "stale"] or [float("nan")]
            rows.append(dict(step=step, reward=sum(scored) / len(scored), greedy=greedy,
                             loss=loss, sync_s=sync_s, version=result["version"], requests=len(records),
                             stale=sum(r["finish_reason"] == "stale" for r in records)))
            print_row(rows[-1], first=step == 0)
        records = collect(client, pending)  # the last step's rollouts: none is left behind
        for r in records:
            r["step"] = args.steps
        rollouts += records
        stats = client.stats()
    plot(rows, args.out / "rl_loop.png")
    (args.out / "rl_loop.json").write_text(json.dumps(dict(args=dict(n=args.n, batch=args.batch, steps=args.steps,
                                                                      max_weight_lag=args.max_weight_lag),
                                                           rows=rows, rollouts=rollouts, stats=stats), default=str))
    print(f"wrote {args.out / 'rl_loop.png'} and {args.out / 'rl_loop.json'}")


def print_row(row: dict, first: bool) -> None:
    if first:
        print(f"{'step':>4} {'reward':>7} {'greedy':>7} {'loss':>8} {'sync s':>7} {'version':>7} {'requests':>8} "
              f"{'stale':>5}")
    print(f"{row['step']:>4} {row['reward']:>7.3f} {row['greedy']:>7.3f} {row['loss']:>8.4f} {row['sync_s']:>7.3f} "
          f"{row['version']:>7} {row['requests']:>8} {row['stale']:>5}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
