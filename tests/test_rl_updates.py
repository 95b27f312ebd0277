"""What an RL loop's weight updates need, at TP=2 with real processes (one server for the module, its weights moving
from checkpoint A to B and back part by part; every step checked token for token against transformers' generate
on a checkpoint holding exactly the weights that should be served):

- a colocated update by handle (CPU shared memory: only handles and names travel), full and partial;
- partial updates from a checkpoint and a push, and the refusals (a missing name without partial=True, an unknown
  name, a shape mismatch), each a WeightUpdateError whose reason_code and tensor name it; nothing changes;
- a trainer killed (SIGKILL) and one stopped (SIGSTOP) in the middle of a push: every rank gives up within
  push_timeout_s naming the phase, the old weights serve exactly, and so do requests sent during the stall."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.client import Client
from cluster.errors import Code, WeightUpdateError
from launch.weight_push import buckets_of
from tests.conftest import hf_greedy
from tests.serving import fast_config, serve

PUSH_TIMEOUT_S = 3.0
CONFIG = fast_config() + f"push_timeout_s = {PUSH_TIMEOUT_S}\n"
PROMPTS = [[1, 4, 9, 16, 25, 36], [1, 2, 3], [7, 7, 7, 7, 7, 7, 7, 7]]
NEW = 8
MLP_1 = [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]  # by handle, partial
ATTN_0 = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"] + ["model.norm.weight",
                                                                          "model.embed_tokens.weight"]  # checkpoint
LAYER_2 = ["model.layers.2.mlp.down_proj.weight", "model.layers.2.post_attention_layernorm.weight"]  # push


def state_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def checkpoint(base: Path, out: Path, tensors: dict[str, torch.Tensor], only: bool = False) -> Path:
    """A checkpoint directory at `out`: `base`'s with `tensors` replacing (or, `only`, being all of) its tensors."""
    shutil.copytree(base, out)
    state = {} if only else state_of(base)
    save_file(state | {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


class Served:
    """The module's server and the weights it should serve now (a checkpoint directory holding exactly them)."""

    def __init__(self, server, client: Client, dir_a: Path, dir_b: Path, work: Path):
        self.server, self.c, self.a, self.b, self.work = server, client, state_of(dir_a), state_of(dir_b), work
        self.dir_b = dir_b
        self.now, self.version = dir_a, 0

    def tokens(self) -> list[list[int]]:
        return [self.c.generate(p, max_new_tokens=NEW).generated_tokens for p in PROMPTS]

    def serves(self, model_dir: Path) -> None:
        assert self.tokens() == [t[:NEW] for t in hf_greedy(model_dir, PROMPTS, NEW)]

    def moved(self, result: dict, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """An applied update of `tensors` onto what was served: the version moved by one, the new weights serve."""
        self.version += 1
        assert result["ok"] and result["version"] == self.version, result
        self.now = checkpoint(self.now, self.work / name, tensors)
        self.serves(self.now)

    def refused(self, update, reason_code: str, tensor: str) -> WeightUpdateError:
        """`update()` raises WeightUpdateError naming `tensor` for `reason_code`; nothing changed anywhere."""
        with pytest.raises(WeightUpdateError) as info:
            update()
        e = info.value
        assert e.code == Code.WEIGHT_UPDATE_FAILED and e.reason_code == reason_code and e.tensor == tensor, e.result
        assert tensor in str(e) and "rank 0:" in str(e) and "rank 1:" in str(e), str(e)
        assert self.c.health()["weights"]["version"] == self.version
        self.serves(self.now)
        return e


@pytest.fixture(scope="module")
def served(make_checkpoint, tmp_path_factory):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    work = tmp_path_factory.mktemp("rl_updates")
    with serve(dir_a, 2, CONFIG, forked=True) as s, Client(s.address) as c:
        yield Served(s, c, dir_a, dir_b, work)


def segments_left(names: list[str]) -> set[str]:
    """Which of these shared-memory segments still exist (only the ones this test made: other workers of the suite
    make their own at the same time)."""
    return {n for n in names if os.path.exists(f"/dev/shm/{n}")}


@pytest.mark.slow
def test_updates_by_handle_full_and_partial(served):
    """This process is the colocated trainer: its tensors in shared memory, only handles on the wire."""
    from launch.weight_handles import SharedBuckets, update_weights_by_handle

    s = served
    s.serves(s.now)
    made: list[str] = []
    with SharedBuckets(s.b, bucket_bytes=1 << 20) as shared:
        made += [h["name"] for h in shared.handles]
        assert len(shared.handles) > 4 and all(h["kind"] == "shm" for h in shared.handles)
        s.moved(update_weights_by_handle(s.c, shared), "b", s.b)
    subset = {n: s.a[n] for n in MLP_1}
    with SharedBuckets(subset) as shared:
        made += [h["name"] for h in shared.handles]
        s.moved(update_weights_by_handle(s.c, shared, partial=True), "b+a_mlp1", subset)
    with SharedBuckets({"model.layers.99.mlp.up_proj.weight": s.a[MLP_1[1]]}) as shared:  # past the last layer
        made += [h["name"] for h in shared.handles]
        s.refused(lambda: update_weights_by_handle(s.c, shared, partial=True), Code.UNKNOWN_TENSOR,
                  "model.layers.99.mlp.up_proj.weight")
    assert len(made) > 4 and not segments_left(made)  # every segment this trainer made is gone


@pytest.mark.slow
def test_partial_checkpoint_and_refusals(served):
    s = served
    subset = {n: s.a[n] for n in ATTN_0}
    part = checkpoint(s.now, s.work / "part_attn0", subset, only=True)
    # without partial=True the checkpoint lacks tensors: refused, naming the first missing one
    missing = sorted(set(s.a) - set(ATTN_0))[0]
    s.refused(lambda: s.c.update_weights(str(part)), Code.MISSING_TENSOR, missing)
    unknown = "model.layers.0.mlp.extra_proj.weight"
    bad = checkpoint(s.now, s.work / "part_unknown", {ATTN_0[0]: s.a[ATTN_0[0]], unknown: s.a[MLP_1[0]]}, only=True)
    s.refused(lambda: s.c.update_weights(str(bad), partial=True), Code.UNKNOWN_TENSOR, unknown)
    wrong = checkpoint(s.now, s.work / "part_shape", {ATTN_0[0]: s.a[ATTN_0[0]][:, :-1]}, only=True)
    s.refused(lambda: s.c.update_weights(str(wrong), partial=True), Code.SHAPE_MISMATCH, ATTN_0[0])
    s.moved(s.c.update_weights(str(part), partial=True), "b+a_mlp1+a_attn0", subset)
    assert s.c.health()["weights"]["source"] == "partial"


@pytest.mark.slow
def test_partial_push(served):
    from launch.weight_push import push_weights

    s = served
    subset = {n: s.a[n] for n in LAYER_2}
    s.moved(push_weights(s.c, subset, bucket_bytes=1 << 16, partial=True), "b+a_mlp1+a_attn0+a_l2", subset)


def dying_trainer(address: str, dir_b: str, how: int, stopping: "mp.Event", out: "mp.Queue") -> None:
    """A trainer that pushes B in small buckets and, before its third bucket, sets `stopping` and stops (SIGSTOP)
    or dies (SIGKILL) itself; once continued, what push_weights raised goes to `out`."""
    from launch.weight_push import push_weights
    from worker import push

    real, sent = push.broadcast, []

    def broadcast(pg, tensor, root, timeout_s=None):
        sent.append(1)
        if len(sent) == 3:
            time.sleep(0.5)  # every rank has taken bucket 2 and waits for bucket 3
            stopping.set()  # at once (a queue's put is sent by a thread, which the signal would stop too)
            os.kill(os.getpid(), how)
        real(pg, tensor, root, timeout_s)

    push.broadcast = broadcast
    state = state_of(Path(dir_b))
    with Client(address, server_timeout_s=300) as c:  # stopped, it must not take the server for gone
        try:
            out.put(("returned", push_weights(c, state, bucket_bytes=1 << 16, timeout_s=20)))
        except WeightUpdateError as e:
            out.put(("raised", {"reason_code": e.reason_code, "phase": e.phase, "message": str(e)}))
        except Exception as e:
            out.put(("failed", repr(e)))


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_trainer_that_stops_or_dies_mid_push_cannot_hang_the_service(served, how):
    s = served
    buckets = len(buckets_of(s.b, 1 << 16))
    before = s.c.stats()["last_refused_update"]
    ctx = mp.get_context("spawn")
    q, stopping = ctx.Queue(), ctx.Event()
    trainer = ctx.Process(target=dying_trainer, args=(s.server.address, str(s.dir_b), how, stopping, q))
    trainer.start()
    try:
        assert stopping.wait(timeout=120), "the trainer did not reach its third bucket"
        stalled = time.monotonic()
        during = s.c.submit(PROMPTS[0], max_new_tokens=NEW)  # sent while the push holds the loop
        refused = before
        while refused == before and time.monotonic() - stalled < PUSH_TIMEOUT_S + 30:  # bounded wait
            time.sleep(0.1)
            refused = s.c.stats()["last_refused_update"]
        waited = time.monotonic() - stalled
        assert refused != before, "no rank gave up on the push"
        code = Code.PUSH_TIMEOUT if how == signal.SIGSTOP else Code.PUSH_FAILED
        phase = f"bucket 3/{buckets}"
        assert refused["reason_code"] == code and refused["phase"] == phase, refused
        for r in (0, 1):
            assert f"rank {r}: the push" in refused["error"] and f"in phase {phase}" in refused["error"], refused
        assert waited < PUSH_TIMEOUT_S + 30
        assert s.c.result(during, timeout=60).generated_tokens == hf_greedy(s.now, PROMPTS, NEW)[0][:NEW]
        assert s.c.health()["weights"]["version"] == s.version
        s.serves(s.now)
        if how == signal.SIGSTOP:  # continued, the trainer hears the cluster's answer, naming the phase
            os.kill(trainer.pid, signal.SIGCONT)
            kind, said = q.get(timeout=120)
            assert kind == "raised" and said["reason_code"] == code and said["phase"] == phase, said
    finally:
        if trainer.is_alive():
            os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(30)
