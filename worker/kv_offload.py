"""A rank's host KV pool (`cpu_offload_space`) and the page copies a plan asks for (docs/architecture.md,
"KV offload"): swap-outs then swap-ins, on the compute stream before the step's forward, so they are ordered
between the previous forward and this one without a host sync. Runs of consecutive pages are copied as one slice."""

from __future__ import annotations

import numpy as np
import torch


def system_ram_bytes() -> int | None:
    """Total RAM of this machine (psutil), or None when psutil is not installed."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().total)


def runs(pairs: np.ndarray) -> list[tuple[int, int, int]]:
    """[n, 2] (src, dst) index pairs -> (src start, dst start, length) runs where both sides count up by one."""
    out: list[tuple[int, int, int]] = []
    for src, dst in pairs.tolist():
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            s, d, n = out[-1]
            out[-1] = (s, d, n + 1)
        else:
            out.append((src, dst, 1))
    return out


class HostKVPool:
    """Host slots for the device cache's tensors, one a tensor (`values` False: the keys' only, as the device cache
    holds them: MLA's latent, worker/kv_cache.py)."""

    def __init__(self, num_layers: int, num_slots: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin: bool, values: bool = True):
        shape = (num_slots, page_size, kv_heads, head_dim)
        self.tensors = [torch.zeros(shape, dtype=dtype, pin_memory=pin)
                        for _ in range(num_layers * (2 if values else 1))]
        self.pinned = pin

    def swap(self, device: list[torch.Tensor], page_size: int, swap_out: np.ndarray, swap_in: np.ndarray) -> None:
        """Copy device pages -> host slots (`swap_out`: [n, 2] (page, slot)), then host slots -> device pages
        (`swap_in`: [m, 2] (slot, page)), tensor by tensor (`device`: the cache's `tensors()`). Every rank calls
        it with the same plan (no collective)."""
        out_runs, in_runs = runs(swap_out), runs(swap_in)
        for dev, host in zip(device, self.tensors, strict=True):
            pages = dev.view(-1, page_size, *dev.shape[1:])
            for page, slot, n in out_runs:
                host[slot:slot + n].copy_(pages[page:page + n], non_blocking=self.pinned)
            for slot, page, n in in_runs:
                pages[page:page + n].copy_(host[slot:slot + n], non_blocking=self.pinned)
