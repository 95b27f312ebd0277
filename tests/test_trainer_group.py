"""A weight-sync group the trainer owns, in this process (one serving rank, TP=1, and the trainer a thread at rank 0
of the group, made with slime's recipe: tests/trainer_recipe.py): the wire's checks, buckets staged and applied all
or none at the end of the update, a refused bucket still received (the trainer is not left hanging) and the whole
update dropped, the calls' refusals with their codes, a silent trainer given up on after the timeout, and SGLang's
routes' answers and labels. tests/test_weights_sync.py runs slime's calls against a real TP=2 server."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from cluster.dist import Groups
from cluster.errors import Code, WeightRefused
from cluster.group_wire import check_group_bucket, check_group_call
from cluster.protocol import ProtocolError
from launch.torchrun import free_port
from tests.trainer_recipe import broadcast_tensors, dtype_name, flattened, init_process_group
from worker.layers import Shard
from worker.loader import apply, load_weights, stage_named
from worker.models import build_model
from worker.trainer_group import GroupCall
from worker.trainer_groups import TrainerGroups
from worker.weights import UpdateCall, run_update

ONE_RANK = Groups(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
JOIN_S = 60


def test_the_wire_checks_sglang_fields():
    init = {"action": "init", "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
    assert check_group_call(init, tp=2) == init | {"group_name": "weight_update_group", "backend": "nccl"}
    assert check_group_call({"action": "destroy"}, tp=2) == {"action": "destroy", "group_name": "weight_update_group"}
    for bad in ({"rank_offset": 0}, {"world_size": 2}, {"master_port": 0}, {"backend": "mpi"},
                {"master_address": "a b"}, {"action": "join"}, {"group_name": ""}):
        with pytest.raises(ProtocolError) as e:
            check_group_call(init | bad, tp=2)
        assert e.value.code == Code.BAD_FIELD
    assert check_group_call(init | {"master_address": "::1"}, tp=2)["master_address"] == "::1"
    bucket = {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2, 3], [4]]}
    assert check_group_bucket(bucket) == ("weight_update_group", [["a", [2, 3], "float32"], ["b", [4], "bfloat16"]],
                                          None, False)
    for bad in ({"dtypes": ["float32"]}, {"dtypes": ["float32", "int64"]}, {"shapes": [[2, -1], [4]]},
                {"names": []}, {"load_format": "direct"}, {"shapes": [[1 << 20, 1 << 20], [4]]}):
        with pytest.raises(ProtocolError):
            check_group_bucket(bucket | bad)


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    return dir_a, load_file(os.path.join(dir_b, "model.safetensors"))


def one_rank_model(model_dir) -> Any:
    model = build_model(AutoConfig.from_pretrained(model_dir), Shard(rank=0, size=1), torch.float32,
                        torch.device("cpu"))
    load_weights(model, model_dir)
    return model


def trainer(port: int, name: str, steps: Callable[[Any], None], out: dict) -> threading.Thread:
    """The trainer, a thread at rank 0 of a world of 2 (this rank at 1): joins, runs `steps(group)`, leaves."""
    def run() -> None:
        try:
            group = init_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, name, timeout_s=30)
            steps(group)
            torch.distributed.destroy_process_group(group)
            out["trainer"] = "done"
        except Exception as e:  # the test reads it
            out["trainer"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def joined(port: int, name: str, timeout_s: float = 30) -> tuple[TrainerGroups, dict]:
    groups = TrainerGroups()
    result = groups.run(GroupCall("init", name, "127.0.0.1", port, 1, 2, "gloo", timeout_s), ONE_RANK)
    return groups, result


def bucket_call(name: str, tensors: dict[str, torch.Tensor], apply: bool, load_format: str | None = None) -> UpdateCall:
    entries = [[n, list(t.shape), dtype_name(t)] for n, t in tensors.items()]
    return UpdateCall("group", buckets=[entries], group_name=name, load_format=load_format, apply=apply)


def loaded_state(model_dir, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A TP=1 model's state (Lockstep's own, fused names) on `model_dir`'s weights, or on `tensors` loaded after."""
    model = one_rank_model(model_dir)
    if tensors is not None:
        apply(stage_named(model, tensors.items(), "reference"))
    return model.state_dict()


def same_weights(model, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got, state[name]) for name, got in model.state_dict().items())


