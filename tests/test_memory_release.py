"""Releasing memory between rollouts at TP=2 with real processes (tests/scripts/memory_rank.py): every rank's memory
figure drops by most of what it released and comes back on resume, tokens after every resume equal transformers'
greedy generate, requests in flight when the KV cache goes are recomputed, refusals carry their codes, decode graphs
are re-captured where they read, and the wire's checks."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from cluster import protocol as P
from cluster.errors import Code
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.memory_rank import CFG, LONG, LONG_PROMPTS, NEW, PROMPTS

MOST = 0.8  # of the bytes released, the share each rank's figure must show (allocator and trim slack)


def kv_bytes(model_dir, world: int) -> int:
    """One rank's KV cache at TP=`world`, from the checkpoint's config and the script's (one scratch block added)."""
    c = AutoConfig.from_pretrained(model_dir)
    kv_heads = max(1, c.num_key_value_heads // world)
    tokens = (CFG["num_blocks"] + 1) * CFG["page_size"]
    return 2 * c.num_hidden_layers * tokens * kv_heads * (c.hidden_size // c.num_attention_heads) * 4


def check_release(result: dict, tags: list[str], kv: int, world: int) -> None:
    """Every rank released what `tags` name, and its resident memory dropped by most of what left the host."""
    assert result["raised"] is None, result
    r = result["result"]
    assert r["ok"] and r["tags"] == tags and sorted(r["released"]) == sorted(tags)
    assert [f["rank"] for f in r["ranks"]] == list(range(world))
    for f in r["ranks"]:
        assert f["kv_cache_bytes"] == kv
        assert (f["weights_bytes"] > 0) == ("weights" in tags)
        assert f["freed"] >= MOST * (f["kv_cache_bytes"] + f["weights_bytes"] - f["host_bytes"]), f


def check_resume(result: dict, world: int) -> None:
    """Every rank took its memory back: resident again, no host copy left."""
    assert result["raised"] is None, result
    r = result["result"]
    assert r["ok"] and r["released"] == [] and len(r["ranks"]) == world
    for f in r["ranks"]:
        assert f["host_bytes"] == 0 and -f["freed"] >= MOST * f["kv_cache_bytes"], f


@pytest.mark.slow
def test_release_and_resume_memory_tp2(make_checkpoint, tmp_path):
    model_dir = make_checkpoint("llama")
    proc = run_ranks("memory_rank.py", [str(model_dir), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rec, worker = (read_json(tmp_path / f"memory.rank{r}.json") for r in (0, 1))
    check_record(rec, worker, model_dir, world=2)


def test_release_and_resume_memory_in_process_tp1(make_checkpoint):
    """The same scenario in this process at TP=1 (the fast tier's test of the release and resume logic)."""
    from tests.scripts.memory_rank import run

    model_dir = make_checkpoint("llama")
    rec = run(str(model_dir))
    check_record(rec, None, model_dir, world=1)


def check_record(rec: dict, worker: dict | None, model_dir, world: int) -> None:
    """Rank 0's record (and a worker's, at TP > 1) against transformers' tokens and the memory figures."""
    kv, want = kv_bytes(model_dir, world), hf_greedy(model_dir, PROMPTS, NEW)

    assert rec["before"] == want
    assert rec["not_paused"] == {"raised": "MemoryCallRefused", "code": Code.NOT_PAUSED, "rank": None}
    if worker is not None:  # outside a pause a worker's call is a no-op
        assert worker["not_paused"] == {"raised": None, "result": None}

    # the KV cache alone, requests in flight: preempted, no step while released, recomputed to transformers' tokens
    check_release(rec["kv"], ["kv_cache"], kv, world)
    assert rec["running_after_release"] == 0 and rec["preempted"] >= 1 and rec["steps_held"]
    check_resume(rec["kv_resume"], world)
    assert rec["inflight"] == hf_greedy(model_dir, LONG_PROMPTS, LONG)
    assert rec["after_kv"] == want
    assert rec["graphs_after_kv"]["captures"] > rec["graphs_before"]["captures"]  # re-captured on the new storage

    # KV cache and weights, the weights kept on the host
    check_release(rec["both_host"], ["kv_cache", "weights"], kv, world)
    assert all(f["host_bytes"] == f["weights_bytes"] for f in rec["both_host"]["result"]["ranks"])
    check_resume(rec["both_host_resume"], world)
    assert rec["after_host"] == want

    # weights without a host copy: the resume is refused on every rank alike until an update filled them
    check_release(rec["no_host"], ["kv_cache", "weights"], kv, world)
    for r in (rec, worker or rec):
        assert r["refused_resume"] == {"raised": "MemoryCallRefused", "code": Code.WEIGHTS_NOT_RESTORED, "rank": 0}
        assert r["still_released"] == ["kv_cache", "weights"] and r["update"] is True
    check_resume(rec["no_host_resume"], world)
    assert rec["after_update"] == want

    # the serving pause's path: the driver's calls through its loop, the workers' shares from CALL plans
    check_release(rec["held_release"], ["kv_cache", "weights"], kv, world)
    check_resume(rec["held_resume"], world)
    assert rec["after_held"] == want

    # every rank got the same figures, dropped and re-captured its graphs alike, and reads none that moved
    worker = worker or rec
    for key in ("kv", "both_host", "no_host_resume"):
        assert worker[key] == rec[key]
    assert rec["released_at_end"] == worker["released_at_end"] == []
    assert rec["graphs_end"] == worker["graphs_end"]
    assert rec["graphs_end"]["drops"] == 4 and rec["graphs_end"]["moved"] == []


def test_memory_tags_on_the_wire():
    assert P.check_memory_tags(None) == ["kv_cache", "weights"]
    assert P.check_memory_tags(["weights"]) == ["weights"]
    for bad in ([], ["kv"], "kv_cache", [1]):
        with pytest.raises(P.ProtocolError) as e:
            P.check_memory_tags(bad)
        assert e.value.code == Code.BAD_FIELD
    assert {P.RELEASE_MEMORY, P.RESUME_MEMORY} <= set(P.ADMIN_KINDS)
