"""A weight-sync group the trainer owns, from a client (docs/weights.md, "A weight-sync group the trainer owns"):
SGLang's `init_weights_update_group`, `update_weights_from_distributed` and `destroy_weights_update_group` with
SGLang's arguments, over the wire's `weights_group` and `update_weights` (source "group"). The trainer, rank 0 of the
group and the master of its store, makes its own side with torch (`init_process_group(backend,
init_method="tcp://addr:port", world_size, rank=0, group_name)`, then `dist.broadcast(tensor, 0, group)` a tensor
after each bucket's call went out). `Client` and `AsyncClient` take these calls from the mixins here. Torch-free."""

from __future__ import annotations

from asyncio import wrap_future
from concurrent.futures import Future
from typing import Any, Callable

from cluster import protocol as P
from cluster.client.io_thread import then
from cluster.client.results import group_call_result, weight_update_result
from cluster.group_wire import DEFAULT_GROUP_NAME


class WeightsGroupFutures:
    """The calls as futures; a mixin of `Client` (its `io`)."""

    io: Any

    def init_weights_update_group_future(self, master_address: str, master_port: int, rank_offset: int,
                                         world_size: int, group_name: str = DEFAULT_GROUP_NAME,
                                         backend: str = "nccl") -> Future:
        return then(self.io.call(P.WEIGHTS_GROUP, action="init", master_address=master_address,
                                 master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                                 group_name=group_name, backend=backend), lambda msg: group_call_result(msg["data"]))

    def destroy_weights_update_group_future(self, group_name: str = DEFAULT_GROUP_NAME) -> Future:
        return then(self.io.call(P.WEIGHTS_GROUP, action="destroy", group_name=group_name),
                    lambda msg: group_call_result(msg["data"]))

    def update_weights_from_distributed_future(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                               group_name: str = DEFAULT_GROUP_NAME, load_format: str | None = None,
                                               end: bool = False, kv_policy: str = "keep") -> Future:
        return then(self.io.call(P.UPDATE_WEIGHTS, source="group", names=list(names),
                                 dtypes=[str(d).removeprefix("torch.") for d in dtypes],
                                 shapes=[list(s) for s in shapes], group_name=group_name, load_format=load_format,
                                 end=end, kv_policy=kv_policy), lambda msg: weight_update_result(msg["data"]))


class WeightsGroupCalls(WeightsGroupFutures):
    """Blocking calls; a mixin of `Client` (its `_wait`)."""

    _wait: Callable[..., Any]

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                   group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> dict:
        """Every rank joins the trainer's group `group_name` at rank_offset + its TP rank (the trainer at 0 makes
        the store at master_address:master_port); returns once every rank joined (the trainer must join meanwhile),
        or raises WeightsGroupError and none stays joined. The group lives until `destroy_weights_update_group`."""
        return self._wait(self.init_weights_update_group_future(master_address, master_port, rank_offset,
                                                                world_size, group_name, backend))

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Every rank leaves the group (an update it carried and did not end is dropped)."""
        return self._wait(self.destroy_weights_update_group_future(group_name))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                                        group_name: str = DEFAULT_GROUP_NAME, load_format: str | None = None,
                                        end: bool = False, kv_policy: str = "keep") -> dict:
        """One bucket of an update, which the trainer broadcasts over the group once this call went out (one
        tensor at a time in `names` order, or `load_format="flattened_bucket"`: their bytes as one uint8 tensor).
        Every rank stages its shard; the bucket that completes the model's tensors (or says `end`) applies the
        whole update on every rank or on none. The result says `applied`; WeightUpdateError when refused."""
        return self._wait(self.update_weights_from_distributed_future(names, dtypes, shapes, group_name,
                                                                      load_format, end, kv_policy))


class AsyncWeightsGroupCalls:
    """The same as coroutines; a mixin of `AsyncClient` (its `client`)."""

    client: Any

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP_NAME,
                                        backend: str = "nccl") -> dict:
        return await wrap_future(self.client.init_weights_update_group_future(
            master_address, master_port, rank_offset, world_size, group_name, backend))

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        return await wrap_future(self.client.destroy_weights_update_group_future(group_name))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP_NAME, load_format: str | None = None,
                                              end: bool = False, kv_policy: str = "keep") -> dict:
        return await wrap_future(self.client.update_weights_from_distributed_future(
            names, dtypes, shapes, group_name, load_format, end, kv_policy))