def test_buckets_are_staged_then_applied_all_or_none(ckpt):
    """Three buckets of checkpoint B (two one tensor a broadcast, the last flattened): the first two stage and apply
    nothing, the last completes the model and applies the whole update; the trainer's broadcasts all ended."""
    dir_a, tensors_b = ckpt
    model, original, new = one_rank_model(dir_a), loaded_state(dir_a), loaded_state(dir_a, tensors_b)
    names = list(tensors_b)
    parts = [dict((n, tensors_b[n]) for n in names[i::3]) for i in range(3)]
    port, out = free_port(), {}

    def steps(group):
        broadcast_tensors(group, list(parts[0].values()))
        broadcast_tensors(group, list(parts[1].values()))
        broadcast_tensors(group, [flattened(list(parts[2].values()))])

    thread = trainer(port, "g-apply", steps, out)
    groups, result = joined(port, "g-apply")
    assert result == {"ok": True, "message": "Succeeded to initialize custom process group."}
    for i, (part, fmt) in enumerate(zip(parts, (None, None, "flattened_bucket"))):
        complete = groups.completes(model, bucket_call("g-apply", part, True).buckets[0])
        assert complete == (i == 2)
        result = run_update(model, ONE_RANK, bucket_call("g-apply", part, complete, fmt), trainer=groups)
        groups.settle("g-apply", result)
        assert result["ok"] and result["applied"] == complete, result
        assert same_weights(model, new if complete else original)  # nothing reaches the model before the end
    thread.join(JOIN_S)
    assert out["trainer"] == "done" and groups.staged == [] and not groups.covered
    assert groups.run(GroupCall("destroy", "g-apply"), ONE_RANK)["ok"] and not groups.joined


