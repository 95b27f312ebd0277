"""The weights a restarted group serves (driver/frontdoor/served_weights.py), at TP=1 in process: the last checkpoint
update is loaded again and served under its version; pushed weights that cannot be restored are reported as
lost, and their version number is never served with other weights."""

from __future__ import annotations

import json

import pytest

from driver.frontdoor.served_weights import ServedWeights, WeightsRecord, restore
from tests.conftest import hf_greedy


def test_the_record_follows_updates():
    w = ServedWeights().after_update("checkpoint", "/ckpt/b", 1)
    assert (w.version, w.source, w.restorable_version, w.restorable_path) == (1, "checkpoint", 1, "/ckpt/b")
    w = w.after_update("push", None, 2)
    assert (w.version, w.source, w.path, w.restorable_version, w.restorable_path) == (2, "push", None, 1, "/ckpt/b")


@pytest.fixture
def manager(make_checkpoint):
    import cluster

    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    yield m
    m.stop()
    m.destroy()


def generate(m, prompt: list[int]):
    m.start()
    rid = m.add_request(prompt, max_new_tokens=6, eos_token_id=-1)
    while not (out := m.get_result(rid, timeout=60)).is_finished():
        pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pushed", [False, True], ids=["checkpoint", "push_after_it"])
def test_a_restart_serves_the_last_checkpoint_under_its_version(manager, make_checkpoint, tmp_path, pushed):
    dir_b = make_checkpoint("llama", seed=1)
    record = WeightsRecord(tmp_path / "weights.json")
    last = ServedWeights().after_update("checkpoint", str(dir_b), 1)
    record.write(last.after_update("push", None, 2) if pushed else last)
    served = restore(manager, record)
    assert (served.version, served.source, served.path) == (1, "checkpoint", str(dir_b))
    assert served.lost_version == (2 if pushed else None)  # the pushed version is reported, never served
    assert manager.updates.version == 1 and manager.engine.weight_version == 1
    assert json.loads((tmp_path / "weights.json").read_text())["version"] == 1
    prompt = [1, 30, 31, 32]
    out = generate(manager, prompt)
    assert out.generated_tokens == hf_greedy(dir_b, [prompt], 6)[0] and out.weight_versions == [(0, 1)]


def test_a_lost_push_without_checkpoint_serves_the_initial_weights_as_version_0(manager, make_checkpoint,
                                                                               tmp_path):
    record = WeightsRecord(tmp_path / "weights.json")
    record.write(ServedWeights().after_update("push", None, 1))
    served = restore(manager, record)
    assert (served.version, served.source, served.lost_version) == (0, "initial", 1)
    prompt = [1, 30, 31, 32]
    out = generate(manager, prompt)
    assert out.generated_tokens == hf_greedy(make_checkpoint("llama"), [prompt], 6)[0]
    assert out.weight_versions == [(0, 0)]


def test_no_record_serves_the_model_as_it_is(manager, tmp_path):
    served = restore(manager, WeightsRecord(tmp_path / "absent.json"))
    assert served == ServedWeights() and manager.engine.weight_version == 0
