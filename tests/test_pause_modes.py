"""Pause modes and staleness with real processes at TP=2 (docs/weights.md, "Pause modes" and "Staleness"): every
mode of `manager.pause` under load with a weight update inside, then `max_weight_lag` at an update (tokens checked
against transformers on the checkpoint of each token's version); the same modes through `Client.pause(mode=...)`
and HTTP `/pause`, the preset's default bound, and finish reasons "abort" and "stale" on the wire and in HTTP. No
request is lost or duplicated, and requests submitted during a pause start only after it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cluster.client.client import Client
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.pause_modes_rank import MODES, NEW, N

FINISHED, CANCELLED = int(RequestStatus.FINISHED), int(RequestStatus.CANCELLED)


def reference(dirs: list[str], version: int, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens of each prompt on the checkpoint of weight version `version`."""
    return hf_greedy(Path(dirs[version]), prompts, NEW)


def continuation(dirs: list[str], version: int, prompt: list[int], done: list[int]) -> list[int]:
    return hf_greedy(Path(dirs[version]), [prompt + done], NEW - len(done))[0]


def check_one_version(o: dict, dirs: list[str], prompt: list[int]) -> int:
    """A request that ran under one version: exactly transformers on that checkpoint; returns the version."""
    assert len(o["versions"]) == 1 and o["versions"][0][0] == 0, o
    version = o["versions"][0][1]
    assert o["tokens"] == reference(dirs, version, [prompt])[0], o["id"]
    return version


def check_mode(mode: str, r: dict, dirs: list[str]) -> None:
    outs, inside = r["outs"], r["inside"]
    assert len(outs) == N and len({o["id"] for o in outs}) == N  # one final output each, none lost
    assert inside["during_untouched"] and inside["during_still_untouched"], inside
    old = MODES.index(mode)  # each mode's pause updates the weights once: version k -> k + 1
    new = old + 1
    # requests added inside the pause: none started before it ended, each exactly transformers on the new weights
    for o, prompt in zip(r["during"], r["during_prompts"]):
        assert check_one_version(o, dirs, prompt) == new and o["pauses"] == [] and o["status"] == FINISHED
    spans = [len(o["versions"]) for o in outs]
    for o, prompt in zip(outs, r["prompts"]):
        n = len(o["tokens"])
        if mode == "abort":  # ended at once, partial output of the old weights, the mode named
            assert o["status"] == CANCELLED and o["finish_reason"] == "abort" and o["pauses"] == [[n, "abort"]], o
            assert o["tokens"] == reference(dirs, old, [prompt])[0][:n]
            continue
        assert o["status"] == FINISHED and o["finish_reason"] in ("stop", "length"), o
        if len(o["versions"]) == 1:  # waiting at the pause, or (wait) finished before it took effect
            v = check_one_version(o, dirs, prompt)
            assert o["pauses"] == ([] if mode == "wait" and v == old else [[0, mode]]), o
            continue
        (_, v0), (cut, v1) = o["versions"]
        assert (v0, v1) == (old, new) and o["pauses"] == [[cut, mode]], o
        assert o["tokens"][:cut] == reference(dirs, old, [prompt])[0][:cut]
        if mode == "retract":  # its KV was freed: re-prefilled under the new weights, transformers' continuation
            assert o["tokens"][cut:] == continuation(dirs, new, prompt, o["tokens"][:cut]), o["id"]
    if mode == "abort":
        assert inside == inside | {"running": 0, "waiting": 0}
        assert any(o["tokens"] for o in outs) and any(not o["tokens"] for o in outs)
    elif mode == "wait":  # the running ones finished on the old weights, the waiting ones start on the new
        assert inside["running"] == 0 and spans == [1] * N
        assert {o["versions"][0][1] for o in outs} == {old, new}
    elif mode == "retract":
        assert inside["running"] == 0 and 2 in spans and 1 in spans
    else:  # keep: frozen with their KV
        assert inside["running"] > 0 and 2 in spans and 1 in spans


def check_staleness(r: dict, dirs: list[str]) -> None:
    old, new = len(dirs) - 2, len(dirs) - 1
    for o, prompt, kind in zip(r["outs"], r["prompts"], r["kinds"]):
        assert o["status"] == FINISHED, o
        if kind == "end":  # ended at the update with its partial output, every token of the old weights
            assert o["finish_reason"] == "stale" and o["versions"] == [[0, old]] and 0 < len(o["tokens"]) < NEW, o
            assert o["tokens"] == reference(dirs, old, [prompt])[0][:len(o["tokens"])]
        elif kind in ("restart", "unstarted"):  # wholly on the new weights
            assert check_one_version(o, dirs, prompt) == new and o["finish_reason"] != "stale"
            assert o["stale_restarts"] == (kind == "restart"), o
        else:  # within its bound: on, across the update
            assert [v for _, v in o["versions"]] == [old, new] and o["finish_reason"] != "stale", o