def test_a_refused_bucket_is_received_and_drops_the_whole_update(ckpt):
    """A bucket with a misshapen tensor (then one naming no tensor of the model) is refused with its code and name,
    yet received, so the trainer's broadcasts end and the group serves the next update; what was staged before it
    is dropped, nothing applied. Mixed dtypes in a flattened bucket arrive as their values."""
    dir_a, tensors_b = ckpt
    model, original = one_rank_model(dir_a), loaded_state(dir_a)
    first, second = list(tensors_b)[:2]
    wrong = {second: torch.zeros(3, 5)}
    unknown = {"model.layers.99.mlp.up_proj.weight": torch.zeros(2, 2)}
    mixed = {n: (t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(tensors_b.items())}
    port, out = free_port(), {}

    def steps(group):
        for tensors in ({first: tensors_b[first]}, wrong, unknown):
            broadcast_tensors(group, list(tensors.values()))
        broadcast_tensors(group, [flattened(list(mixed.values()))])

    thread = trainer(port, "g-refuse", steps, out)
    groups, _ = joined(port, "g-refuse")
    ok = run_update(model, ONE_RANK, bucket_call("g-refuse", {first: tensors_b[first]}, False), trainer=groups)
    groups.settle("g-refuse", ok)
    assert ok["ok"] and ok["staged"] == 1 and groups.staged
    for tensors, code, tensor in ((wrong, Code.SHAPE_MISMATCH, second),
                                  (unknown, Code.UNKNOWN_TENSOR, "model.layers.99.mlp.up_proj.weight")):
        refused = run_update(model, ONE_RANK, bucket_call("g-refuse", tensors, False), trainer=groups)
        groups.settle("g-refuse", refused)
        assert not refused["ok"] and refused["reason_code"] == code and refused["tensor"] == tensor, refused
        assert groups.staged == [] and "g-refuse" in groups.joined  # dropped, still joined
    assert same_weights(model, original)
    applied = run_update(model, ONE_RANK, bucket_call("g-refuse", mixed, True, "flattened_bucket"), trainer=groups)
    assert applied["ok"] and applied["applied"], applied
    assert same_weights(model, loaded_state(dir_a, {n: t.to(torch.float32) for n, t in mixed.items()}))
    thread.join(JOIN_S)
    assert out["trainer"] == "done"
    groups.close_all()


def test_the_calls_refuse_alike_with_codes(ckpt):
    dir_a, tensors_b = ckpt
    model = one_rank_model(dir_a)
    groups = TrainerGroups()
    gone = groups.run(GroupCall("destroy", "nope"), ONE_RANK)
    assert not gone["ok"] and gone["code"] == Code.UNKNOWN_GROUP and gone["rank"] == 0, gone
    lonely = groups.run(GroupCall("init", "alone", "127.0.0.1", free_port(), 1, 2, "gloo", 1.0), ONE_RANK)
    assert not lonely["ok"] and lonely["code"] == Code.GROUP_JOIN_FAILED and "rank 1" in lonely["error"], lonely
    nccl = groups.run(GroupCall("init", "g", "127.0.0.1", free_port(), 1, 2, "nccl", 1.0), ONE_RANK)
    assert nccl["code"] == Code.GROUP_JOIN_FAILED and "needs CUDA ranks" in nccl["error"], nccl
    name = next(iter(tensors_b))
    nobody = run_update(model, ONE_RANK, bucket_call("nope", {name: tensors_b[name]}, True), trainer=groups)
    assert not nobody["ok"] and nobody["reason_code"] == Code.UNKNOWN_GROUP, nobody
    port, out = free_port(), {}
    thread = trainer(port, "g-twice", lambda group: None, out)
    groups, _ = joined(port, "g-twice")
    thread.join(JOIN_S)
    twice = groups.run(GroupCall("init", "g-twice", "127.0.0.1", port, 1, 2, "gloo", 1.0), ONE_RANK)
    assert not twice["ok"] and twice["code"] == Code.GROUP_EXISTS and "g-twice" in groups.joined, twice
    groups.close_all()
    assert not groups.joined


def test_a_silent_trainer_is_given_up_on_and_the_group_left(ckpt):
    """The trainer joins and never broadcasts: the bucket is refused with push_timeout after the group's timeout
    (push_timeout_s), naming the phase, and the rank leaves the group."""
    dir_a, tensors_b = ckpt
    model = one_rank_model(dir_a)
    port, out, release = free_port(), {}, threading.Event()
    thread = trainer(port, "g-silent", lambda group: release.wait(JOIN_S), out)
    groups, _ = joined(port, "g-silent", timeout_s=1.0)
    name = next(iter(tensors_b))
    result = run_update(model, ONE_RANK, bucket_call("g-silent", {name: tensors_b[name]}, True), trainer=groups)
    groups.settle("g-silent", result)
    release.set()
    assert not result["ok"] and result["reason_code"] == Code.PUSH_TIMEOUT, result
    assert result["phase"] == "bucket of 1 tensor(s)" and "g-silent" not in groups.joined
    thread.join(JOIN_S)


def test_weight_refused_votes_carry_the_group_codes():
    from worker.votes import read_vote, vote_of

    vote = read_vote(vote_of(WeightRefused("no group 'x'", Code.UNKNOWN_GROUP)))
    assert vote["code"] == Code.UNKNOWN_GROUP and vote["text"] == "no group 'x'"


class FakeEngine:
    """What the gateway's client answers (tests the routes alone): each bucket's answer in turn."""

    def __init__(self, answers: list):
        self.answers, self.calls, self.version = answers, [], 0

    async def init_weights_update_group(self, *args: Any) -> dict:
        self.calls.append(("init", args))
        return {"ok": True, "message": "Succeeded to initialize custom process group."}

    async def update_weights_from_distributed(self, *args: Any) -> dict:
        self.calls.append(("bucket", args))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        self.version = answer.get("version", self.version)
        return answer

    async def destroy_weights_update_group(self, name: str) -> dict:
        from cluster.errors import WeightsGroupError

        raise WeightsGroupError(Code.UNKNOWN_GROUP, f"no group {name!r} to destroy", 0)

    async def health(self) -> dict:
        return {"weights": {"version": self.version}}


def test_sglang_routes_answer_as_sglang_and_label_the_applied_version():
    """SGLang's bodies and answers ({"success", "message"}, 200 or 400), the admin token, and the label: the last
    `weight_version` of the update open when it applies (a refused bucket drops the update and its label)."""
    from fastapi.testclient import TestClient

    from cluster.errors import WeightUpdateError
    from launch.gateway.app import make_app
    from launch.gateway.admin_auth import AdminAuth
    from launch.gateway.openai_serving import Model

    engine = FakeEngine([{"ok": True, "applied": False, "staged": 3},
                         WeightUpdateError("rank 1: tensor x: shard shape [3], expected [4]", 1, {}),
                         {"ok": True, "applied": False, "staged": 2},
                         {"ok": True, "applied": True, "version": 1}])
    client, auth = TestClient(make_app(engine, Model("m", None), AdminAuth.of("tok"))), {"Authorization": "Bearer tok"}
    init = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
    assert client.post("/init_weights_update_group", json=init).status_code == 401
    answer = client.post("/init_weights_update_group", json=init, headers=auth)
    assert answer.status_code == 200 and answer.json() == {"success": True, "message": "Succeeded to initialize "
                                                                                     "custom process group."}
    assert engine.calls[0] == ("init", ("10.0.0.1", 29500, 1, 3, "weight_update_group", "nccl"))
    bucket = {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[4]], "group_name": "g", "flush_cache": False}
    answers = [client.post("/update_weights_from_distributed", json=bucket | extra, headers=auth)
               for extra in ({"weight_version": "lost"}, {}, {"weight_version": "7"}, {})]
    assert [a.status_code for a in answers] == [200, 400, 200, 200]
    assert answers[1].json()["success"] is False and "shard shape" in answers[1].json()["message"]
    assert answers[3].json() == {"success": True, "message": "Succeeded to update parameter online. Weight version "
                                                             "updated to 7."}
    assert engine.calls[1] == ("bucket", (["a"], ["bfloat16"], [[4]], "g", None, False))
    assert client.get("/get_weight_version").json() == {"weight_version": "7"}
    gone = client.post("/destroy_weights_update_group", json={"group_name": "g"}, headers=auth)
    assert gone.status_code == 400 and gone.json()["success"] is False and "unknown_group" in gone.json()["message"]
    assert client.post("/update_weights_from_distributed", json={"names": ["a"]}, headers=auth).status_code == 400
