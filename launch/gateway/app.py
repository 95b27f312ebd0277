"""The OpenAI-compatible HTTP gateway (FastAPI): a client of the driver, through `AsyncClient` only (docs/http.md).
Every refusal is OpenAI's error body with the status of launch/gateway/errors.py. Torch-free."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.client import AsyncClient
from cluster.errors import ClientError, Code
from launch.gateway.admin_auth import AdminAuth
from launch.gateway.admin_routes import admin_router
from launch.gateway.errors import MODEL_NOT_FOUND, HttpError
from launch.gateway.memory_pause import MemoryPause
from cluster.metrics_export import render
from launch.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from launch.gateway.openai_serving import Model, OpenAIServing, until_done_or_gone
from launch.gateway.sglang_routes import sglang_router
from launch.gateway.trl_routes import trl_router
from driver.frontdoor.text_output import load_tokenizer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class GatewaySettings:
    """`model_dir`: the checkpoint (its name and tokenizer; None: the server's `health` names it). `model_name`: the
    name clients send (default: the directory's). `admin_token`: None refuses the admin routes to callers outside
    `admin_trust` (CIDR strings: cluster/http_config.py http_admin_trust; empty: none). `sglang_enable_memory_saver`:
    SGLang's `/server_info` field (cluster/http_config.py sglang_enable_memory_saver)."""

    model_dir: str | None = None
    model_name: str | None = None
    admin_token: str | None = None
    admin_trust: tuple[str, ...] = ()
    sglang_enable_memory_saver: bool = False


async def resolve_model(client: AsyncClient, settings: GatewaySettings) -> Model:
    """The model served: from the settings, or from the server's `health` (its `model` path)."""
    path = settings.model_dir if settings.model_dir is not None else (await client.health()).get("model")
    name = settings.model_name or (os.path.basename(os.path.normpath(path)) if path else "lockstep")
    return Model(name, os.path.abspath(path) if path else None, load_tokenizer(path))


def make_app(client: AsyncClient, model: Model, admin: AdminAuth, memory_saver: bool = False) -> FastAPI:
    """The gateway's app over one AsyncClient (shared by every HTTP request); `admin`: who may call the admin
    routes; `memory_saver`: GatewaySettings.sglang_enable_memory_saver."""
    app = FastAPI(title="Lockstep", docs_url=None, redoc_url=None)
    serving = OpenAIServing(client, model)

    @app.exception_handler(HttpError)
    async def on_http_error(_: Request, e: HttpError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientError)
    async def on_client_error(_: Request, e: ClientError) -> JSONResponse:
        return await on_http_error(_, HttpError.of(e))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return await on_http_error(_, HttpError(Code.BAD_FIELD, message, ".".join(loc) or None))

    @app.get("/health")
    async def health() -> JSONResponse:
        data = await client.health()  # a refusal: on_client_error answers it
        return JSONResponse(data, status_code=200 if data.get("ok") else 503)

    def card() -> dict:
        return {"id": model.name, "object": "model", "created": int(time.time()), "owned_by": "lockstep",
                "root": model.path}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict:
        if not model.matches(model_id):
            raise HttpError(MODEL_NOT_FOUND, f"the model {model_id!r} does not exist; this server serves "
                                             f"{model.name!r}", "model")
        return card()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(await client.stats(), model.name),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def answer(request: Request, body: Any, chat: bool) -> Response:
        try:
            return await answer_or_raise(request, body, chat)
        except HttpError as e:  # a refusal of the structured output names the field that asked for it
            raise body.named(e) from None

    async def answer_or_raise(request: Request, body: Any, chat: bool) -> Response:
        choices, params = serving.parts(body, chat)
        if body.stream:
            events = serving.stream_events(body, chat, choices, params)
            try:  # the first chunk comes once every choice was accepted: a refusal is still an HTTP status
                first = await until_done_or_gone(events.__anext__(), request.is_disconnected)
            except asyncio.CancelledError:
                await events.aclose()
                return Response(status_code=499)

            async def rest():
                try:
                    yield first
                    async for chunk in events:
                        yield chunk
                finally:
                    await events.aclose()  # a client that left cancels its requests
            return StreamingResponse(rest(), media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            result = await until_done_or_gone(serving.respond(body, chat, choices, params), request.is_disconnected)
        except asyncio.CancelledError:
            return Response(status_code=499)  # nobody reads it: the client left, its requests were cancelled
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await answer(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await answer(request, body, chat=True)

    pauses = MemoryPause(client)  # the pauses of both: SGLang's release takes one when none is held
    app.include_router(admin_router(client, admin, pauses))
    app.include_router(sglang_router(client, model, admin, pauses, memory_saver))  # SGLang's routes (docs/http.md)
    app.include_router(trl_router(client, model, admin))  # TRL's vllm-serve routes (docs/rl-frameworks.md)
    return app
