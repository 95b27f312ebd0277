"""The trainer's push, both ends in one process (a trainer thread and one thread per serving rank, TP=2
shards, gloo on the CPU): the backend choice, refusals that make no group, bounded staging memory, a
failure after the first bucket, and the update group torn down after every push."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from cluster import faults
from launch.torchrun import free_port
from launch.weight_push import bucket_meta, buckets_of
from worker import push
from worker.layers import Shard
from worker.loader import apply, load_weights
from worker.models import build_model
from worker.models.decoder import CausalLM
from worker.weights import UpdateCall

TP = 2
JOIN_S = 60


def test_backend_is_nccl_only_when_both_ends_are_cuda():
    assert push.push_backend("cuda", "cuda") == "nccl"
    assert push.push_backend("cuda", "cpu") == push.push_backend("cpu", "cuda") == "gloo"
    assert push.push_backend("cpu", "cpu") == "gloo"
    assert push.backend_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert push.backend_device("gloo", torch.device("cuda", 1)) == torch.device("cpu")


def test_agreement_refuses_mismatches_and_names_the_rank():
    ok = {"device": "cuda", "backend": "nccl", "error": ""}
    assert push.agreed_backend([ok, ok], "cuda") == ("nccl", "")
    backend, why = push.agreed_backend([ok, ok], "cpu")  # a rank offered nccl to a CPU trainer
    assert backend == "" and why.startswith("rank 0: backend mismatch") and "over gloo" in why
    cpu = {"device": "cpu", "backend": "gloo", "error": ""}
    backend, why = push.agreed_backend([ok, cpu], "cuda")
    assert backend == "" and "rank 0 nccl (cuda), rank 1 gloo (cpu)" in why
    backend, why = push.agreed_backend([cpu, dict(cpu, error="bad shape")], "cpu")
    assert (backend, why) == ("", "rank 1: bad shape")


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    return dir_a, load_file(os.path.join(dir_b, "model.safetensors")), dir_b


def shard_models(model_dir, expert_parallel: bool = False) -> list[CausalLM]:
    config = AutoConfig.from_pretrained(model_dir)
    models = [build_model(config, Shard(rank=r, size=TP), torch.float32, torch.device("cpu"), expert_parallel)
              for r in range(TP)]
    for m in models:
        load_weights(m, model_dir)
    return models


def run_push(models, tensors, bucket_bytes, rank_devices=("cpu", "cpu"), trainer_device="cpu", partial=False):
    """One push with every member in a thread of this process: (per-rank staged list or exception, the
    trainer's send_buckets result). Every thread must end within JOIN_S (a hang fails the test)."""
    addr = f"127.0.0.1:{free_port()}"
    store = push.open_store(addr, TP + 1, 30, master=True)
    store.set(push.TRAINER_DEVICE_KEY, trainer_device)
    groups = buckets_of(tensors, bucket_bytes)
    call = UpdateCall("push", store=addr, buckets=bucket_meta(tensors, groups), timeout_s=30, partial=partial)
    out: dict = {}

    def rank(r):
        try:
            out[r] = push.stage_pushed(models[r], r, TP, torch.device(rank_devices[r]), call)
        except Exception as e:
            out[r] = e

    def trainer():
        out["trainer"] = push.send_buckets(store, TP, tensors, groups, torch.device("cpu"), 30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(TP)] + [threading.Thread(target=trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a member of the push hung"
    return [out[r] for r in range(TP)], out["trainer"]


def test_staging_holds_this_rank_shard_plus_one_bucket(ckpt, monkeypatch):
    dir_a, tensors_b, dir_b = ckpt
    allocations: list[tuple[str, int]] = []
    real = push.receive_buffer

    def counted(nbytes, device):
        allocations.append((threading.current_thread().name, nbytes))
        return real(nbytes, device)

    monkeypatch.setattr(push, "receive_buffer", counted)
    models = shard_models(dir_a)
    bucket = 64 << 10
    staged, sent = run_push(models, tensors_b, bucket)
    assert sent is True and not any(isinstance(s, Exception) for s in staged), staged
    groups = buckets_of(tensors_b, bucket)
    assert len(groups) > 4  # several buckets, so one buffer per rank is a real bound
    largest = max(sum(tensors_b[n].nbytes for n in names) for names in groups)
    model_bytes = sum(t.nbytes for t in tensors_b.values())
    # one receive buffer per rank, of the largest bucket's size, far below the whole model
    assert sorted(n for _, n in allocations) == [largest] * TP and largest < model_bytes / 4
    for r, (m, s) in enumerate(zip(models, staged)):
        shard = sum(p.nbytes for p in m.parameters())
        assert sum(v.nbytes for _, v in s) == sum(dst.nbytes for dst, _ in s) == shard < model_bytes
        assert all(v.untyped_storage().nbytes() == v.nbytes for _, v in s)  # copies, not views of a bucket
        before = {k: v.clone() for k, v in m.state_dict().items()}
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # staging touched nothing
        apply(s)
        for (k, got), want in zip(m.state_dict().items(), shard_models(dir_b)[r].state_dict().values()):
            assert torch.equal(got, want), k


def test_ranks_that_disagree_on_the_backend_refuse_without_a_group(ckpt):
    """A rank on CUDA and a rank on the CPU with a CUDA trainer: no single backend. Every member learns it
    from the store within seconds (no group is made, so nobody waits for a peer that will not come)."""
    dir_a, tensors_b, _ = ckpt
    models = shard_models(dir_a)
    start = time.monotonic()
    staged, sent = run_push(models, tensors_b, 1 << 20, rank_devices=("cuda", "cpu"), trainer_device="cuda")
    assert time.monotonic() - start < 20 and sent is False
    for s in staged:
        assert isinstance(s, ValueError) and "rank 0 nccl (cuda), rank 1 gloo (cpu)" in str(s), s


def test_a_failure_after_the_first_bucket_fails_every_member(ckpt, monkeypatch):
    """Rank 1 fails on the third bucket: it still takes the rest; every rank raises, the trainer learns it
    over the update group, and no model changed."""
    dir_a, tensors_b, _ = ckpt
    monkeypatch.setattr(faults, "RULES", faults._parse("push_bucket:rank=1:bucket=2"))
    models = shard_models(dir_a)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    staged, sent = run_push(models, tensors_b, 64 << 10)
    assert sent is False
    assert isinstance(staged[1], ValueError) and "InjectedFault" in str(staged[1]), staged[1]
    assert isinstance(staged[0], ValueError) and "another member" in str(staged[0]), staged[0]
    for m, b in zip(models, before):
        assert all(torch.equal(b[k], v) for k, v in m.state_dict().items())


def counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def test_ten_pushes_leave_no_threads_or_sockets(ckpt):
    dir_a, tensors_b, _ = ckpt
    models = shard_models(dir_a)
    run_push(models, tensors_b, 1 << 20)  # warm: torch's own lazily started threads
    threads0, fds0 = counts()
    for _ in range(10):
        _, sent = run_push(models, tensors_b, 1 << 20)
        assert sent is True
    time.sleep(0.5)
    threads1, fds1 = counts()
    assert threads1 <= threads0 + 2 and fds1 <= fds0 + 4, (threads0, threads1, fds0, fds1)
