"""benchmarks/peer_vllm.py's logic without vLLM: its arguments, workloads, engine settings, the JSON protocol of the
vLLM worker (run in this process against a stand-in `vllm` module), and the ratio and median table."""

from __future__ import annotations

import json
import re
import sys
import types
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

import benchmarks.peer_vllm as peer  # noqa: E402
import benchmarks.peer_vllm_worker as worker  # noqa: E402
from benchmarks.throughput import make_prompts  # noqa: E402

CFG = {"vocab_size": 1000, "num_attention_heads": 12, "hidden_size": 768, "num_hidden_layers": 8,
       "num_key_value_heads": 4, "max_position_embeddings": 2048}


def test_arguments_defaults_quick_and_refusals():
    args = peer.parse_args([])
    assert (args.tp, args.workloads, args.pairs, args.dtype, args.prefix_caching) == ([1], "abc", 3, "float32", False)
    quick = peer.parse_args(["--quick", "--tp", "1", "2", "--workloads", "ac", "--vllm-enforce-eager"])
    assert (quick.pairs, quick.tp, quick.workloads, quick.vllm_enforce_eager) == (1, [1, 2], "ac", True)
    assert peer.parse_args(["--quick", "--pairs", "2"]).pairs == 2
    for bad in (["--workloads", "ax"], ["--tp", "3"], ["--pairs", "0"]):
        with pytest.raises(SystemExit):
            peer.parse_args(bad)


def test_workloads_are_throughputs_prompts_and_warm_ups():
    for table in (peer.WORKLOADS, peer.QUICK):
        assert sorted(table) == ["a", "b", "c"]
        a, b, c = table["a"], table["b"], table["c"]
        assert b.min_len > a.max_len // 2 and b.new_tokens <= a.new_tokens  # b: long prompts, short outputs
        assert c.max_len < b.min_len and c.new_tokens > a.new_tokens  # c: short prompts, long outputs
    assert (peer.WORKLOADS["c"].num_prompts, peer.WORKLOADS["c"].new_tokens) == (256, 256)
    w = peer.QUICK["b"]
    prompts, warm = peer.workload_prompts(w, seed=3, vocab=CFG["vocab_size"])
    ns = SimpleNamespace(seed=3, min_len=w.min_len, max_len=w.max_len, num_prompts=w.num_prompts)
    assert prompts == make_prompts(ns, CFG["vocab_size"])  # what throughput.py draws from the same flags
    assert len(prompts) == w.num_prompts and all(w.min_len <= len(p) <= w.max_len for p in prompts)
    assert warm == [p[:w.min_len] for p in prompts[:peer.WARM_PROMPTS]]
    assert peer.workload_prompts(w, seed=4, vocab=CFG["vocab_size"])[0] != prompts


def test_core_binding_and_kv_room():
    assert peer.cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert peer.cpu_binds([1, 0], 1) == "0-1" and peer.cpu_binds([0, 1], 2) == "0|1"
    assert peer.cpu_binds([0, 1, 2, 3, 4], 2) == "0-1|2-3"
    with pytest.raises(ValueError):
        peer.cpu_binds([0], 2)
    assert peer.kv_bytes_per_token(CFG, "float32") == 2 * 8 * 4 * 64 * 4
    w = peer.WORKLOADS["c"]  # 256 requests of up to 288 tokens in pages of 128: 768 pages of 128 KiB x 16
    assert peer.num_blocks(w, 128) == 256 * 3
    assert peer.kvcache_gib(w, 128, CFG, "float32") == 2  # 1.5 GiB, rounded up
    assert peer.kvcache_gib(peer.QUICK["a"], 128, CFG, "bfloat16") == 1


