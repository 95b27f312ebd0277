"""benchmarks/peer_vllm_serving.py's logic without vLLM: its arguments, both servers' settings, the request bodies
(sent to a stand-in OpenAI server in this process, once as each engine), TTFT / TPOT percentiles and the
Lockstep / vLLM ratios, and the error of a server that does not start (a stand-in vLLM python, slow tier)."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks.peer_vllm_serving as online
from benchmarks.serving_common import PAGE, preset_toml
from benchmarks.serving_http import stream_one
from tests.test_peer_vllm import CFG



def configured(tmp_path: Path, *argv: str):
    args = online.parse_args(["--model", str(tmp_path), *argv])
    args.cores = [0, 1]
    online.configure(args, CFG)
    args.model, args.work, args.python = tmp_path, tmp_path, "python"
    return args


def test_arguments_defaults_quick_and_refusals():
    args = online.parse_args([])
    assert (args.rates, args.runs, args.num_requests, args.new_tokens, args.tp) == ([1.0, 4.0], 3, 32, 64, 1)
    assert (args.dtype, args.page_size, args.prefix_caching, args.max_batch_tokens) == ("float32", 128, False, 512)
    quick = online.parse_args(["--quick", "--rates", "2", "8"])
    assert (quick.runs, quick.num_requests, quick.new_tokens, quick.rates) == (1, 16, 32, [2.0, 8.0])
    assert online.parse_args(["--quick", "--runs", "2", "--num-requests", "4"]).runs == 2
    for bad in (["--runs", "0"], ["--rates", "0"], ["--new-tokens", "1"], ["--tp", "3"], ["--min-len", "9",
                                                                                           "--max-len", "8"]):
        with pytest.raises(SystemExit):
            online.parse_args(bad)


def test_both_servers_get_the_same_settings(tmp_path):
    args = configured(tmp_path)
    cmd = online.vllm_command(args, "py", 8000)
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    value = {f: cmd[i + 1] for i, f in enumerate(cmd) if f.startswith("--") and i + 1 < len(cmd)}
    assert (value["--model"], value["--dtype"], value["--block-size"], value["--tensor-parallel-size"]) == \
        (str(tmp_path), "float32", "128", "1")
    assert (value["--max-num-batched-tokens"], value["--max-num-seqs"], value["--max-model-len"]) == \
        ("512", "256", "2048")
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" not in cmd
    assert "--distributed-executor-backend" not in cmd
    preset = preset_toml(args)  # Lockstep's, through serving_common: the same page, requests a step, no sharing
    assert "page_size = 128" in preset and "max_requests_per_batch = 256" in preset
    assert "allow_block_sharing = false" in preset and "max_batch_tokens = 512" in preset
    assert f"num_blocks = {32 * 2}" in preset  # 32 requests of up to 128 + 64 tokens: 2 pages of 128 each
    assert args.lockstep_env == {"OMP_NUM_THREADS": "2"}
    assert args.vllm_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "OMP_NUM_THREADS" not in args.vllm_env
    two = configured(tmp_path, "--tp", "2", "--prefix-caching", "--vllm-enforce-eager")
    cmd2 = online.vllm_command(two, "py", 8000)
    assert "--distributed-executor-backend" in cmd2 and "--enable-prefix-caching" in cmd2 and "--enforce-eager" in cmd2
    assert two.vllm_env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and two.lockstep_env == {"OMP_NUM_THREADS": "1"}
    assert "allow_block_sharing" not in preset_toml(two)
    plain = SimpleNamespace(num_blocks=8, model_samples=False, max_batch_tokens=None)  # serving.py's arguments
    assert preset_toml(plain).splitlines()[1:] == [f"page_size = {PAGE}", "num_blocks = 8", "cpu_group_timeout = 120.0"]


def test_arrivals_are_seeded_poisson():
    a = online.arrival_times(400, 4.0, seed=1)
    assert a == online.arrival_times(400, 4.0, seed=1) and a != online.arrival_times(400, 4.0, seed=2)
    assert a[0] == 0 and all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] / 399 == pytest.approx(0.25, rel=0.15)  # mean gap 1 / rate


class StandIn(BaseHTTPRequestHandler):
    """An OpenAI server's streaming /v1/completions and /health: one chunk a token, usage at the end; it
    records every body it gets under the engine the test says it is."""

    bodies: dict[str, list[dict]] = {}
    engine = ""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.setdefault(StandIn.engine, []).append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in range(body["max_tokens"]):
            last = k + 1 == body["max_tokens"]
            chunk = {"choices": [{"text": f" t{k}", "finish_reason": "length" if last else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *a):
        pass


def in_process_timed_run(args, url, bodies, warm, arrivals):
    """serving_http.timed_run without its client process (the fast tier starts none): every request at once."""
    assert warm == []
    recs = [stream_one(url, b, 0.0) | {"arrival": 0.0} for b in bodies]
    return recs


def test_both_engines_get_the_same_bodies_and_their_runs_are_measured(tmp_path, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def stand_in(engine):
        def start(args, tag):
            StandIn.engine = engine
            yield url
        return contextmanager(start)

    monkeypatch.setattr(online, "lockstep_server", stand_in("lockstep"))
    monkeypatch.setattr(online, "vllm_server", stand_in("vllm"))
    monkeypatch.setattr(online, "timed_run", in_process_timed_run)
    StandIn.bodies = {}
    args = configured(tmp_path, "--num-requests", "3", "--new-tokens", "5")
    bodies = online.request_bodies(args, ["a b", "c", "d e f"], args.new_tokens)
    warm = online.request_bodies(args, ["a b"], 2)
    results = []
    try:
        for engine in online.ENGINES:
            results += online.serve_run(args, engine, 1, bodies, warm, {1.0: [0.0, 1.0, 2.0], 4.0: [0.0, 0.2, 0.5]})
    finally:
        server.shutdown()
    got = StandIn.bodies
    assert got["lockstep"] == got["vllm"] and len(got["vllm"]) == 1 + 2 * 3  # the warm-up, then each rate's three
    first = got["vllm"][1]
    assert first == {"model": str(tmp_path), "prompt": "a b", "max_tokens": 5, "temperature": 0, "stream": True,
                     "ignore_eos": True, "stream_options": {"include_usage": True}}
    assert [(r["engine"], r["rate"]) for r in results] == [("lockstep", 1.0), ("lockstep", 4.0), ("vllm", 1.0),
                                                           ("vllm", 4.0)]
    assert all(online.completed(args, r) == 3 and r["start_s"] >= 0 and r["warm_s"] >= 0 for r in results)
    assert [r["text"] for r in results[0]["records"]] == [" t0 t1 t2 t3 t4"] * 3


def fake(engine: str, run: int, rate: float, ttft_ms: list[float], tpot_ms: float, n: int = 5) -> dict:
    """A result whose requests arrive at 0 and take `ttft_ms` to a first token and `tpot_ms` a token after; the
    first request's text is the engine's name, the others' the same."""
    recs = [dict(arrival=0.0, submit=0.0, first=t / 1000, last=t / 1000 + (n - 1) * tpot_ms / 1000, n=n,
                 status="FINISHED", error=None, text="same" if i else engine) for i, t in enumerate(ttft_ms)]
    return dict(engine=engine, run=run, rate=rate, tp=1, records=recs, start_s=10.0 * run, warm_s=0.5, load1=0.1)


