"""TRL's `trl vllm-serve` routes on the gateway (TRL 1.10.0.dev0; docs/rl-frameworks.md, "TRL"), what its
VLLMClient calls, shaped by launch/gateway/trl_shape.py:

- `GET /health/` ({"status": "ok"} once the driver answers ok, else 503), `GET /get_world_size/` (the TP size);
- `POST /generate/` and `/chat/`: each prompt one submit with `n` (n samples from one prefill); its completions next
  to each other, prompts in order: the request's own first, then its children;
- `POST /get_sequence_logprobs/`: each sequence one scoring submit (its prefill's prompt logprobs), json or binary;
- `POST /reset_prefix_cache/`: an admin route (launch/gateway/admin_auth.py) with nothing to do: Lockstep's prefix
  cache is dropped by every weight update and otherwise holds only current-weight pages;
- `POST /init_communicator/`, `/update_named_param/`: 501 `vllm_communicator_unsupported` (TRL's client joins a
  vLLM StatelessProcessGroup and broadcasts through vLLM's PyNcclCommunicator, which Lockstep's ranks do not
  speak); `/close_communicator/`: 200, as none is ever open. Torch-free."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from cluster.client import AsyncClient
from cluster.errors import ClientError
from cluster.outputs import GenerationOutput
from cluster.samples import child_id
from launch.gateway.admin_auth import AdminAuth
from launch.gateway.errors import VLLM_COMMUNICATOR_UNSUPPORTED, HttpError
from launch.gateway.openai_schema import ChatMessage
from launch.gateway.openai_serving import Model, chat_ids
from launch.gateway.trl_shape import (ChatRequest, GenerateRequest, SequenceLogprobsRequest, TrlBody,
                                      completions_answer, sequence_logprobs_binary, sequence_logprobs_json,
                                      submit_params, validated)

NO_COMMUNICATOR = ("TRL's weight sync needs vLLM's own communicator: VLLMClient.init_communicator joins a vLLM "
                   "StatelessProcessGroup (vLLM's store protocol, the trainer at the last rank) and broadcasts each "
                   "tensor through vLLM's PyNcclCommunicator, which Lockstep's ranks do not speak. Update the weights "
                   "with POST /update_weights (a checkpoint directory) or the trainer-owned weight-sync group "
                   "(docs/rl-frameworks.md)")


async def all_or_cancel(client: AsyncClient, rids: list[str], calls: list[Awaitable[Any]]) -> list[Any]:
    """Every call's result; when one fails (or the caller goes), the others' requests are cancelled on the server."""
    try:
        return await asyncio.gather(*calls)
    except BaseException:
        for rid in rids:
            fut = asyncio.ensure_future(client.cancel(rid))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise


def trl_router(client: AsyncClient, model: Model, auth: AdminAuth) -> APIRouter:
    router = APIRouter()
    tok = model.tokenizer
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None

    @router.get("/health/")
    async def health() -> JSONResponse:
        data = await client.health()
        ok = bool(data.get("ok"))
        return JSONResponse({"status": "ok"} if ok else {"status": "unavailable", "health": data},
                            status_code=200 if ok else 503)

    @router.get("/get_world_size/")
    async def get_world_size() -> dict:
        return {"world_size": (await client.health()).get("world_size")}

    async def samples(sources: list[dict[str, Any]], body: TrlBody) -> dict:
        """Each prompt's n completions (the request, then its children), prompts in order."""
        sampling = body.sampling()
        params = submit_params(sampling, body.structured_outputs_regex, eos) | {"n": sampling.n}
        base = f"trl-{uuid.uuid4().hex}"
        rids = [f"{base}-{i}" for i in range(len(sources))]

        async def one(source: dict[str, Any], rid: str) -> list[GenerationOutput]:
            try:
                outs = await client.generate(source.get("input_ids"), text=source.get("text"), request_id=rid,
                                             **params)
            except ClientError as e:
                raise HttpError.of(e) from None
            by_id = {o.request_id: o for o in (outs if isinstance(outs, list) else [outs])}
            return [by_id[rid]] + [by_id[child_id(rid, i)] for i in range(sampling.n - 1)]

        groups = await all_or_cancel(client, rids, [one(s, r) for s, r in zip(sources, rids)])
        return completions_answer(groups, sampling.logprobs is not None)

    @router.post("/generate/")
    async def generate(body: GenerateRequest) -> dict:
        return await samples(body.sources(), body)

    @router.post("/chat/")
    async def chat(body: ChatRequest) -> dict:
        template = body.template_kwargs()
        sources = [{"input_ids": chat_ids(tok, [validated(ChatMessage, m, f"messages.{i}.").for_template()
                                                for m in conversation], **template)}
                   for i, conversation in enumerate(body.messages)]
        return await samples(sources, body)

    @router.post("/get_sequence_logprobs/")
    async def get_sequence_logprobs(body: SequenceLogprobsRequest) -> dict:
        """One scoring submit a sequence: its prefill's prompt logprobs (one sampled token, not reported)."""
        body.check()
        base = f"trl-score-{uuid.uuid4().hex}"
        rids = [f"{base}-{i}" for i in range(len(body.sequences))]

        async def one(sequence: list[int], rid: str) -> GenerationOutput:
            try:
                return await client.generate(sequence, request_id=rid, max_new_tokens=1, do_sample=False,
                                             prompt_logprobs=body.top_logprobs)
            except ClientError as e:
                raise HttpError.of(e) from None

        outs = await all_or_cancel(client, rids, [one(s, r) for s, r in zip(body.sequences, rids)])
        if body.response_format == "binary":
            return sequence_logprobs_binary(outs, body.prompt_lengths, body.top_logprobs)
        return sequence_logprobs_json(outs, body.prompt_lengths)

    @router.post("/reset_prefix_cache/")
    async def reset_prefix_cache(request: Request) -> dict:
        auth.check(request)
        return {"message": "Request received, resetting prefix cache status: True"}

    @router.post("/init_communicator/")
    async def init_communicator() -> dict:
        raise HttpError(VLLM_COMMUNICATOR_UNSUPPORTED, NO_COMMUNICATOR, "init_communicator")

    @router.post("/update_named_param/")
    async def update_named_param() -> dict:
        raise HttpError(VLLM_COMMUNICATOR_UNSUPPORTED, NO_COMMUNICATOR, "update_named_param")

    @router.post("/close_communicator/")
    async def close_communicator() -> dict:
        return {"message": "Request received, closing communicator"}

    return router
