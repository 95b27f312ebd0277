"""The gateway's admin routes for training loops: `/pause`, `/resume`, `/update_weights`, `/weight_version`.

Each needs `Authorization: Bearer <token>` with the admin token (cluster/config.py `http_admin_token`): none set,
403 to everyone; a missing or wrong one, 401. They are the driver's admin operations, sent by the gateway's own
client (which the driver must take as an admin); the pause is that client's, so any token holder may resume it."""

from __future__ import annotations

import hmac
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from cluster.client import AsyncClient
from launch.gateway.errors import ADMIN_TOKEN_UNSET, UNAUTHORIZED, HttpError


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    kv_policy: Literal["keep", "recompute"] = "keep"
    partial: bool = False  # the checkpoint holds a subset of the model's tensors (docs/weights.md)


def check_token(request: Request, token: str | None) -> None:
    """HttpError unless the request carries the admin bearer token."""
    if token is None:
        raise HttpError(ADMIN_TOKEN_UNSET, "admin routes are off: no [serve] http_admin_token (or "
                                           "LOCKSTEP_HTTP_ADMIN_TOKEN) is configured")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise HttpError(UNAUTHORIZED, "admin routes need 'Authorization: Bearer <token>' with the admin token")


def admin_router(client: AsyncClient, token: str | None) -> APIRouter:
    """The admin routes; a refusal from the driver (a ClientError) is answered by the app's handler."""
    router = APIRouter()

    @router.post("/pause")
    async def pause(request: Request) -> dict:
        check_token(request, token)
        await client.pause()
        return {"paused": True}

    @router.post("/resume")
    async def resume(request: Request) -> dict:
        check_token(request, token)
        await client.resume()
        return {"paused": False}

    @router.post("/update_weights")
    async def update_weights(request: Request, body: UpdateWeightsBody) -> dict:
        check_token(request, token)
        return await client.update_weights(body.path, body.kv_policy, body.partial)

    @router.get("/weight_version")
    async def weight_version(request: Request) -> dict:
        check_token(request, token)
        weights = (await client.health()).get("weights", {})
        return {"weight_version": weights.get("version", 0), "weights": weights}

    return router