def test_the_lockstep_command_uses_only_flags_throughput_defines(tmp_path):
    defined = set(re.findall(r'add_argument\("(--[a-z-]+)"', (REPO / "benchmarks" / "throughput.py").read_text()))
    args = peer.parse_args(["--tp", "1", "2"])
    w = peer.WORKLOADS["a"]
    one = peer.lockstep_command(args, w, 1, tmp_path / "r.json")
    two = peer.lockstep_command(args, w, 2, tmp_path / "r.json")
    assert one[1:3] == ["-m", "benchmarks.throughput"]
    assert "torch.distributed.run" in two and two[two.index("--nproc-per-node") + 1] == "2"
    flags = one[3:]
    assert {f for f in flags if f.startswith("--")} <= defined
    value = {f: flags[i + 1] for i, f in enumerate(flags) if f.startswith("--") and i + 1 < len(flags)}
    assert (value["--num-prompts"], value["--new-tokens"], value["--page-size"]) == ("64", "64", "128")
    assert value["--max-requests-per-batch"] == "256" and value["--max-batch-tokens"] == "512"
    assert "--no-prefix-caching" in flags and "--skip-transformers" in flags
    assert "--no-prefix-caching" not in peer.lockstep_command(peer.parse_args(["--prefix-caching"]), w, 1, tmp_path)


