"""Host values (per-row parameters, row indices, token ids) as device tensors without a host sync."""

from __future__ import annotations

from typing import Any

import torch


def on_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array as a tensor on `device` without waiting for it: on CUDA through pinned memory, copied in
    stream order (torch keeps the pinned block until the copy ran), so queuing work never blocks the host."""
    host = torch.tensor(values, dtype=dtype, device="cpu")  # on the host whatever the default device
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
