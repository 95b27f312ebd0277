"""SGLang's memory release without a held pause (docs/http.md, "SGLang's native routes").

SGLang releases memory on an engine with no request in it and takes no pause; slime, AReaL and verl call
`/release_memory_occupation` after `flush_cache`, holding none. Lockstep's release needs scheduling held: the driver
refuses it with `not_paused` otherwise. So when the driver refuses a release with `not_paused`, the gateway takes a
pause of its own (mode keep: nothing in flight is lost; a request holding pages is recomputed after the resume), has
the release run, and lets that pause go once a resume leaves nothing released. A release refused while that pause
is new lets it go at once. A pause or resume through this gateway (SGLang's `/pause_generation` and
`/continue_generation`, Lockstep's `/pause` and `/resume`) makes the pause the caller's: the gateway never lets a
caller's pause go. The driver decides every step (the refusal, the pause, the release); the gateway only asks.
Torch-free."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.client import AsyncClient
from cluster.errors import ClientError, Code

GATEWAY_PAUSE_MODE = "keep"


class MemoryPause:
    """This gateway's pauses and memory calls over its one client (the driver takes them all as one client's)."""

    def __init__(self, client: AsyncClient):
        self.client = client
        self.owned = False  # the pause in force is the gateway's own, taken for a release
        self.calls = 0  # pauses and resumes asked for by callers: one since a release began makes the pause theirs
        self.lock = asyncio.Lock()  # one memory call at a time through this gateway

    async def pause(self, mode: str) -> None:
        """A caller's pause (it becomes the owner of the pause in force)."""
        self.calls += 1
        await self.client.pause(mode)
        self.owned = False

    async def resume(self) -> None:
        """A caller's resume: the pause ends, whoever took it."""
        self.calls += 1
        await self.client.resume()
        self.owned = False

    async def release_memory(self, tags: list[str], keep_weights_on_host: bool = True) -> dict[str, Any]:
        """The release; with no pause held (the driver's `not_paused`), inside a pause the gateway takes."""
        async with self.lock:
            calls = self.calls
            try:
                return await self.client.release_memory(tags, keep_weights_on_host)
            except ClientError as e:
                if e.code != Code.NOT_PAUSED:
                    raise
            await self.client.pause(GATEWAY_PAUSE_MODE)
            self.owned = self.calls == calls  # a caller that paused or resumed meanwhile owns it
            try:
                return await self.client.release_memory(tags, keep_weights_on_host)
            except ClientError:
                await self.let_go()
                raise

    async def resume_memory(self, tags: list[str]) -> dict[str, Any]:
        """The resume; the gateway's own pause goes once nothing is released (a refusal keeps it)."""
        async with self.lock:
            result = await self.client.resume_memory(tags)
            if not result.get("released"):
                await self.let_go()
            return result

    async def let_go(self) -> None:
        if self.owned:
            self.owned = False
            await self.client.resume()
