"""Where a manager's outputs go: per-request result handlers or a shared list that `get(request_id)` reads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Callable

from cluster.outputs import GenerationOutput


class ResultRouter:
    """Where outputs go: per-request result handlers (through their asyncio loop) or a shared result list, from
    which `get(request_id)` takes that request's next output without disturbing the others."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: deque[GenerationOutput] = deque()
        self.handlers: dict[str, tuple[asyncio.AbstractEventLoop | None, Callable]] = {}

    def register(self, request_id: str, callback: Callable, loop: asyncio.AbstractEventLoop | None) -> None:
        """Send the request's outputs to `callback` through `loop`, or, with none, from the loop thread (be quick)."""
        with self.cond:
            self.handlers[request_id] = handler = (loop, callback)
            early = [o for o in self.pending if o.request_id == request_id]  # what came before it, in order
            for o in early:
                self.pending.remove(o)
            if any(o.is_finished() for o in early):
                del self.handlers[request_id]
        for o in early:
            self._deliver(handler, o)

    def put(self, out: GenerationOutput) -> None:
        with self.cond:
            handler = self.handlers.get(out.request_id)
            if handler is None:
                self.pending.append(out)
                self.cond.notify_all()
                return
            if out.is_finished():  # looked up and removed under one lock
                del self.handlers[out.request_id]
        self._deliver(handler, out)

    @staticmethod
    def _deliver(handler: tuple[asyncio.AbstractEventLoop | None, Callable], out: GenerationOutput) -> None:
        loop, callback = handler
        if loop is None:
            callback(out)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(callback, out)

    def get(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The oldest output (of `request_id`, if given); None after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                for o in self.pending:
                    if request_id is None or o.request_id == request_id:
                        self.pending.remove(o)
                        return o
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(left if left is not None else 0.5)
