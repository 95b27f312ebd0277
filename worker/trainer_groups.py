"""A serving rank's weight-sync groups the trainer owns, by name, and the update they carry (docs/weights.md, "A
weight-sync group the trainer owns").

The groups live across updates until destroyed. An update comes in buckets, one `update_weights` call (source
"group") each, as SGLang's `update_weights_from_distributed` is called once a bucket: every rank stages its shard of
each bucket here (copies, so each bucket's buffers go), and nothing reaches the parameters until the update ends:
the bucket that completes the model's tensors (or one that says `end`) applies the whole staged update on every rank
or on none (worker/weights.py `run_update`: the votes, then the copy). A bucket refused anywhere drops the whole
update everywhere; a bucket whose wait broke (the trainer gone or silent for push_timeout_s) also leaves the group.
The driver decides when an update applies (`completes`), from the same state every rank holds."""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from cluster.dist import Groups
from cluster.errors import Code, WeightRefused
from worker.loader import Staged, stage_one
from worker.models.decoder import CausalLM
from worker.push import preflight
from worker.push_phase import PushPhase
from worker.trainer_group import GroupCall, TrainerGroup
from worker.votes import described, refusals, refused_result, vote_of

BROKEN = (Code.PUSH_TIMEOUT, Code.PUSH_FAILED)  # a refusal whose group cannot be trusted any more


def covered_by(model: CausalLM, bucket: list[list[Any]]) -> set[str]:
    """The model's checkpoint names the bucket's tensors fill (a fused alias fills each name it stands for)."""
    out: set[str] = set()
    for name, _, _ in bucket:
        target = model.target(name)
        if target is not None:
            out.update(target.covers)
    return out


class TrainerGroups:
    """This rank's members of trainer-owned groups (`joined`) and the update they carry: this rank's shard of every
    tensor staged so far (`staged`) and the model's names those fill (`covered`), the same names on every rank."""

    def __init__(self) -> None:
        self.joined: dict[str, TrainerGroup] = {}
        self.staged: Staged = []
        self.covered: set[str] = set()

    def run(self, call: GroupCall, groups: Groups) -> dict[str, Any]:
        """Join (`init`) or leave (`destroy`) the trainer's group on every rank, all or none; {"ok", "message"}, or
        {"ok": False, "code", "error", "rank"} and nothing joined or left anywhere. Every rank of the control group
        calls it at the same boundary. Collectives: `init` first makes this rank's member (the rendezvous of the
        trainer's group: the trainer at rank 0, this engine's ranks at rank_offset..rank_offset + tp - 1, bounded by
        push_timeout_s); then every action votes on the control group (`refusals`: two all-reduces)."""
        ok, vote, member = True, "", None
        try:
            if call.action == "init":
                if call.group_name in self.joined:
                    raise WeightRefused(f"group {call.group_name!r} is joined already (destroy it first)",
                                        Code.GROUP_EXISTS)
                try:
                    member = TrainerGroup(call, groups.rank, groups.device)
                except Exception as e:
                    raise WeightRefused(f"could not join group {call.group_name!r} at rank "
                                        f"{call.rank_offset + groups.rank}: {described(e)}", Code.GROUP_JOIN_FAILED)
            elif call.group_name not in self.joined:
                raise WeightRefused(f"no group {call.group_name!r} to destroy", Code.UNKNOWN_GROUP)
        except Exception as e:  # this rank's vote against
            ok, vote = False, vote_of(e)
        refused = refusals(ok, vote, groups)
        if refused:
            if member is not None:
                member.close()
            result = refused_result(refused)
            return {"ok": False, "code": result["reason_code"], "error": result["error"], "rank": result["rank"]}
        if member is not None:
            self.joined[call.group_name] = member
            return {"ok": True, "message": "Succeeded to initialize custom process group."}
        self.leave(call.group_name)
        return {"ok": True, "message": "Succeeded to destroy custom process group."}

    def completes(self, model: CausalLM, bucket: list[list[Any]]) -> bool:
        """Whether the staged update, with `bucket`'s tensors, holds every tensor of the model."""
        return model.expected_tensors() <= self.covered | covered_by(model, bucket)

    def stage_bucket(self, model: CausalLM, groups: Groups, group_name: str, bucket: list[list[Any]],
                     load_format: str | None) -> Staged:
        """This rank's shard of one bucket from the trainer's group `group_name`, added to the staged update, which
        it returns whole. Every serving rank calls it (run_update's staging), the trainer broadcasting meanwhile.
        Collectives: one vote on the control group (`refusals`: may every rank take the bucket? the group joined,
        names, shapes and dtypes the model's: push.preflight), then the bucket's broadcasts from the trainer (rank
        0 of that group) to every rank, unless the group is missing. A rank that cannot take the bucket still
        receives it and drops it, so the trainer's broadcasts end and the group stays usable, and raises its
        WeightRefused (its vote against in run_update); the others stage nothing. A broken wait raises the phase's
        refusal (push_timeout, push_failed)."""
        member = self.joined.get(group_name)
        check = None if member is not None else WeightRefused(
            f"no group {group_name!r}: init_weights_update_group first", Code.UNKNOWN_GROUP)
        check = check or preflight(model, [[entry] for entry in bucket], partial=True)
        refused = refusals(check is None, vote_of(check) if check is not None else "", groups)
        if any(vote.get("code") == Code.UNKNOWN_GROUP for _, vote in refused):
            raise check or WeightRefused(f"a rank has no group {group_name!r}", Code.UNKNOWN_GROUP)
        phase = PushPhase(member.timeout_s)
        try:
            received = member.receive(bucket, load_format, phase)
        except Exception as e:
            raise phase.gave_up(e) from None
        if check is not None:
            raise check
        if refused:  # another rank refused: the update is dropped everywhere once run_update's vote says so
            return self.staged
        for name, tensor in received:
            one = stage_one(model, name, tensor, "the trainer's bucket")
            if one is not None:  # a tied head's name fills nothing of its own
                self.staged.append(one)
        self.covered |= covered_by(model, bucket)
        return self.staged

    def settle(self, group_name: str, result: dict[str, Any]) -> None:
        """After a bucket's `run_update` (its result is the same on every rank): a refused bucket drops the whole
        update, and one whose wait broke leaves the group too; an applied update is done; else it stays open."""
        if not result["ok"] or result.get("applied", True):
            self.staged, self.covered = [], set()
        if not result["ok"] and result.get("reason_code") in BROKEN and group_name in self.joined:
            self.leave(group_name)

    def leave(self, group_name: str) -> None:
        """Close this rank's member of `group_name`; the update it carried is dropped (nothing applied)."""
        self.joined.pop(group_name).close()
        self.staged, self.covered = [], set()

    def close_all(self) -> None:
        """Leave every group (the loop ended); one that fails to close is dropped all the same."""
        for name in list(self.joined):
            with suppress(Exception):
                self.leave(name)
