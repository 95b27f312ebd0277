"""The weight updates an RL loop makes on a MoE model, as one sequence the tests run at TP=1 in this process
(tests/test_moe_updates.py) and at TP=2 in the MoE parity launch (tests/scripts/parity_rank.py): from checkpoint A,
a full update to checkpoint B in transformers' fused layout, then three partial updates that bring some of A's
expert tensors back, each from another source and naming them another way:

- a checkpoint of experts 1 and 6 (one on each rank under expert parallelism at TP=2) of every MoE layer but the
  first, under their published names (`...experts.1.gate_proj.weight`, Mixtral's `...experts.1.w1.weight`);
- by handle: the first MoE layer's experts under transformers' fused names (`experts.gate_up_proj` [E, 2I, H],
  `experts.down_proj` [E, H, I]), holding A's experts 1 and 6 and B's others;
- a push: the last MoE layer's router and experts 2 and 5 (again one on each expert-parallel rank).

`write_sources` (the test's side) writes the sources and `mixed`, a full checkpoint of what must serve after the
partial updates (transformers' reference); `run_updates` (every rank) applies them through a manager and generates
PROMPTS after the full update and after the partial ones."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROMPTS = [[1, 4, 9, 16, 25, 36, 49, 64], [1, 2, 3], [7] * 20, [5, 300, 1200, 77, 9, 1000, 3]]
NEW = 16
CHECKPOINT_EXPERTS, PUSH_EXPERTS = (1, 6), (2, 5)
_EXPERT = re.compile(r"model\.layers\.(\d+)\..*\.experts\.(\d+)\.")


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a published per-expert tensor name, else None."""
    m = _EXPERT.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def moe_layers(state: dict[str, torch.Tensor]) -> list[int]:
    return sorted({found[0] for found in map(expert_of, state) if found})


def router_names(state: dict[str, torch.Tensor], layer: int) -> list[str]:
    """The router's tensors of `layer` (`...gate.weight`, and GLM's `gate.e_score_correction_bias`)."""
    return [n for n in state if n.startswith(f"model.layers.{layer}.") and re.search(r"\.gate\.\w+$", n)]


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def checkpoint_like(base: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint directory at `out` holding `tensors` (and `base`'s config files)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (out / f.name).write_bytes(f.read_bytes())
    save(tensors, out / "model.safetensors")
    return out


def write_sources(dir_a: Path, dir_b: Path, dir_b_fused: Path, work: Path) -> Path:
    """The sequence's sources under `work` (made once): `full` (B, fused layout), `partial` (a checkpoint),
    `handles.safetensors`, `push.safetensors`, and `mixed` (the full checkpoint that must serve at the end)."""
    if (work / "mixed" / "model.safetensors").exists():
        return work
    from transformers import AutoModelForCausalLM

    a, b = (load_file(str(Path(d) / "model.safetensors")) for d in (dir_a, dir_b))
    layers = moe_layers(a)
    first, last = layers[0], layers[-1]
    by_checkpoint = {n: t for n, t in a.items() if (f := expert_of(n)) and f[0] != first
                     and f[1] in CHECKPOINT_EXPERTS}
    first_layer = {n: t for n, t in a.items() if (f := expert_of(n)) and f[0] == first and f[1] in CHECKPOINT_EXPERTS}
    pushed = {n: t for n, t in a.items() if (f := expert_of(n)) and f[0] == last and f[1] in PUSH_EXPERTS}
    pushed |= {n: a[n] for n in router_names(a, last)}
    mixed = checkpoint_like(Path(dir_a), work / "mixed", b | by_checkpoint | first_layer | pushed)
    checkpoint_like(Path(dir_a), work / "partial", by_checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(mixed, dtype=torch.float32).state_dict()  # transformers' own names
    save({n: t for n, t in hf.items() if n.startswith(f"model.layers.{first}.mlp.experts.")},
         work / "handles.safetensors")
    save(pushed, work / "push.safetensors")
    (work / "full").symlink_to(Path(dir_b_fused).resolve())
    return work


# ------------------------------------------------------------------------------------------- every rank's side
def run_updates(model: Any, work: str | Path) -> dict[str, Any]:
    """The sequence on every rank (TP=1 or under torchrun): versions 1 (full) to 4 (push), the driver's tokens after
    the full and the partial updates (None elsewhere), and this rank's own routing counts."""
    import cluster
    from worker.moe_block import routed_tokens

    cfg = cluster.ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, use_async_batching=False)
    rec: dict[str, Any] = {"rank": model.groups.rank}
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        rec["full"] = m.update_weights(f"{work}/full")
        rec["after_full"] = generated(m)
        rec["checkpoint"] = m.update_weights(f"{work}/partial", partial=True)
        if m.is_driver:  # the front door's path: the workers run their share from the CALL plan
            rec["handles"] = by_handle(m, load_file(f"{work}/handles.safetensors"))
            rec["push"] = pushed(m, load_file(f"{work}/push.safetensors"), model.groups.world_size)
        rec["after_partial"] = generated(m)
    rec["routed"] = routed_tokens(model.model)
    return rec


def generated(m: Any) -> list[list[int]] | None:
    ids = m.add_requests(PROMPTS, max_new_tokens=NEW)
    return [m.get_result(i, timeout=120).generated_tokens for i in ids] if m.is_driver else None


def driver_update(m: Any, call: Any, trainer: Any = None) -> dict[str, Any]:
    """An update through the driver's loop (the front door's path), `trainer(done)` run meanwhile in this thread."""
    done, box = threading.Event(), {}
    m.update_weights_async(call, lambda result: (box.update(result), done.set()))
    if trainer is not None:
        trainer(done)
    assert done.wait(120), "the update did not end"
    return box


def by_handle(m: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    from launch.weight_handles import SharedBuckets
    from worker.weights import UpdateCall

    with SharedBuckets(tensors, bucket_bytes=1 << 20) as shared:
        return driver_update(m, UpdateCall("handles", buckets=shared.buckets, handles=shared.handles, partial=True))


def pushed(m: Any, tensors: dict[str, torch.Tensor], tp: int) -> dict[str, Any]:
    """A partial push, this thread the trainer (launch/weight_push.py's side, without a client)."""
    from launch.torchrun import free_port
    from launch.weight_push import bucket_meta, buckets_of
    from worker.push import TRAINER_DEVICE_KEY, open_store, send_buckets
    from worker.weights import UpdateCall

    addr, groups = f"127.0.0.1:{free_port()}", buckets_of(tensors, 1 << 20)
    store = open_store(addr, tp + 1, 30, master=True)
    store.set(TRAINER_DEVICE_KEY, "cpu")
    call = UpdateCall("push", store=addr, buckets=bucket_meta(tensors, groups), partial=True, timeout_s=30)
    return driver_update(m, call, lambda done: send_buckets(store, tp, tensors, groups, torch.device("cpu"), 30,
                                                            gave_up=done.is_set))
