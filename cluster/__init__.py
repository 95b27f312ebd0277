"""Lockstep's public face: the names of shared/API.md. The heavy ones (`load`, the manager) are imported on
first use, so a client or a Ray task can `import cluster` without importing torch."""

from __future__ import annotations

from typing import Any

from cluster.config import ContinuousBatchingConfig
from cluster.errors import (ClientError, LockstepError, MemoryCallRefused, ModelRefused, RequestLost, ServerGone,
                            WeightUpdateError)
from cluster.outputs import GenerationOutput, RequestStatus

__all__ = ["load", "ContinuousBatchingConfig", "ContinuousBatchingManager", "GenerationOutput", "RequestStatus",
           "Client", "AsyncClient", "ClientError", "LockstepError", "RequestLost", "ServerGone", "WeightUpdateError",
           "MemoryCallRefused", "ModelRefused"]

_LAZY = {"Client": ("cluster.client", "Client"), "AsyncClient": ("cluster.client", "AsyncClient"),
         "load": ("launch.load", "load"),
         "ContinuousBatchingManager": ("driver.api.manager", "ContinuousBatchingManager")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        globals()[name] = value = getattr(importlib.import_module(module), attr)
        return value
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
