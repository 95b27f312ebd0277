"""Waking a thread that sleeps in `zmq.Poller.poll`: register `fd` for POLLIN; any thread calls `wake`; the poller
calls `drain` when `fd` fired. After `close`, `wake` does nothing (a closed descriptor's number may be reused)."""

from __future__ import annotations

import os
import threading
from contextlib import suppress


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            if self._write < 0:
                return
            with suppress(BlockingIOError):  # full: the thread is awake anyway
                os.write(self._write, b"x")

    def drain(self) -> None:
        os.read(self.fd, 65536)

    def close(self) -> None:
        with self._lock:
            if self._write < 0:
                return
            os.close(self.fd)
            os.close(self._write)
            self.fd = self._write = -1
