"""The manager's queue limit (`max_queue_size`), at submit: under a limit, the submit past it raises QueueFull, the
queued requests counted by a scan of the live ones; without one, no submit scans them (a scan a submit made feeding
a generate_batch of N requests O(N^2))."""

from __future__ import annotations

import pytest

import cluster
from cluster.errors import QueueFull


class Scanned(dict):
    """The manager's live requests, counting the scans of them."""

    scans = 0

    def values(self):
        self.scans += 1
        return super().values()


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return cluster.load(make_checkpoint("llama"))


@pytest.mark.parametrize("limit", [0, 3])
def test_submit_scans_the_live_requests_only_under_a_limit(model, limit):
    manager = model.init_continuous_batching(
        continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16, max_queue_size=limit))
    try:  # never started: what is submitted stays queued
        manager.requests = Scanned()
        n = limit or 200
        for _ in range(n):
            manager.submit(manager.build_request([1, 2, 3], max_new_tokens=2))
        assert len(manager.requests) == n
        if limit:
            with pytest.raises(QueueFull) as e:
                manager.submit(manager.build_request([1, 2, 3], max_new_tokens=2))
            assert f"max_queue_size={limit}" in str(e.value) and len(manager.requests) == limit
            assert manager.requests.scans == limit + 1
        else:
            assert manager.requests.scans == 0
    finally:
        manager.destroy()
