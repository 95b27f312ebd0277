"""The result maps of admin calls as a client returns them: the map when its `ok` is true, else the typed error
that says why (docs/protocol.md, "The reference client"). Torch-free."""

from __future__ import annotations

from typing import Any

from cluster import protocol as P
from cluster.errors import MemoryCallRefused, WeightsGroupError, WeightUpdateError


def first_rank(data: dict) -> int | None:
    """The first refusing rank a result names, when it names one."""
    rank: Any = data.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def weight_update_result(data: dict) -> dict:
    """The result of a weight update (or of one bucket of a trainer group's update), or WeightUpdateError (`error`,
    and `rank` when known) when refused."""
    if data.get("ok") is True:
        return data
    raise WeightUpdateError(str(data.get("error") or "the cluster refused the update"), first_rank(data), data)


def memory_call_result(data: dict) -> dict:
    """The result of release_memory / resume_memory, or MemoryCallRefused (its `code`, `rank`) when refused."""
    if data.get("ok") is True:
        return data
    raise MemoryCallRefused(str(data.get("code") or P.Code.INTERNAL), str(data.get("error")), first_rank(data), data)


def group_call_result(data: dict) -> dict:
    """The result of a `weights_group` call, or WeightsGroupError (its `code`, the first refusing `rank`)."""
    if data.get("ok") is True:
        return data
    raise WeightsGroupError(str(data.get("code") or P.Code.INTERNAL), str(data.get("error")), first_rank(data), data)
