"""The gateway's admin routes for training loops: `/pause`, `/resume`, `/update_weights`, `/weight_version`,
`/release_memory`, `/resume_memory`.

Each needs `Authorization: Bearer <token>` with the admin token (cluster/http_config.py `http_admin_token`), or a
caller in a trusted network (`http_admin_trust`; launch/gateway/admin_auth.py): no token set, 403 to the others; a
missing or wrong one, 401. They are the driver's admin operations, sent by the gateway's own
client (which the driver must take as an admin); the pause is that client's, so any token holder may resume it.
`/release_memory` needs a held pause (`not_paused` otherwise); `/resume_memory` lets go a pause the gateway took for
SGLang's release (launch/gateway/memory_pause.py)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from cluster.client import AsyncClient
from launch.gateway.admin_auth import AdminAuth
from launch.gateway.memory_pause import MemoryPause


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    kv_policy: Literal["keep", "recompute"] = "keep"
    partial: bool = False  # the checkpoint holds a subset of the model's tensors (docs/weights.md)


MemoryTag = Literal["kv_cache", "weights"]


class ReleaseMemoryBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tags: list[MemoryTag] = ["kv_cache", "weights"]
    keep_weights_on_host: bool = True


class ResumeMemoryBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tags: list[MemoryTag] = ["kv_cache", "weights"]

class PauseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["keep", "abort", "wait", "retract"] = "keep"  # cluster.pause.PAUSE_MODES (docs/weights.md)


def admin_router(client: AsyncClient, auth: AdminAuth, pauses: MemoryPause) -> APIRouter:
    """The admin routes; a refusal from the driver (a ClientError) is answered by the app's handler."""
    router = APIRouter()

    @router.post("/pause")
    async def pause(request: Request, body: PauseBody | None = None) -> dict:
        """Answered once the pause is in force (a mode "wait": once every running request finished)."""
        auth.check(request)
        mode = (body or PauseBody()).mode
        await pauses.pause(mode)
        return {"paused": True, "mode": mode}

    @router.post("/resume")
    async def resume(request: Request) -> dict:
        auth.check(request)
        await pauses.resume()
        return {"paused": False}

    @router.post("/update_weights")
    async def update_weights(request: Request, body: UpdateWeightsBody) -> dict:
        auth.check(request)
        return await client.update_weights(body.path, body.kv_policy, body.partial)

    @router.post("/release_memory")
    async def release_memory(request: Request, body: ReleaseMemoryBody | None = None) -> dict:
        auth.check(request)
        body = body or ReleaseMemoryBody()
        return await client.release_memory(body.tags, body.keep_weights_on_host)

    @router.post("/resume_memory")
    async def resume_memory(request: Request, body: ResumeMemoryBody | None = None) -> dict:
        auth.check(request)
        return await pauses.resume_memory((body or ResumeMemoryBody()).tags)

    @router.get("/weight_version")
    async def weight_version(request: Request) -> dict:
        auth.check(request)
        weights = (await client.health()).get("weights", {})
        return {"weight_version": weights.get("version", 0), "weights": weights}

    return router
