"""A submitted request as its client sees it: a future for the final output, a queue of streamed outputs (the last
one final, or the error that ended it), and what a resume needs (docs/recovery.md). Torch-free."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any

from cluster.outputs import GenerationOutput, RequestStatus, join_versions


def settle(fut: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Resolve `fut` once; a future already done (or cancelled by an asyncio waiter) is left alone."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        return True
    except InvalidStateError:
        return False


class PendingRequest:
    def __init__(self, request_id: str, prompt_ids: list[int] | None, fields: dict[str, Any] | None = None,
                 resumable: bool = False):
        self.request_id = request_id
        self.prompt_ids = prompt_ids or []
        self.fields = fields or {}  # the submit as first sent (a resume adds resume_tokens, resume_versions, resumes)
        self.resumable = resumable  # the client resumes it when the server loses it
        self.tokens: list[int] = []  # delivered so far (streamed); a resume sends them back
        self.versions: list[tuple[int, int]] = []  # their compact weight versions
        self.text: str | None = None  # the text streamed so far (when the submit asked for text)
        self.logprobs: list[float] = []  # the streamed tokens' logprobs (when asked for)
        self.top_logprobs: list | None = None  # their most probable tokens, [(token, logprob), ...] each (asked for)
        self.resumes = 0  # resumes the server accepted
        self.dropped = False  # its caller stopped waiting for it (never resumed then)
        self.server: str | None = None  # the id of the server that accepted it (its `accepted` names it)
        self.final: Future = Future()
        self.stream: queue.Queue = queue.Queue()
        self._arrivals: list[Future] = []  # resolved at the next put (asyncio waiters await them)
        self._arrivals_lock = threading.Lock()

    def resume_fields(self) -> dict[str, Any]:
        """The submit that resumes it: the first one plus what was delivered, counting this resume."""
        return self.fields | {"resume_tokens": list(self.tokens), "resume_versions": [list(p) for p in self.versions],
                              "resumes": self.resumes + 1}

    def delivered(self, index: int, tokens: list[int], versions: list[list[int]], text: str | None = None,
                  logprobs: list[float] | None = None, top_logprobs: list | None = None) -> GenerationOutput | None:
        """Streamed tokens from generated index `index`: the new ones are kept and the cumulative output returned;
        a repeat of tokens held (a resume's overlap) returns None. A gap: ValueError."""
        have = len(self.tokens)
        if index > have:
            raise ValueError(f"request {self.request_id}: tokens from index {index}, but only {have} arrived")
        fresh = tokens[have - index:]
        if not fresh:
            return None
        self.tokens.extend(fresh)
        self.versions = join_versions(self.versions, [(max(i, have), v) for i, v in versions])
        if isinstance(text, str):  # a message's text belongs to its tokens: an overlapping one's is already here
            self.text = (self.text or "") + (text if index == have else "")
        if isinstance(logprobs, list):
            self.logprobs.extend(logprobs[have - index:])
        if isinstance(top_logprobs, list):
            self.top_logprobs = (self.top_logprobs or []) + top_logprobs[have - index:]
        return GenerationOutput(request_id=self.request_id, prompt_ids=self.prompt_ids,
                                generated_tokens=list(self.tokens), logprobs=list(self.logprobs),
                                status=RequestStatus.DECODING, weight_versions=list(self.versions),
                                weight_version=self.versions[0][1] if self.versions else 0, resumes=self.resumes,
                                text=self.text, top_logprobs=None if self.top_logprobs is None else
                                list(self.top_logprobs))

    def end(self, error: BaseException) -> None:
        """End it with `error` (to its stream and its future), unless it already ended."""
        if not self.final.done():
            self.put(error)
            settle(self.final, error=error)

    def put(self, item: GenerationOutput | Exception) -> None:
        with self._arrivals_lock:
            self.stream.put(item)
            waiting, self._arrivals = self._arrivals, []
        for fut in waiting:
            settle(fut)

    def arrival(self) -> Future:
        """A future resolved once the stream holds an item (at once if it already does)."""
        fut: Future = Future()
        with self._arrivals_lock:
            if self.stream.empty():
                self._arrivals.append(fut)
            else:
                settle(fut)
        return fut

    @staticmethod
    def _checked(item: GenerationOutput | Exception) -> GenerationOutput:
        if isinstance(item, Exception):
            raise item
        return item

    def next_item(self, timeout: float | None) -> GenerationOutput:
        """The next streamed output; the error that ended the request is raised."""
        try:
            return self._checked(self.stream.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError(f"no output for request {self.request_id!r} within {timeout} s") from None

    async def next_item_async(self, timeout: float | None) -> GenerationOutput:
        """`next_item` for asyncio: waits without holding a thread."""
        while True:
            try:
                return self._checked(self.stream.get_nowait())
            except queue.Empty:
                pass
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.arrival()), timeout)
            except TimeoutError:  # asyncio's, since 3.11 the builtin
                raise TimeoutError(f"no output for request {self.request_id!r} within {timeout} s") from None
