"""worker/cpu_threads.py: the caller's OpenMP pool is freed before the loop thread runs the forwards, and torch
works on afterwards in both threads (the pool comes back on demand)."""

from __future__ import annotations

import threading

import torch

from worker.cpu_threads import _libgomp, release_openmp_pool


def test_release_frees_the_pool_and_torch_works_on():
    x = torch.randn(256, 4096)
    want = torch.nn.functional.silu(x)  # a parallel region on this thread: its pool exists
    assert release_openmp_pool() is (_libgomp() is not None)
    assert torch.equal(torch.nn.functional.silu(x), want)  # this thread again
    got = {}
    t = threading.Thread(target=lambda: got.update(y=torch.nn.functional.silu(x)))
    t.start()
    t.join()
    assert torch.equal(got["y"], want)


def test_torch_cpu_builds_link_libgomp():
    """The release is not a no-op where the suite runs: torch's Linux CPU wheels use libgomp."""
    torch.nn.functional.silu(torch.randn(64, 4096))
    assert _libgomp() is not None