def test_percentiles_ratios_medians_and_the_bar(tmp_path):
    args = configured(tmp_path, "--num-requests", "5", "--new-tokens", "5")
    ttft = [10.0, 20.0, 30.0, 40.0, 100.0]  # p50 30; p99 between 40 and 100 at 0.96: 97.6
    m = online.metrics(args, fake("lockstep", 1, 1.0, ttft, 8.0))
    assert (m["ttft50"], m["ttft99"], m["tpot50"], m["tpot99"], m["completed"]) == \
        pytest.approx((30.0, 97.6, 8.0, 8.0, 5))
    results = [fake("lockstep", 1, 1.0, ttft, 8.0), fake("vllm", 1, 1.0, [2 * x for x in ttft], 20.0),  # 0.5, 0.4
               fake("lockstep", 2, 1.0, ttft, 12.0), fake("vllm", 2, 1.0, ttft, 10.0),  # 1.0, 1.2
               fake("lockstep", 3, 1.0, ttft, 9.0), fake("vllm", 3, 1.0, [x / 0.7 for x in ttft], 10.0),  # 0.7, 0.9
               fake("lockstep", 1, 4.0, ttft, 8.0),
               dict(engine="vllm", run=1, rate=4.0, tp=1, error="vLLM's server (run1-vllm) did not start: boom\n..",
                    load1=0.1)]
    one, four = online.summary_rows(args, results)
    assert [x["ttft99"] for x in one["ratios"]] == pytest.approx([0.5, 1.0, 0.7])
    assert [x["tpot99"] for x in one["ratios"]] == pytest.approx([0.4, 1.2, 0.9])
    assert one["median_ratio"]["ttft99"] == pytest.approx(0.7) and one["median_ratio"]["tpot99"] == pytest.approx(0.9)
    assert not one["meets_bar"]  # TPOT p99 0.9x > 0.8x
    assert one["same_text"] == [4, 4, 4] and four["same_text"] == []  # the first request's text differs
    assert one["lockstep"]["tpot50"] == pytest.approx(9.0) and one["vllm"]["tpot50"] == pytest.approx(10.0)
    assert one["lockstep_completed"] == [5, 5, 5] and one["vllm_start_s"] == [10.0, 20.0, 30.0]
    assert four["vllm"] is None and four["median_ratio"] is None and not four["meets_bar"]
    assert four["vllm_completed"] == [0] and four["errors"] == ["vllm run 1: vLLM's server (run1-vllm) did not "
                                                                "start: boom"]
    lines = online.table_lines(args, [one, four])
    assert lines[0].split()[:4] == ["rate", "engine", "TTFT", "p50"]
    assert lines[1].split()[:3] == ["1", "lockstep", "30.0"] and "5/5/5 of 5" in lines[1]
    assert lines[0].index("done") + 4 == lines[1].index("5/5/5 of 5") + 10  # the column widens to its cells
    assert "0.70x" in lines[3] and "0.90x" in lines[3] and "misses the bar" in lines[3]
    assert "same text by run: 4/5, 4/5, 4/5" in lines[3]
    assert lines[5].split()[2:6] == ["-"] * 4 and "error: vllm run 1" in lines[7]
    good = online.summary_rows(args, results[:2])[0]
    assert good["meets_bar"] and "meets the bar" in online.table_lines(args, [good])[3]


@pytest.mark.slow
def test_a_vllm_server_that_does_not_start_says_why(tmp_path):
    """A stand-in python that exits with a message at once, then one that never answers /health."""
    args = configured(tmp_path, "--ready-timeout", "2")
    errors = []
    for script, expect in (("echo 'ValueError: no such model'; exit 3", r"exited \(status 3\)"),
                           ("exec sleep 60", "not healthy within 2.0s")):
        python = tmp_path / "python"
        python.write_text(f"#!/bin/sh\n{script}\n")
        python.chmod(0o755)
        args.python = python
        with pytest.raises(online.ServerStartError, match=f"vLLM's server \\(t: .*\\) did not start: .*{expect}") \
                as e:
            with online.vllm_server(args, "t"):
                pass
        errors.append(str(e.value))
        assert (tmp_path / "t.log").exists()
    assert "ValueError: no such model" in errors[0]  # the log's tail
    failed = online.serve_run(args, "vllm", 1, [], [], {1.0: [0.0], 4.0: [0.0]})
    assert [(r["rate"], "did not start" in r["error"]) for r in failed] == [(1.0, True), (4.0, True)]
