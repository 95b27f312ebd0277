"""SGLang's memory routes and `enable_memory_saver` as slime, AReaL and verl meet them (launch/gateway/memory_pause.py,
cluster/http_config.py), in process over a stand-in for the driver that keeps its rules (one pause owner, a release
refused with `not_paused` while scheduling is not held, what stays released): `/server_info` reports the preset's
`sglang_enable_memory_saver` (false by default, as SGLang's); a release with no pause held runs inside a pause the
gateway takes, which the resume that leaves nothing released lets go; a caller's pause is never let go; refusals
keep their codes and leave no pause of the gateway's behind."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from cluster.errors import Code, MemoryCallRefused
from cluster.http_config import HTTP_SERVE_KEYS, sglang_enable_memory_saver
from launch.gateway.admin_auth import AdminAuth
from launch.gateway.app import make_app
from launch.gateway.openai_serving import Model

AUTH = {"Authorization": "Bearer tok"}
ALL = ["kv_cache", "weights"]


class FakeDriver:
    """The driver's answers to the gateway's one client: `calls` in order, each (call, what it asked or did)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.held, self.released = False, []
        self.refuse: dict[str, list[MemoryCallRefused]] = {"release": [], "resume": []}

    async def pause(self, mode="keep"):
        self.calls.append(("pause", mode))
        self.held = True

    async def resume(self):
        self.calls.append(("resume",))
        self.held = False

    async def release_memory(self, tags, keep_weights_on_host=True):
        if not self.held:
            self.calls.append(("release", tags, Code.NOT_PAUSED))
            raise MemoryCallRefused(Code.NOT_PAUSED, "release_memory needs a paused engine")
        if self.refuse["release"]:
            error = self.refuse["release"].pop(0)
            self.calls.append(("release", tags, error.code))
            raise error
        self.calls.append(("release", tags))
        self.released = [t for t in ALL if t in tags or t in self.released]
        return {"ok": True, "action": "release", "tags": tags, "released": self.released, "ranks": []}

    async def resume_memory(self, tags):
        if self.refuse["resume"]:
            error = self.refuse["resume"].pop(0)
            self.calls.append(("resume_memory", tags, error.code))
            raise error
        self.calls.append(("resume_memory", tags))
        self.released = [t for t in self.released if t not in tags]
        return {"ok": True, "action": "resume", "tags": tags, "released": self.released, "ranks": []}

    async def stats(self):
        return {"running": 0, "waiting": 0, "num_blocks": 64}

    async def health(self):
        return {"ok": True, "world_size": 2, "weights": {"version": 0}}


def gateway(driver: FakeDriver, memory_saver: bool = False) -> TestClient:
    return TestClient(make_app(driver, Model("tiny", "/models/tiny"), AdminAuth.of("tok"), memory_saver))


def post(http: TestClient, route: str, body: dict | None = None):
    answer = http.post(route, json=body if body is not None else {}, headers=AUTH)
    return answer.status_code, answer.json()


def test_server_info_reports_the_presets_memory_saver():
    from launch.gateway.child import GatewayProcess
    from launch.gateway.server import add_arguments, settings_for

    for saver in (False, True):
        http = gateway(FakeDriver(), saver)
        assert [http.get(r).json()["enable_memory_saver"] for r in ("/server_info", "/get_server_info")] == [saver] * 2
    assert sglang_enable_memory_saver(None) is False and sglang_enable_memory_saver({}) is False
    assert sglang_enable_memory_saver({"sglang_enable_memory_saver": True}) is True
    with pytest.raises(ValueError, match="sglang_enable_memory_saver"):
        sglang_enable_memory_saver({"sglang_enable_memory_saver": "yes"})
    assert "sglang_enable_memory_saver" in HTTP_SERVE_KEYS  # the gateway's key: the front door's table leaves it out
    preset = {"serve": {"sglang_enable_memory_saver": True}}
    assert settings_for(None, None, preset).sglang_enable_memory_saver is True
    assert settings_for(None, None, {}).sglang_enable_memory_saver is False
    assert settings_for(None, None, {}, memory_saver=True).sglang_enable_memory_saver is True
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--sglang-enable-memory-saver"]).sglang_enable_memory_saver is True
    child = GatewayProcess("tcp://127.0.0.1:1", "127.0.0.1:1", None, None, (), memory_saver=True)
    assert child.command[-1] == "--sglang-enable-memory-saver"
    assert "--sglang-enable-memory-saver" not in GatewayProcess("tcp://127.0.0.1:1", "127.0.0.1:1", None, None).command