@pytest.mark.slow
def test_pause_modes_and_staleness_tp2(make_checkpoint, tmp_path):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    proc = run_ranks("pause_modes_rank.py", [str(dir_a), str(dir_b), str(tmp_path)], timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rec = read_json(tmp_path / "pause_modes.rank0.json")
    dirs = rec["dirs"]
    for mode in MODES:
        check_mode(mode, rec[mode], dirs)
    check_staleness(rec["stale"], dirs)
    assert rec["streaming_restart"] == "bad_field" and rec["update"]["version"] == len(dirs) - 1
    assert read_json(tmp_path / "pause_modes.rank1.json")["rank"] == 1


def test_pause_modes_and_staleness_in_process_tp1(make_checkpoint, tmp_path):
    """The same scenario in this process at TP=1 (the fast tier's test of the pause modes' logic), on a MoE
    checkpoint (Qwen3-MoE, routing that varies; the TP=2 test above runs Llama): no part of the modes is the
    model's, and this run is also the check that they hold on MoE models, updates of expert tensors included."""
    from tests.scripts.pause_modes_rank import run

    rec = run(str(make_checkpoint("qwen3_moe")), str(make_checkpoint("qwen3_moe", seed=1)), str(tmp_path))
    for mode in MODES:
        check_mode(mode, rec[mode], rec["dirs"])
    check_staleness(rec["stale"], rec["dirs"])
    assert rec["streaming_restart"] == "bad_field" and rec["update"]["version"] == len(rec["dirs"]) - 1


# ------------------------------------------------------------------ the serving pause: Client, wire and HTTP
HTTP_TOKEN = "pause-modes-token"


@pytest.fixture(scope="module")
def server(make_checkpoint):
    """TP=2 `lockstep serve --http`: 4 requests run at once, and the preset bounds every request's weight lag to 0."""
    from launch.torchrun import free_port
    from tests.serving import fast_config, serve

    port = free_port()
    config = (fast_config().replace("max_requests_per_batch = 64", "max_requests_per_batch = 4")
              .replace("[serve]", "max_weight_lag = 0\n\n[serve]") + f'http_admin_token = "{HTTP_TOKEN}"\n')
    with serve(make_checkpoint("llama"), 2, config, extra=["--http", f"127.0.0.1:{port}"]) as s:
        s.http = f"http://127.0.0.1:{port}"
        yield s


def tokens_move(c: Client, before: int, at_least: int = 8, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while c.stats()["tokens_generated"] < before + at_least and time.monotonic() < deadline:
        time.sleep(0.02)


# the paused requests' length: the pause must find them running. With NEW tokens a fresh-clone run found all six
# finished before a "keep" pause took effect (a step of the tiny model takes milliseconds)
HELD_NEW = 2 * NEW


@pytest.mark.slow
def test_client_pause_modes_tp2(server, make_checkpoint):
    from tests.scripts.update_rank import prompts

    dir_a = make_checkpoint("llama")
    with Client(server.address, timeout=120) as c:
        for k, mode in enumerate(MODES):
            ps, later = prompts(6, 50 + k), prompts(2, 60 + k)
            before = c.stats()["tokens_generated"]
            rids = [c.submit(p, max_new_tokens=HELD_NEW) for p in ps]
            tokens_move(c, before)
            c.pause(mode)  # returns once in force: "wait" once the running ones finished
            held = c.stats()
            assert held["frontend"]["paused"] and (mode == "keep" or held["running"] == 0), (mode, held)
            during = [c.submit(p, max_new_tokens=NEW) for p in later]
            time.sleep(0.5)  # a request admitted now would have produced tokens by then
            still = c.stats()
            assert (still["tokens_generated"], still["step"]) == (held["tokens_generated"], held["step"]), mode
            c.resume()
            outs, late = [c.result(r) for r in rids], [c.result(r) for r in during]
            want = hf_greedy(dir_a, ps, HELD_NEW)
            assert [o.request_id for o in outs] == rids and all(o.weight_versions == [(0, 0)] for o in late)
            assert [o.generated_tokens for o in late] == hf_greedy(dir_a, later, NEW)  # after the pause, whole
            assert all(o.pauses is None for o in late)
            if mode == "abort":
                assert all(o.status == RequestStatus.CANCELLED and o.finish_reason == "abort" for o in outs)
                assert all(o.pauses == [(len(o.generated_tokens), "abort")] for o in outs)
                assert [o.generated_tokens for o in outs] == [w[:len(o.generated_tokens)] for o, w in zip(outs, want)]
                assert any(o.generated_tokens for o in outs)
                continue
            # one weight version throughout: keep, wait and retract give transformers' tokens exactly
            assert [o.generated_tokens for o in outs] == want and all(o.status == RequestStatus.FINISHED for o in outs)
            noted = [o.pauses for o in outs]
            if mode == "wait":  # the running ones finished before it; the waiting ones started after it
                assert all(p in (None, [(0, "wait")]) for p in noted) and None in noted and [(0, "wait")] in noted
            else:  # every request was held, those running with their tokens so far
                assert all(p is not None and len(p) == 1 and p[0][1] == mode for p in noted), noted
                assert any(p[0][0] > 0 for p in noted)


@pytest.mark.slow
def test_staleness_and_finish_reasons_on_the_wire_and_http(server, make_checkpoint):
    from cluster.errors import ClientError
    from tests.scripts.update_rank import prompts
    from tests.test_http import http

    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    with Client(server.address, timeout=120) as c:
        version = c.health()["weights"]["version"]
        for params, name in ((dict(streaming=True, stale_policy="restart"), "stale_policy"),  # streamed tokens
                             (dict(stop=["x"], stale_policy="restart"), "stale_policy"),  # are never taken back
                             (dict(max_weight_lag=-1), "max_weight_lag"), (dict(stale_policy="later"), "stale_policy")):
            with pytest.raises(ClientError) as e:
                c.submit([1, 2, 3], max_new_tokens=2, **params)
            assert e.value.code == "bad_field" and name in e.value.message, e.value
        with pytest.raises(ClientError) as e:
            c.pause("freeze")
        assert e.value.code == "bad_field" and "mode" in e.value.message
        ps = prompts(4, 70)
        before = c.stats()["tokens_generated"]
        stale = [c.submit(p, max_new_tokens=NEW) for p in ps[:2]]  # the preset's bound: 0
        restart = c.submit(ps[2], max_new_tokens=NEW, stale_policy="restart")
        within = c.submit(ps[3], max_new_tokens=NEW, max_weight_lag=5)
        tokens_move(c, before)
        assert c.update_weights(str(dir_b))["version"] == version + 1
        old, new = hf_greedy(dir_a, ps, NEW), hf_greedy(dir_b, ps, NEW)
        for rid, want in zip(stale, old):
            o = c.result(rid)
            assert o.status == RequestStatus.FINISHED and o.finish_reason == "stale", o
            assert 0 < len(o.generated_tokens) < NEW and o.generated_tokens == want[:len(o.generated_tokens)]
            assert o.weight_versions == [(0, version)]
        o = c.result(restart)
        assert (o.generated_tokens, o.weight_versions, o.stale_restarts) == (new[2], [(0, version + 1)], 1)
        o = c.result(within)
        assert [v for _, v in o.weight_versions] == [version, version + 1] and o.finish_reason == "length"

        # HTTP: the mode in the admin route, "abort" and "stale" as OpenAI finish reasons
        body = {"model": dir_a.name, "prompt": ps[0], "max_tokens": 400, "temperature": 0}
        answers: list = []

        def complete() -> None:
            answers.append(http(server, "POST", "/v1/completions", body))

        for route, payload, reason in (("/pause", {"mode": "abort"}, "abort"),
                                       ("/update_weights", {"path": str(dir_a)}, "stale")):
            before = c.stats()["tokens_generated"]
            thread = threading.Thread(target=complete)
            thread.start()
            tokens_move(c, before, 4)
            status, reply = http(server, "POST", route, payload, token=HTTP_TOKEN)
            assert status == 200 and reply == ({"paused": True, "mode": "abort"} if route == "/pause" else reply)
            thread.join(60)
            assert answers[-1][0] == 200 and answers[-1][1]["choices"][0]["finish_reason"] == reason, answers[-1]
            if route == "/pause":
                assert http(server, "POST", "/resume", token=HTTP_TOKEN) == (200, {"paused": False})


def test_modes_and_bounds_are_checked():
    """A mode or bound that cannot work is refused where it is given, naming it (no process needed)."""
    from cluster import protocol as P
    from cluster.config import ContinuousBatchingConfig
    from cluster.pause import PAUSE_MODES, check_pause_mode

    assert [P.pause_mode({"mode": m}) for m in PAUSE_MODES] == list(PAUSE_MODES) and P.pause_mode({}) == "keep"
    with pytest.raises(P.ProtocolError) as e:
        P.pause_mode({"mode": "in_place"})
    assert e.value.code == "bad_field"
    with pytest.raises(ValueError, match="pause mode='drain'"):
        check_pause_mode("drain")
    for bad in (dict(max_weight_lag=-1), dict(max_weight_lag=1.5), dict(stale_policy="drop")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ContinuousBatchingConfig(**bad)
