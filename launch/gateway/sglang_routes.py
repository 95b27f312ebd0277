"""SGLang's native routes on the gateway, mapped to what Lockstep has (docs/http.md, "SGLang's native routes"):
`/generate` (launch/gateway/sglang_shape.py shapes it), `/pause_generation` (SGLang's default mode abort; its
in_place is Lockstep's keep), `/continue_generation`, `/flush_cache` (200 once no request runs or waits),
`/abort_request` (`rid` or `abort_all`), `/release_memory_occupation`, `/resume_memory_occupation` (with no pause
held, inside one the gateway takes: launch/gateway/memory_pause.py),
`/update_weights_from_disk` (the caller's `weight_version` label, reported by `/get_weight_version` and each
answer's meta_info), `/server_info` (`enable_memory_saver` as the preset says), `/model_info` (and their `/get_*`
names), `/health_generate`; the weight-sync group's routes come from launch/gateway/sglang_weight_sync.py.

The routes that change the server's state are admin routes, as the gateway's own (the token or a trusted network:
launch/gateway/admin_auth.py); `/generate`, the info routes and `/health_generate` do not. Weight labels live in
this gateway (a restarted gateway reports the numeric versions). Torch-free."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from cluster.client import AsyncClient
from cluster.errors import ClientError, Code
from cluster.outputs import GenerationOutput
from launch.gateway.admin_auth import AdminAuth
from launch.gateway.errors import HttpError
from launch.gateway.memory_pause import MemoryPause
from launch.gateway.openai_serving import Model, sse
from launch.gateway.sglang_shape import GenerateBody, answer, memory_tags, submit_params
from launch.gateway.sglang_weight_sync import weight_sync_router

SGLANG_PAUSE_MODES = {"abort": "abort", "retract": "retract", "in_place": "keep"}  # SGLang's -> Lockstep's


class PauseGenerationBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"  # SGLang's default


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


class MemoryBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tags: list[str] | None = None


class UpdateFromDiskBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True  # accepted: an update drops Lockstep's cached prefixes anyway


@dataclass
class SGLangState:
    """What SGLang's routes keep in the gateway: the requests in flight through /generate, the weight labels."""

    in_flight: set[str] = field(default_factory=set)
    labels: dict[int, str] = field(default_factory=dict)  # Lockstep's weight version -> the caller's label

    def label(self, version: int) -> str:
        return self.labels.get(version, "default" if version == 0 else str(version))


def last_version(out: GenerationOutput) -> int:
    """The weight version of the output's last token (its first, when it has none)."""
    return out.weight_versions[-1][1] if out.weight_versions else out.weight_version


def context_length(model: Model) -> int | None:
    """The checkpoint's max_position_embeddings (config.json), or None."""
    try:
        with open(os.path.join(model.path or "", "config.json")) as f:
            return json.load(f).get("max_position_embeddings")
    except OSError:
        return None


