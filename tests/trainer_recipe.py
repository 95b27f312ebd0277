"""The trainer's side of a weight-sync group as slime makes it (slime/utils/distributed_utils.py `init_process_group`,
the same recipe as OpenRLHF's and SGLang's `init_custom_process_group`: torch's `rendezvous` on
"tcp://addr:port", a PrefixStore of the group's name, torch's `_new_process_group_helper`), and its broadcasts
(slime's update_weight_from_distributed.py: `dist.broadcast(param.data, 0, group=group, async_op=True)` a tensor,
then wait for all; SGLang's FlattenedTensorBucket for load_format "flattened_bucket"). Tests only: the trainer is
never Lockstep's code."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                       timeout_s: float = 60) -> dist.ProcessGroup:
    """A group outside the default one, as slime's `init_process_group` makes it (written again here)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_tensors(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """slime's way: every tensor from rank 0, issued asynchronously, then waited for."""
    handles = [dist.broadcast(t.data, 0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def flattened(tensors: list[torch.Tensor]) -> torch.Tensor:
    """SGLang's FlattenedTensorBucket: every tensor's bytes, in order, as one uint8 tensor."""
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])


def dtype_name(t: torch.Tensor) -> str:
    """slime's dtype field: `str(dtype).replace("torch.", "")`."""
    return str(t.dtype).replace("torch.", "")
