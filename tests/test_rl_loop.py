"""docs/examples/rl_loop.py for 3 steps at TP=2 (real processes): the mechanics an RL framework relies on. Every
rollout submitted comes back once (none lost, none duplicated), every token carries the weight version it was
sampled under, the push moves the version once a step, `max_weight_lag=0` ends exactly the rollouts that would
span two versions (finish_reason "stale", their tokens all from the version before), each group of n samples
costs one prefill, and the plot is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, N = 3, 4, 4
sys.path.insert(0, str(ROOT / "docs" / "examples"))

import rl_copy_task as task  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rl")
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "rl_loop.py"), "--out", str(out),
                           "--steps", str(STEPS), "--batch", str(BATCH), "--n", str(N), "--max-weight-lag", "0"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "rl_loop.json").read_text())
    data["stdout"], data["out"] = proc.stdout, out
    return data


@pytest.mark.slow
def test_no_rollout_lost_and_every_token_has_its_version(run):
    rollouts = run["rollouts"]
    assert len(rollouts) == (STEPS + 1) * BATCH * N  # the last step's rollouts are collected too
    assert len({r["request_id"] for r in rollouts}) == len(rollouts)
    for step in range(STEPS + 1):
        groups = [r for r in rollouts if r["step"] == step]
        assert sorted(r["group"] for r in groups) == sorted(list(range(BATCH)) * N)
    for r in rollouts:
        assert len(r["versions"]) == len(r["tokens"]) <= task.K
        assert r["finish_reason"] in ("length", "stop", "stale"), r
        assert r["versions"] == sorted(r["versions"])
    assert [row["version"] for row in run["rows"]] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_staleness_is_honoured(run):
    # rollouts of step s are sampled while the weights are version s - 1 or s (one push happens during them)
    stale = [r for r in run["rollouts"] if r["finish_reason"] == "stale"]
    for r in run["rollouts"]:
        assert len(set(r["versions"])) <= 1, r  # max_weight_lag=0: no rollout spans two versions
        assert set(r["versions"]) <= {r["step"] - 1, r["step"]}, r
    for r in stale:  # ended at the push that came during it: everything it has is from before
        assert set(r["versions"]) <= {r["step"] - 1}, r
        assert len(r["tokens"]) < task.K
    assert stale, "no rollout was in flight at a push: the loop did not overlap generation and the sync"
    assert sum(row["stale"] for row in run["rows"]) == sum(r["step"] < STEPS for r in stale)


@pytest.mark.slow
def test_one_prefill_per_group_and_the_plot(run):
    stats, prompt_len = run["stats"], len(task.make_prompts(__import__("random").Random(0), 1)[0])
    groups = (STEPS + 1) * BATCH
    assert stats["forked_children"] + stats["fork_fallbacks"] == groups * (N - 1)
    # the parent prefills the prompt, each forked child computes only its last token (a rollout ended stale
    # before its turn computes less): one prefill a group, against N for independent requests
    assert stats["prompt_tokens_computed"] <= groups * (prompt_len + N - 1) + stats["fork_fallbacks"] * prompt_len
    assert stats["forked_children"] > 0
    png = (run["out"] / "rl_loop.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "step  reward" in run["stdout"]