def sglang_router(client: AsyncClient, model: Model, auth: AdminAuth, pauses: MemoryPause,
                  memory_saver: bool = False) -> APIRouter:
    """`pauses`: the gateway's pauses and memory calls (shared with its own admin routes); `memory_saver`: what
    `/server_info` reports as `enable_memory_saver` (cluster/http_config.py sglang_enable_memory_saver)."""
    router, state = APIRouter(), SGLangState()
    router.include_router(weight_sync_router(client, auth, state.labels, lambda: list(state.in_flight)))
    tok = model.tokenizer
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None

    async def one(source: dict[str, Any], rid: str, body: GenerateBody, params: dict) -> dict:
        start = time.perf_counter()
        state.in_flight.add(rid)
        try:
            out = await client.generate(source.get("input_ids"), text=source.get("text"), request_id=rid, **params)
        except ClientError as e:
            raise HttpError.of(e) from None
        finally:
            state.in_flight.discard(rid)
        return answer(out, body, state.label(last_version(out)), time.perf_counter() - start)

    async def streamed(source: dict[str, Any], rid: str, body: GenerateBody, params: dict) -> AsyncIterator[str]:
        start = time.perf_counter()
        state.in_flight.add(rid)
        try:
            async for out in client.stream(source.get("input_ids"), text=source.get("text"), request_id=rid,
                                           **params):
                yield sse(answer(out, body, state.label(last_version(out)), time.perf_counter() - start))
        except ClientError as e:
            yield sse({"error": HttpError.of(e).body()})
        finally:
            state.in_flight.discard(rid)
        yield sse("[DONE]")

    @router.post("/generate")
    async def generate(body: GenerateBody) -> Any:
        sources, batch = body.prompts()
        rids = body.rids(len(sources), uuid.uuid4().hex)
        params = submit_params(body, eos, tok is not None)
        if body.stream:
            if batch:
                raise HttpError(Code.UNSUPPORTED, "stream with a batch of prompts is not supported", "stream")
            return StreamingResponse(streamed(sources[0], rids[0], body, params), media_type="text/event-stream")
        answers = await asyncio.gather(*(one(s, r, body, params) for s, r in zip(sources, rids)))
        return answers if batch else answers[0]

    @router.post("/pause_generation")
    async def pause_generation(request: Request, body: PauseGenerationBody | None = None) -> dict:
        auth.check(request)
        await pauses.pause(SGLANG_PAUSE_MODES[(body or PauseGenerationBody()).mode])
        return {"status": "ok", "message": "Generation paused successfully."}

    @router.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        auth.check(request)
        await pauses.resume()
        return {"status": "ok", "message": "Generation continued successfully."}

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> JSONResponse:
        """200 once no request runs or waits (SGLang's 400 otherwise, which slime retries); the prefix cache needs no
        flush of its own: an update drops it (docs/weights.md)."""
        auth.check(request)
        stats = await client.stats()
        idle = not stats.get("running") and not stats.get("waiting") and not state.in_flight
        return JSONResponse({"success": idle, "message": "Cache flushed." if idle else
                             "Not flushed: requests are running or waiting."}, status_code=200 if idle else 400)

    @router.post("/abort_request")
    async def abort_request(request: Request, body: AbortBody) -> dict:
        """Ends the named request (or, `abort_all`, every /generate request in flight) with finish_reason abort."""
        auth.check(request)
        rids = list(state.in_flight) if body.abort_all else [body.rid] if body.rid else []
        await asyncio.gather(*(client.cancel(r) for r in rids))
        return {"status": "ok", "aborted": rids}

    @router.post("/release_memory_occupation")
    async def release_memory(request: Request, body: MemoryBody | None = None) -> dict:
        """As SGLang, with no pause held too (launch/gateway/memory_pause.py)."""
        auth.check(request)
        return {"success": True} | await pauses.release_memory(memory_tags((body or MemoryBody()).tags))

    @router.post("/resume_memory_occupation")
    async def resume_memory(request: Request, body: MemoryBody | None = None) -> dict:
        auth.check(request)
        return {"success": True} | await pauses.resume_memory(memory_tags((body or MemoryBody()).tags))

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request, body: UpdateFromDiskBody) -> JSONResponse:
        auth.check(request)
        if body.abort_all_requests:
            await asyncio.gather(*(client.cancel(r) for r in list(state.in_flight)))
        try:
            await client.update_weights(body.model_path)
        except ClientError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        version = int((await client.health()).get("weights", {}).get("version", 0))
        if body.weight_version is not None:
            state.labels[version] = body.weight_version
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    @router.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": state.label(int((await client.health()).get("weights", {}).get("version", 0)))}

    async def model_info() -> dict:
        health = await client.health()
        return {"model_path": model.path, "tokenizer_path": model.path if tok is not None else None,
                "is_generation": True, "preferred_sampling_params": None, "served_model_name": model.name,
                "weight_version": state.label(int(health.get("weights", {}).get("version", 0))),
                "has_image_understanding": False, "has_audio_understanding": False}

    async def server_info() -> dict:
        health, stats = await client.health(), await client.stats()
        return await model_info() | {"tp_size": health.get("world_size"), "dp_size": 1,
                                     "context_length": context_length(model), "num_kv_pages": stats.get("num_blocks"),
                                     "version": "lockstep", "enable_memory_saver": memory_saver,
                                     "internal_states": [{"running": stats.get("running"),
                                                          "waiting": stats.get("waiting")}]}

    for path, fn in (("/model_info", model_info), ("/get_model_info", model_info), ("/server_info", server_info),
                     ("/get_server_info", server_info)):
        router.add_api_route(path, fn, methods=["GET"])

    @router.get("/health_generate")
    async def health_generate() -> JSONResponse:
        """200 once a one-token generation went through every rank (SGLang's check), else 503."""
        try:
            await client.generate([eos if isinstance(eos, int) else 0], max_new_tokens=1, request_id=uuid.uuid4().hex)
        except ClientError as e:
            return JSONResponse(HttpError.of(e).body(), status_code=503)
        return JSONResponse({"ok": True})

    return router