def test_both_engines_get_the_same_threads_and_settings():
    args = peer.parse_args(["--page-size", "64", "--vllm-enforce-eager"])
    args.cores = [0, 1]
    w = peer.QUICK["a"]
    for tp, bind in ((1, "0-1"), (2, "0|1")):
        lockstep, vllm = peer.engine_envs(args, w, tp, CFG)
        assert lockstep["OMP_NUM_THREADS"] == str(2 // tp) and "OMP_NUM_THREADS" not in vllm
        assert vllm["VLLM_CPU_OMP_THREADS_BIND"] == bind and vllm["VLLM_CPU_KVCACHE_SPACE"] == "1"
    req = worker.read_request(json.dumps(peer.vllm_request(args, w, 2, [[5, 6]], [[5]], CFG)))
    kw = worker.llm_kwargs(req)
    assert (kw["block_size"], kw["max_num_batched_tokens"], kw["max_num_seqs"]) == (64, 512, 256)
    assert (kw["enable_prefix_caching"], kw["enforce_eager"], kw["dtype"], kw["tensor_parallel_size"]) == \
        (False, True, "float32", 2)
    assert kw["distributed_executor_backend"] == "mp"
    assert worker.sampling_kwargs(7) == dict(temperature=0.0, max_tokens=7, ignore_eos=True, detokenize=False)


class FakeLLM:
    """vLLM's LLM as the worker uses it: outputs in prompt order, token ids only."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        FakeLLM.made.append(kwargs)

    def generate(self, prompts, params, use_tqdm=True):
        assert not use_tqdm and params.temperature == 0.0
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(p["prompt_token_ids"][-1] + k
                                                                         for k in range(params.max_tokens)))])
                for p in prompts]


def test_the_worker_protocol_in_and_out(tmp_path, monkeypatch):
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.__version__ = FakeLLM, lambda **kw: SimpleNamespace(**kw), "0.0-fake"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    FakeLLM.made.clear()
    args = peer.parse_args(["--model", str(tmp_path)])
    req, res = tmp_path / "req.json", tmp_path / "res.json"
    req.write_text(json.dumps(peer.vllm_request(args, peer.QUICK["a"], 1, [[10, 11], [20]], [[10]], CFG)))
    assert worker.main(["w", str(req), str(res)]) == 0
    out = json.loads(res.read_text())
    assert out["tokens"] == [[11 + k for k in range(16)], [20 + k for k in range(16)]]
    assert out["counts"] == [16, 16] and out["engine"] == "vllm" and out["version"] == "0.0-fake"
    assert out["wall"] >= 0 and out["load_s"] >= 0 and "block_size=128" in out["config"]
    assert FakeLLM.made[0]["model"] == str(tmp_path.resolve()) and "distributed_executor_backend" not in FakeLLM.made[0]
    req.write_text(json.dumps({"model": "m"}))  # a bad request: the error goes back as JSON, exit status 1
    assert worker.main(["w", str(req), str(res)]) == 1
    error = json.loads(res.read_text())["error"]
    assert "BadRequest" in error and "prompts" in error and peer.last_line(error).startswith("benchmarks.")
    assert worker.main(["w"]) == 2


def run(workload, tp, pair, engine, tokens, wall, error=None):
    rec = dict(workload=workload, tp=tp, pair=pair, engine=engine)
    if error:
        return rec | {"error": error}
    return rec | dict(counts=[len(t) for t in tokens], tokens=tokens, wall=wall, load_s=1.0, warm_s=0.5,
                      setup_s=None, process_s=9.0, load1=0.1, exact=True)


def test_ratios_medians_and_mismatches():
    same, other = [[1, 2, 3, 4]] * 3, [[1, 2, 3, 4], [1, 2, 9, 9], [1, 2, 3, 7]]
    runs = [run("a", 1, 1, "lockstep", same, 1.0), run("a", 1, 1, "vllm", same, 2.0),  # 2.0x
            run("a", 1, 2, "lockstep", same, 3.0), run("a", 1, 2, "vllm", other, 1.5),  # 0.5x
            run("a", 1, 3, "lockstep", same, 1.0), run("a", 1, 3, "vllm", same, 1.25),  # 1.25x
            run("a", 2, 1, "lockstep", same, 1.0), run("a", 2, 1, "vllm", None, None, "Traceback\nOSError: no TP\n")]
    a1, a2 = peer.summarize(runs)
    assert a1["ratios"] == pytest.approx([2.0, 0.5, 1.25]) and a1["median_ratio"] == pytest.approx(1.25)
    assert a1["lockstep_tps"] == pytest.approx(12.0) and a1["vllm_tps"] == pytest.approx(8.0)  # of 6, 8, 9.6
    assert a1["lockstep_wall"] == pytest.approx(1.0) and a1["vllm_wall"] == pytest.approx(1.5)  # the ceiling's
    assert a1["mismatches"] == [(0, None), (2, 2), (0, None)] and not a1["errors"]
    assert a2["ratios"] == [] and a2["median_ratio"] is None and a2["vllm_tps"] is None
    assert a2["errors"] == ["vllm pair 1: OSError: no TP"]
    lines = peer.summary_lines([a1, a2])
    assert "1.25x" in lines[1] and "2 (from token 2)" in lines[1] and "OSError" in lines[3]
    assert lines[2].split()[:5] == ["a", "2", "12.0", "-", "-"]
    assert any("FAILED" in x for x in peer.run_lines(runs)) and "12.0" in peer.run_lines(runs)[1]
    assert peer.mismatches([[1], [2, 3]], [[1], [2]]) == (1, 1)


def test_the_product_ceiling(make_checkpoint, monkeypatch):
    import json as _json

    from benchmarks import product_ceiling as pc

    path = make_checkpoint("llama")
    cfg = _json.loads((path / "config.json").read_text())
    h, i, layers, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i  # q, k, v, o, gate, up, down
    assert pc.product_weights(path) == (layers * per_layer, cfg["vocab_size"] * h)
    assert pc.product_weights(make_checkpoint("qwen3_moe")) is None  # a token runs only its experts
    # two prompts of 3 and 5 tokens, 4 new each: the body on 8 + 2 x 3 tokens, the head on 2 x 4
    assert pc.workload_flops([3, 5], 4, (10, 7)) == 2 * 10 * 14 + 2 * 7 * 8
    monkeypatch.setattr(pc, "SECONDS", 0.05)
    assert pc.product_rate(64, 128, 1) > 0
    rows = [dict(workload="a", tp=1, tflop=2.0, lockstep_wall=10.0, vllm_wall=8.0),
            dict(workload="b", tp=2, tflop=1.0, lockstep_wall=5.0, vllm_wall=None)]
    lines = pc.ceiling_lines(rows, rate=400.0)
    # a: 200 GFLOP/s (50 %) against 250 (62 %): 400 / 250 = 1.60x at most; b: no vLLM run, no ceiling
    assert lines[1].split() == ["a", "1", "2.000", "200", "(50%)", "250", "(62%)", "1.60x"]
    assert lines[2].split() == ["b", "2", "1.000", "200", "(50%)", "-", "-"]