def test_a_release_without_a_pause_runs_in_the_gateways_which_the_last_resume_lets_go():
    """AReaL's and verl's sleep and wake: release, resume (all tags), with no pause held; then slime's two-stage
    resume (weights, then the KV cache and cuda_graph)."""
    driver = FakeDriver()
    http = gateway(driver)
    assert http.get("/flush_cache", headers=AUTH).status_code == 200
    status, body = post(http, "/release_memory_occupation")
    assert status == 200 and body["success"] is True and body["released"] == ALL
    assert driver.calls == [("release", ALL, Code.NOT_PAUSED), ("pause", "keep"), ("release", ALL)]
    assert post(http, "/resume_memory_occupation")[1]["released"] == []
    assert driver.calls[3:] == [("resume_memory", ALL), ("resume",)] and not driver.held  # memory back, then go
    driver.calls.clear()
    assert post(http, "/release_memory_occupation")[0] == 200
    assert post(http, "/resume_memory_occupation", {"tags": ["weights"]})[1]["released"] == ["kv_cache"]
    assert driver.calls[3:] == [("resume_memory", ["weights"])] and driver.held  # the KV cache is still out
    status, body = post(http, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    assert status == 200 and body["released"] == []
    assert driver.calls[4:] == [("resume_memory", ["kv_cache"]), ("resume",)] and not driver.held
    assert post(http, "/resume_memory_occupation")[0] == 200  # nothing of the gateway's is left to let go
    assert driver.calls[6:] == [("resume_memory", ALL)]


def test_slimes_offload_round_hands_the_pause_to_its_update():
    """slime with --offload-rollout (train.py): flush_cache and release after the rollout; onload_weights; the
    update between pause_generation and continue_generation; onload_kv. Its continue ends the pause (the KV cache
    still out holds the driver's steps); onload_kv lets nothing else go."""
    driver = FakeDriver()
    http = gateway(driver)
    assert http.get("/flush_cache", headers=AUTH).status_code == 200
    assert post(http, "/release_memory_occupation")[0] == 200
    assert post(http, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    assert post(http, "/pause_generation")[0] == 200 and http.get("/flush_cache", headers=AUTH).status_code == 200
    assert post(http, "/continue_generation")[0] == 200
    assert post(http, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})[0] == 200
    assert driver.calls == [("release", ALL, Code.NOT_PAUSED), ("pause", "keep"), ("release", ALL),
                            ("resume_memory", ["weights"]), ("pause", "abort"), ("resume",),
                            ("resume_memory", ["kv_cache"])] and not driver.held and driver.released == []


def test_a_callers_pause_is_never_let_go():
    driver = FakeDriver()
    http = gateway(driver)
    assert post(http, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert post(http, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert post(http, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert driver.calls == [("pause", "keep"), ("release", ["kv_cache"]), ("resume_memory", ["kv_cache"])]
    assert driver.held  # the caller's, until its continue
    assert post(http, "/continue_generation")[0] == 200 and driver.calls[-1] == ("resume",)
    # a pause taken inside the gateway's makes it the caller's: the resume of the memory leaves it held
    driver.calls.clear()
    assert post(http, "/release_memory_occupation")[0] == 200
    assert post(http, "/pause_generation")[0] == 200 and post(http, "/resume_memory_occupation")[0] == 200
    assert driver.calls == [("release", ALL, Code.NOT_PAUSED), ("pause", "keep"), ("release", ALL),
                            ("pause", "abort"), ("resume_memory", ALL)] and driver.held
    assert post(http, "/resume")[0] == 200 and not driver.held  # Lockstep's own /resume ends it as well


def test_refusals_keep_their_codes_and_leave_no_pause_of_the_gateways():
    driver = FakeDriver()
    http = gateway(driver)
    driver.refuse["release"].append(MemoryCallRefused(Code.MEMORY_RESTORE_FAILED, "rank 1: out of memory", 1))
    status, body = post(http, "/release_memory_occupation")
    assert status == 503 and body["error"]["code"] == Code.MEMORY_RESTORE_FAILED
    assert driver.calls == [("release", ALL, Code.NOT_PAUSED), ("pause", "keep"),
                            ("release", ALL, Code.MEMORY_RESTORE_FAILED), ("resume",)] and not driver.held
    # a refused resume keeps the gateway's pause (the memory is still out); the next one lets it go
    driver.calls.clear()
    assert post(http, "/release_memory_occupation", {"tags": ["weights"]})[0] == 200
    driver.refuse["resume"].append(MemoryCallRefused(Code.WEIGHTS_NOT_RESTORED, "weights not restored", 0))
    status, body = post(http, "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 409 and body["error"]["code"] == Code.WEIGHTS_NOT_RESTORED and driver.held
    assert post(http, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200 and not driver.held
    assert driver.calls[-2:] == [("resume_memory", ["weights"]), ("resume",)]
    # Lockstep's own /release_memory keeps its contract: a held pause, else 409 not_paused, no pause taken
    driver.calls.clear()
    status, body = post(http, "/release_memory")
    assert status == 409 and body["error"]["code"] == Code.NOT_PAUSED
    assert driver.calls == [("release", ALL, Code.NOT_PAUSED)] and not driver.held
    assert post(http, "/release_memory_occupation", {"tags": ["gpu"]})[0] == 400 and len(driver.calls) == 1
