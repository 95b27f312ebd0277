"""Host lists (per-row parameters, row indices, token ids) as tensors on the logits' device, without a host sync."""

from __future__ import annotations

import torch


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device: on CUDA it goes through pinned memory
    and is copied in stream order (torch keeps the pinned block until the copy has run), so queuing a step's
    sampling behind forwards still in flight never blocks the host."""
    host = torch.tensor(values, dtype=dtype, device="cpu")  # on the host whatever the default device
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
