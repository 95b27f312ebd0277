"""The device queue as the host sees it: work is submitted in order and waited for only when its result is
needed (docs/architecture.md, "Overlapped scheduling"). `InlineStream` runs each function at once (on CUDA
that only enqueues device work; `result()` waits on an event recorded after it). `ThreadStream` simulates an
asynchronous device on the CPU: one daemon thread runs the functions in order (benchmarks/control_plane.py);
only stand-in forwards that read no static buffers run there, as the host prepares the next step meanwhile."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Generic, TypeVar

import torch

T = TypeVar("T")


class Handle(Generic[T]):
    """The outcome of one submitted function: `result()` waits for it (and re-raises what it raised)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._value = self._event = None  # _event: a CUDA event recorded after the function's device work

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def in_order(self) -> T:
        """The value, for a function submitted after this one on the same stream: stream order makes it ready,
        so nothing waits (on CUDA its device work is queued ahead of the caller's)."""
        if not self._done.is_set():
            raise RuntimeError("in_order() read a handle before its function ran: submit on the same stream")
        return self.value()

    def value(self) -> T:
        """Wait for the function itself (a ThreadStream's thread), not for device work it queued on CUDA: what
        the serial paths need, since whatever reads the value queues behind that work anyway."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def result(self) -> T:
        """The value, once the function and the device work it queued (on CUDA) are done."""
        value = self.value()
        if self._event is not None:
            self._event.synchronize()
        return value


class InlineStream:
    """Runs each function now, on the calling thread; on CUDA `result()` waits for the device work it queued."""

    def __init__(self, device: torch.device):
        self.device, self.busy_s = device, 0.0  # busy_s: host seconds inside submitted functions (the CPU's busy time)

    def submit(self, fn: Callable[[], T]) -> Handle[T]:
        h: Handle[T] = Handle()
        t0 = time.perf_counter()
        try:
            value = fn()
        finally:
            self.busy_s += time.perf_counter() - t0
        if self.device.type == "cuda":
            h._event = torch.cuda.Event()
            h._event.record()
        h._set(value)
        return h

    def close(self) -> None:
        pass


class ThreadStream:
    """One daemon thread runs the functions in order: a simulated asynchronous device (`busy_s`: its busy time)."""

    def __init__(self, device: torch.device):
        self.device, self.busy_s = device, 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="lockstep-device", daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> Handle[T]:
        h: Handle[T] = Handle()
        self._queue.put((fn, h))
        return h

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while (item := self._queue.get()) is not None:
            fn, h = item
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    h._set(fn())
            except BaseException as e:  # noqa: BLE001  (handed to whoever waits on the handle)
                h._set(error=e)
            self.busy_s += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the thread after what is queued (it is a daemon: a hung collective does not block exit)."""
        self._queue.put(None)


Stream = InlineStream | ThreadStream
