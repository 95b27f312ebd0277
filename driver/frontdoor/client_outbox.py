"""Sends from the front door that never block: one client that stops reading cannot stall the others. A message a
full pipe refuses waits in that client's backlog (`flush` retries); a backlog reaching `max_backlog` is dropped and
`on_overflow(ident)` runs. With ROUTER_MANDATORY a send to a client that is gone raises at once: `on_gone(ident)`."""

from __future__ import annotations

import errno
from collections import deque
from typing import Callable

import zmq

SENT, FULL, GONE = 0, 1, 2


class ClientOutbox:
    def __init__(self, sock: zmq.Socket, max_backlog: int, on_overflow: Callable[[bytes], None],
                 on_gone: Callable[[bytes], None]):
        self.sock, self.max_backlog = sock, max_backlog
        self.on_overflow, self.on_gone = on_overflow, on_gone
        self.backlogs: dict[bytes, deque[bytes]] = {}

    def send(self, ident: bytes, frame: bytes) -> None:
        """Send now, or queue behind what this client has not taken yet."""
        backlog = self.backlogs.get(ident)
        if backlog is not None:
            if len(backlog) < self.max_backlog:
                backlog.append(frame)
            else:
                self.drop(ident)
                self.on_overflow(ident)
            return
        result = self._try(ident, frame)
        if result == FULL:
            self.backlogs[ident] = deque([frame])
        elif result == GONE:
            self.on_gone(ident)

    def send_if_possible(self, ident: bytes, frame: bytes) -> bool:
        """One try, no backlog (the last words to a client being cut off)."""
        return self._try(ident, frame) == SENT

    def flush(self) -> None:
        """Send what waits, for every client whose pipe has room again."""
        for ident, backlog in list(self.backlogs.items()):
            while backlog:
                result = self._try(ident, backlog[0])
                if result == FULL:
                    break
                if result == GONE:
                    self.drop(ident)
                    self.on_gone(ident)
                    break
                backlog.popleft()
            else:
                del self.backlogs[ident]

    def drop(self, ident: bytes) -> None:
        self.backlogs.pop(ident, None)

    def pending(self) -> int:
        """Messages waiting in all backlogs."""
        return sum(len(b) for b in self.backlogs.values())

    def _try(self, ident: bytes, frame: bytes) -> int:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
            return SENT
        except zmq.Again:
            return FULL
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                return GONE
            raise
