"""SGLang's weight-sync group routes on the gateway (docs/http.md, "SGLang's native routes"): `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`, with SGLang's bodies (its io_struct's
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, DestroyWeightsUpdateGroupReqInput) and answers
(its http_server: {"success", "message"}, 200 or 400), over the client's `weights_group` and `update_weights` with
source "group" (cluster/client/weights_group.py). slime calls them in this order (its sglang_engine.py and
update_weight_from_distributed.py): init once per connection (the trainer joins at rank 0 meanwhile), then for each
update pause, flush, one `update_weights_from_distributed` per bucket with `weight_version` (the trainer broadcasts
the bucket's tensors after each call went out), continue; destroy when it reconnects.

A bucket's `weight_version` labels the version its update makes once it applies (the last label given while the
update was open), reported by `/get_weight_version` and each answer's meta_info as the disk route's labels are.
Admin routes (the token, or a trusted network: launch/gateway/admin_auth.py). Torch-free."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from cluster.client import AsyncClient
from cluster.errors import ClientError
from cluster.group_wire import DEFAULT_GROUP_NAME
from launch.gateway.admin_auth import AdminAuth


class InitGroupBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class BucketBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True  # accepted: an applied update drops Lockstep's cached prefixes anyway
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False  # accepted, nothing to empty here
    end: bool = False  # Lockstep's: this bucket ends the update (a subset applies as a partial update)


class DestroyGroupBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    group_name: str = DEFAULT_GROUP_NAME


def sglang_answer(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


def weight_sync_router(client: AsyncClient, auth: AdminAuth, labels: dict[int, str],
                       in_flight: Callable[[], list[str]]) -> APIRouter:
    """`labels`: the SGLang routes' weight labels (version -> label); `in_flight`: the /generate requests in flight
    (cancelled first with `abort_all_requests`)."""
    router = APIRouter()
    pending: dict[str, Any] = {"label": None}  # the label of the update still open

    async def answered(call: Any) -> JSONResponse:
        try:
            result = await call
        except ClientError as e:
            return sglang_answer(False, str(e))
        return sglang_answer(True, result["message"])

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request, body: InitGroupBody) -> JSONResponse:
        auth.check(request)
        return await answered(client.init_weights_update_group(
            body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name,
            body.backend))

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request, body: BucketBody) -> JSONResponse:
        auth.check(request)
        if body.abort_all_requests:
            await asyncio.gather(*(client.cancel(r) for r in in_flight()))
        pending["label"] = body.weight_version or pending["label"]
        try:
            result = await client.update_weights_from_distributed(body.names, body.dtypes, body.shapes,
                                                                  body.group_name, body.load_format, body.end)
        except ClientError as e:
            pending["label"] = None  # a refused bucket drops the whole update
            return sglang_answer(False, str(e))
        if not result.get("applied"):
            return sglang_answer(True, f"Staged {result.get('staged')} tensor(s); the update applies once every "
                                       "tensor of the model arrived.")
        message = "Succeeded to update parameter online."
        if pending["label"] is not None:
            labels[int(result["version"])] = pending["label"]
            message += f" Weight version updated to {pending['label']}."
        pending["label"] = None
        return sglang_answer(True, message)

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request, body: DestroyGroupBody | None = None) -> JSONResponse:
        auth.check(request)
        pending["label"] = None
        return await answered(client.destroy_weights_update_group((body or DestroyGroupBody()).group_name))

    return router
