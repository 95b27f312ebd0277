"""Clients of a running cluster: `Client` (blocking, thread-safe) and `AsyncClient` (asyncio).

One I/O thread per client (io_thread.py: pings, the silent server's `ServerGone`) owns the socket, so one client
carries thousands of concurrent requests from any number of threads or tasks. A request the server loses is
resumed by default (resume.py, docs/recovery.md). A client connects lazily and pickles as its settings only, so
a handle can be passed into Ray tasks and actors and reconnects in each worker process. Torch-free.
"""

from __future__ import annotations

import asyncio
import os
from asyncio import wrap_future
import threading
import weakref
from concurrent.futures import Future
from typing import Any, AsyncIterator, Callable, Iterator

from cluster import protocol as P
from cluster.client.io_thread import RESUMABLE, IOThread, PendingRequest, settle, then
from cluster.client.resume import Resumer
from cluster.client.results import memory_call_result, weight_update_result
from cluster.client.weights_group import AsyncWeightsGroupCalls, WeightsGroupCalls
from cluster.errors import ClientError, RequestLost, ServerGone, WeightUpdateError  # noqa: F401  (re-exported)
from cluster.outputs import GenerationOutput
from cluster.samples import sample_ids


def one_sample(params: dict) -> None:
    """`Client.stream` follows one request; n samples stream through `AsyncClient.stream(n=...)`, or come whole
    through `generate(n=...)` (the wire streams each sample under its own id: docs/protocol.md)."""
    if params.get("n", 1) != 1:
        raise ClientError(P.Code.BAD_FIELD, "Client.stream() follows one sample: use AsyncClient.stream(n=...) or "
                          "generate(n=...)")


