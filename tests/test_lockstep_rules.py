"""The lockstep rules are asserted in code, not left as conventions: only the loop thread talks on the
control group while a loop runs, except the holders of a pause between its barriers."""

from __future__ import annotations

import pytest

import cluster
from cluster.dist import ControlThreadError, agree_all_ok


def test_only_the_loop_thread_uses_the_control_group(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    assert agree_all_ok(True, m.groups) == [True]  # no loop yet: the caller may
    m.start()
    try:
        with pytest.raises(ControlThreadError, match="only the loop thread"):
            agree_all_ok(True, m.groups)
        with m.pause():  # the loop is parked and lends the channel to the holders
            assert agree_all_ok(True, m.groups) == [True]
        rid = m.add_request([1, 2, 3], max_new_tokens=3)  # the loop has left the park once this is done
        assert len(m.get_result(rid, timeout=30).generated_tokens) == 3
        with pytest.raises(ControlThreadError):
            agree_all_ok(True, m.groups)
    finally:
        m.stop()
        m.destroy()
    assert agree_all_ok(True, m.groups) == [True]  # the loop ended: the channel is free again


def test_an_update_that_moves_graph_storage_stops_the_loop(make_checkpoint):
    """After every applied update the runner's captured-graph addresses are checked; a move refuses to serve."""
    from worker.weights import WeightsDiverged

    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    m.start()
    try:
        m.update_weights(str(make_checkpoint("llama")))  # nothing moved: served on
        assert m.is_running()
        m.runner.check_graph_addresses = lambda: ["model.layers.0.self_attn.qkv.weight"]  # as if param.data = new
        with pytest.raises(WeightsDiverged, match="captured CUDA graphs"):
            m.update_weights(str(make_checkpoint("llama")))
        m.join(timeout=10)
        assert not m.is_running() and m.failure_code == "weights_diverged"
        with pytest.raises(RuntimeError):
            m.add_request([1, 2, 3], max_new_tokens=2)
    finally:
        m.stop()
        m.destroy()


def test_the_loop_owns_the_control_group_from_start_on(make_checkpoint, monkeypatch):
    """The channel is the loop's as soon as `start()` returns, even before its thread first runs (a loaded host)."""
    import threading

    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    late, run_loop = threading.Event(), m._run_loop
    monkeypatch.setattr(m, "_run_loop", lambda: (late.wait(10), run_loop()))
    m.start()
    try:
        with pytest.raises(ControlThreadError, match="only the loop thread"):
            agree_all_ok(True, m.groups)
    finally:
        late.set()
        m.stop()
        m.destroy()