async def merged(reqs: list[PendingRequest], timeout: float | None) -> AsyncIterator[GenerationOutput]:
    """The outputs of several requests as they come, until each one's final; the first error is raised."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(r: PendingRequest) -> None:
        try:
            while not (item := await r.next_item_async(timeout)).is_finished():
                await queue.put(item)
            await queue.put(item)
        except Exception as e:  # handed to the reader
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(r)) for r in reqs]
    try:
        left = len(reqs)
        while left:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= item.is_finished()
            yield item
    finally:
        for t in tasks:
            t.cancel()


class Client(WeightsGroupCalls):
    """Blocking client of the cluster at `address`. `timeout` bounds every wait; `resume`: resubmit the requests the
    server loses, up to `max_resumes` times each, waiting at most `resume_timeout_s` for a healthy server (else
    RequestLost); `on_lost(req, cause)` takes them instead of this client's Resumer (the router's failover)."""

    def __init__(self, address: str = P.DEFAULT_ADDRESS, server_key: bytes | None = None,
                 client_keys: tuple[bytes, bytes] | None = None, timeout: float | None = 600.0,
                 max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES, server_timeout_s: float = 5.0,
                 resume: bool = True, max_resumes: int = 3, resume_timeout_s: float = 60.0,
                 on_lost: Callable[[PendingRequest, ClientError], None] | None = None):
        self.address, self.server_key, self.client_keys = address, server_key, client_keys
        self.timeout, self.max_frame_bytes, self.server_timeout_s = timeout, max_frame_bytes, server_timeout_s
        # (`resume()` is the pause's end: the setting is `auto_resume`)
        self.auto_resume, self.max_resumes, self.resume_timeout_s = resume, max_resumes, resume_timeout_s
        self.resumer = Resumer(self, max_resumes, resume_timeout_s) if on_lost is None else None
        self.on_lost = on_lost if on_lost is not None else self.resumer.lost
        self._io: IOThread | None = None
        self._io_lock = threading.Lock()

    # a handle crosses process boundaries (Ray) as its settings; each process connects on first use
    def __getstate__(self) -> dict:
        names = ("address", "server_key", "client_keys", "timeout", "max_frame_bytes", "server_timeout_s",
                 "max_resumes", "resume_timeout_s")
        return {n: getattr(self, n) for n in names} | {"resume": self.auto_resume}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def io(self) -> IOThread:
        """The I/O thread, opened on first use and again after one ended (server gone, thread failed)."""
        with self._io_lock:
            if self._io is None or self._io.closed:
                old = self._io
                self._io = IOThread(self.address, self.server_key, self.client_keys, self.max_frame_bytes,
                                    self.server_timeout_s, self.on_lost if self.auto_resume else None)
                if old is not None:
                    self._io.adopt(old)  # their callers still collect the errors that ended them
                    self._finalizer.detach()
                # a handle dropped without close() must not leave its thread, socket and pipe behind: a Ray
                # worker process unpickles a fresh handle for every task it runs and lives on after them
                self._finalizer = weakref.finalize(self, self._io.close)
                self._finalizer.atexit = False  # at exit the daemon thread just dies, as before
            return self._io

    def close(self) -> None:
        """Say goodbye (the server cancels this client's requests at once) and close the socket; outstanding calls
        end with `client_closed`. A client garbage-collected without close() closes alike."""
        if self.resumer is not None:
            self.resumer.close()  # requests waiting for a resume end with RequestLost (client_closed)
        with self._io_lock:
            io, self._io = self._io, None
        if io is not None:
            self._finalizer.detach()
            io.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wait(self, fut: Future, timeout: float | None = None) -> Any:
        return fut.result(timeout if timeout is not None else self.timeout)

    # ------------------------------------------------------------------ futures (shared with AsyncClient)
    def submit_future(self, input_ids: list[int] | None = None, *, text: str | None = None,
                      request_id: str | None = None, max_new_tokens: int | None = None, streaming: bool = False,
                      eos_token_id: int | list[int] | None = None, resume_tokens: list[int] | None = None,
                      resume_versions: list[tuple[int, int]] | None = None, resumes: int = 0,
                      stop: list[str] | None = None, return_text: bool = False, logprobs: bool = False,
                      priority: int = 0, top_logprobs: int = 0, max_weight_lag: int | None = None,
                      stale_policy: str | None = None, n: int = 1, prompt_logprobs: int | None = None,
                      logprobs_mode: str | None = None, speculative: bool = True,
                      **sampling: Any) -> tuple[PendingRequest, Future]:
        """Send a submit; the future resolves to the request id once accepted (an id outstanding here raises
        `duplicate_request_id` at once). `resume_tokens` (`resume_versions`, `resumes`): resume by hand
        (docs/recovery.md). Outputs carry `text` when the submit is text, has `stop` strings or `return_text`.
        `priority`: lower numbers are scheduled first (vLLM's meaning; docs/protocol.md "Priority and fairness").
        `top_logprobs` (1..20): each token's most probable alternatives, (token, logprob) pairs, with the logprobs.
        `max_weight_lag`, `stale_policy`: the versions a request may span, and what an update beyond them does
        ("end": finish_reason "stale"; "restart"); unset, the server's preset's (docs/weights.md, "Staleness").
        `n` > 1: n samples of the prompt from one prefill, each a request of its own (`cluster.samples.sample_ids`:
        `<id>__child#<i>`, then the id; collect each with `result`); they are not resumed. `prompt_logprobs` (vLLM's,
        0..20): the final output's `prompt_logprobs` and `prompt_top_logprobs` (the prompt's own logprobs and that many
        alternatives at each position); such a request is not resumed. `logprobs_mode` (vLLM's: `processed_logprobs`,
        `raw_logprobs`, `processed_logits`, `raw_logits`; unset: the server's preset's): what logprobs report.
        `speculative=False`: the request never speculates on a server whose preset sets `speculative`."""
        rid = request_id or os.urandom(12).hex()
        fields: dict[str, Any] = {"max_new_tokens": max_new_tokens, "streaming": streaming, "sampling": sampling,
                                  "request_id": rid, "eos_token_id": eos_token_id}
        # additive fields, sent only when used (an older server ignores what it does not know)
        fields |= {k: v for k, v in (("stop", list(stop) if stop is not None else None), ("return_text", return_text),
                                     ("logprobs", logprobs), ("priority", priority),
                                     ("top_logprobs", top_logprobs), ("stale_policy", stale_policy),
                                     ("logprobs_mode", logprobs_mode),
                                     ("n", n if n != 1 else 0)) if v}
        fields |= {"max_weight_lag": max_weight_lag} if max_weight_lag is not None else {}
        fields |= {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else {}
        fields |= {} if speculative else {"speculative": False}
        fields |= {"text": text} if text is not None else {"input_ids": None if input_ids is None else list(input_ids)}
        io = self.io
        req = PendingRequest(rid, input_ids, dict(fields),
                             resumable=self.auto_resume and n == 1 and prompt_logprobs is None)
        samples = [PendingRequest(i, input_ids) for i in sample_ids(rid, n)[:-1]]  # n samples: the children
        if resume_tokens or resumes:
            fields |= {"resume_tokens": list(resume_tokens or []), "resumes": resumes,
                       "resume_versions": [list(p) for p in resume_versions or []]}
            req.tokens, req.resumes = list(resume_tokens or []), resumes
            req.versions = [tuple(p) for p in resume_versions or []]
        for r in (*samples, req):
            io.track(r)  # before the submit leaves, so no token can slip by

        accepted: Future = Future()

        def on_reply(f: Future) -> None:  # runs before the caller hears of a refusal
            error = f.exception() if not f.cancelled() else ClientError(P.Code.CLIENT_CLOSED, "cancelled")
            if error is None:
                for sample in samples:
                    sample.server = req.server  # one `accepted` names the server for all of them
                settle(accepted, rid)
            elif isinstance(error, ClientError) and error.code in RESUMABLE:
                io.lose(req, error)  # the server was lost before it answered: the resume submits it again
                if req.resumable and io.on_lost is not None:
                    settle(accepted, rid)
                else:  # the caller hears why it was not resumed (RequestLost)
                    io.forget(req)
                    settle(accepted, error=req.final.exception() if req.final.done() else error)
            else:
                for r in (*samples, req):
                    io.finish(r, error=error)
                    io.forget(r)
                settle(accepted, error=error)

        io.call(P.SUBMIT, **fields).add_done_callback(on_reply)
        return req, accepted

    def pause_future(self, pause: bool, mode: str = "keep") -> Future:
        """Pause (or resume); this client then holds the pause (or not) and pings while it does. The reply comes once
        the pause is in force (`mode`: docs/weights.md, "Pause modes")."""
        io = self.io

        def held(msg: dict) -> dict:
            io.set_pause_held(pause)
            return msg

        return then(io.call(P.PAUSE, mode=mode) if pause else io.call(P.RESUME), held)

    def update_weights_future(self, path: str, kv_policy: str = "keep", partial: bool = False) -> Future:
        return then(self.io.call(P.UPDATE_WEIGHTS, path=path, kv_policy=kv_policy, partial=partial),
                    lambda msg: weight_update_result(msg["data"]))

    def memory_future(self, kind: str, tags: tuple[str, ...] | list[str], **fields: Any) -> Future:
        return then(self.io.call(kind, tags=list(tags), **fields), lambda msg: memory_call_result(msg["data"]))

    def data_future(self, kind: str, **fields: Any) -> Future:
        """A call whose reply carries `data` (stats, health, cancel)."""
        return then(self.io.call(kind, **fields), lambda msg: msg["data"])

    def _collect(self, request_id: str) -> PendingRequest:
        req = self.io.requests.get(request_id)
        if req is None:
            raise ClientError(P.Code.UNKNOWN_REQUEST, f"no request {request_id!r} is outstanding on this client")
        return req

    def _forget(self, req: PendingRequest, cancel: bool = False) -> None:
        """Stop tracking a collected request; `cancel`: the server drops it if still running (a stream left early)."""
        req.dropped = True  # a request waiting for its resume is not resumed any more
        io = self._io
        if io is None:
            return
        io.forget(req)
        if cancel and not req.final.done():
            io.call(P.CANCEL, request_id=req.request_id)  # best effort: nobody waits for the reply

    # ------------------------------------------------------------------ calls
    def submit(self, input_ids: list[int] | None = None, **params: Any) -> str:
        """Queue a request; returns its id once the server accepted it (ClientError if rejected)."""
        _, fut = self.submit_future(input_ids, **params)
        return self._wait(fut)

    def result(self, request_id: str, timeout: float | None = None) -> GenerationOutput:
        """The final output of a submitted request (ClientError if the server failed it, ServerGone if it is gone)."""
        req = self._collect(request_id)
        try:
            out = self._wait(req.final, timeout)
        except ClientError:
            self._forget(req)
            raise
        self._forget(req)
        return out

    def generate(self, input_ids: list[int] | None = None, **params: Any) -> GenerationOutput | list[GenerationOutput]:
        """The final output; with `n` > 1 the n samples' (cluster.samples.sample_ids order: children, then it)."""
        rid = self.submit(input_ids, **params)
        n = params.get("n", 1)
        return self.result(rid) if n == 1 else [self.result(i) for i in sample_ids(rid, n)]

    def stream(self, input_ids: list[int] | None = None, **params: Any) -> Iterator[GenerationOutput]:
        """One output per generated token (cumulative tokens, text and logprobs when asked for), then the final."""
        one_sample(params)
        params["streaming"] = True
        req, fut = self.submit_future(input_ids, **params)
        self._wait(fut)
        try:
            while not (item := req.next_item(self.timeout)).is_finished():
                yield item
            yield item
        finally:
            self._forget(req, cancel=True)

    def cancel(self, request_id: str) -> None:
        self._wait(self.data_future(P.CANCEL, request_id=request_id))

    def pause(self, mode: str = "keep") -> None:
        """Hold scheduling until `resume()`; released if this client goes quiet. Returns once the pause is in force.
        `mode`: "keep" (in-flight requests keep their KV), "abort" (they end, finish_reason "abort"), "wait" (running
        ones finish first, nothing new starts) or "retract" (their KV is freed; recomputed on resume)."""
        self._wait(self.pause_future(True, mode))

    def resume(self) -> None:
        self._wait(self.pause_future(False))

    def update_weights(self, path: str, kv_policy: str = "keep", partial: bool = False) -> dict:
        """Load new weights on every rank, all or none: the result, or WeightUpdateError (`rank`, `reason`)."""
        return self._wait(self.update_weights_future(path, kv_policy, partial))

    def release_memory(self, tags: tuple[str, ...] | list[str] = P.MEMORY_TAGS,
                       keep_weights_on_host: bool = True) -> dict:
        """Free the tagged device memory on every rank; this client must hold the pause (else `not_paused`).
        Returns each rank's memory figures; MemoryCallRefused with its `code` when refused."""
        return self._wait(self.memory_future(P.RELEASE_MEMORY, tags, keep_weights_on_host=keep_weights_on_host))

    def resume_memory(self, tags: tuple[str, ...] | list[str] = P.MEMORY_TAGS) -> dict:
        """Take the tagged memory back (`weights_not_restored` if weights without a host copy were not updated)."""
        return self._wait(self.memory_future(P.RESUME_MEMORY, tags))

    def stats(self) -> dict:
        return self._wait(self.data_future(P.STATS))

    def health(self, timeout: float | None = 10.0) -> dict:
        return self._wait(self.data_future(P.HEALTH), timeout)


class AsyncClient(AsyncWeightsGroupCalls):
    """The same calls as `Client`, as coroutines; `stream` is an async iterator."""

    def __init__(self, address: str = P.DEFAULT_ADDRESS, **kwargs: Any):
        self.client = Client(address, **kwargs)  # pickles as its settings, so this does too

    async def submit(self, input_ids: list[int] | None = None, **params: Any) -> str:
        _, fut = self.client.submit_future(input_ids, **params)
        return await wrap_future(fut)

    async def result(self, request_id: str) -> GenerationOutput:
        req = self.client._collect(request_id)
        try:
            return await wrap_future(req.final)
        finally:
            self.client._forget(req)

    async def generate(self, input_ids: list[int] | None = None,
                       **params: Any) -> GenerationOutput | list[GenerationOutput]:
        rid = await self.submit(input_ids, **params)
        n = params.get("n", 1)
        return await self.result(rid) if n == 1 else [await self.result(i) for i in sample_ids(rid, n)]

    async def stream(self, input_ids: list[int] | None = None, **params: Any) -> AsyncIterator[GenerationOutput]:
        """`Client.stream`; with `n` > 1 every sample's outputs as they come (each names its sample's request id),
        until every sample's final."""
        params["streaming"] = True
        req, fut = self.client.submit_future(input_ids, **params)
        await wrap_future(fut)
        reqs = [self.client._collect(i) for i in sample_ids(req.request_id, params.get("n", 1))]
        try:
            if len(reqs) == 1:
                while not (item := await req.next_item_async(self.client.timeout)).is_finished():
                    yield item
                yield item
            else:
                async for item in merged(reqs, self.client.timeout):
                    yield item
        finally:
            for r in reqs:
                self.client._forget(r, cancel=True)

    async def cancel(self, request_id: str) -> None:
        await wrap_future(self.client.data_future(P.CANCEL, request_id=request_id))

    async def pause(self, mode: str = "keep") -> None:
        await wrap_future(self.client.pause_future(True, mode))

    async def resume(self) -> None:
        await wrap_future(self.client.pause_future(False))

    async def update_weights(self, path: str, kv_policy: str = "keep", partial: bool = False) -> dict:
        return await wrap_future(self.client.update_weights_future(path, kv_policy, partial))

    async def release_memory(self, tags: tuple[str, ...] | list[str] = P.MEMORY_TAGS,
                             keep_weights_on_host: bool = True) -> dict:
        return await wrap_future(self.client.memory_future(P.RELEASE_MEMORY, tags,
                                                           keep_weights_on_host=keep_weights_on_host))

    async def resume_memory(self, tags: tuple[str, ...] | list[str] = P.MEMORY_TAGS) -> dict:
        return await wrap_future(self.client.memory_future(P.RESUME_MEMORY, tags))

    async def stats(self) -> dict:
        return await wrap_future(self.client.data_future(P.STATS))

    async def health(self) -> dict:
        return await wrap_future(self.client.data_future(P.HEALTH))

    async def close(self) -> None:
        self.client.close()
