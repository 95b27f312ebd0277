"""The HTTP side of `benchmarks/serving.py --http`: the same arrivals sent as streaming OpenAI `/v1/completions`
calls (text prompts) to Lockstep's gateway (`lockstep serve --http`) and to `transformers serve
--continuous-batching` on the same checkpoint, one server after the other.

A client process (spawn) opens one thread per request at its arrival time; each thread POSTs with `http.client`
and reads the Server-Sent Events. First token: the first chunk carrying text; last token: the last such chunk;
tokens: the `usage` the server reports at the end (transformers' server may put several tokens in one chunk).
EOS is disabled on both (Lockstep: `ignore_eos`; transformers: a `generation_config` with eos_token_id -1), greedy.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from urllib.parse import urlparse

from benchmarks.serving_common import PAGE, WARM_TOKENS, CpuWindow, client_message, on_arrivals, preset_toml, say


def text_prompts(model_dir: Path, prompts: list[list[int]]) -> tuple[list[str], list[list[int]]]:
    """The prompts as text (decoded by the checkpoint's tokenizer) and the ids that text tokenizes to, which the
    ZeroMQ run then sends, so every path serves the same tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.decode(p, skip_special_tokens=True) for p in prompts]
    return texts, [tok(t)["input_ids"] for t in texts]


def stream_one(url: str, body: dict, t0: float) -> dict:
    """One streaming completion; times relative to t0."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
    rec: dict = {"submit": time.perf_counter() - t0, "first": None, "last": None, "n": 0, "status": None,
                 "error": None}
    text = []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk['error']}")
            now = time.perf_counter() - t0
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    rec["first"] = rec["first"] if rec["first"] is not None else now
                    rec["last"] = now
                    text.append(choice["text"])
                if choice.get("finish_reason"):
                    rec["status"] = "FINISHED"
            if chunk.get("usage"):
                rec["n"] = chunk["usage"]["completion_tokens"]
    except Exception as e:  # recorded and reported; the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    rec["text"] = "".join(text)
    return rec


def http_client_main(url: str, bodies: list[dict], warm: list[dict], arrivals: list[float], out_q) -> None:
    """The client process: the warm-up calls at once, then one thread per request at its arrival time."""
    try:
        threads = [threading.Thread(target=stream_one, args=(url, b, time.perf_counter())) for b in warm]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        recs: list[dict] = [{} for _ in bodies]

        def one(i: int, t0: float) -> None:
            recs[i] = stream_one(url, bodies[i], t0)

        on_arrivals(arrivals, one)
        for rec, a in zip(recs, arrivals):
            rec["arrival"] = a
        out_q.put({"records": recs})
    except BaseException as e:
        import traceback

        out_q.put({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def timed_run(args, url: str, bodies: list[dict], warm: list[dict], arrivals: list[float]) -> list[dict]:
    return client_message(http_client_main, (url, bodies, warm, arrivals), args.run_timeout,
                          "HTTP client process")["records"]


def bodies_for(args, texts: list[str], extra: dict, tokens: int) -> list[dict]:
    return [{"model": str(args.model), "prompt": t, "max_tokens": tokens, "temperature": 0, "stream": True}
            | extra for t in texts]


def run_lockstep_http(args, texts, warm_texts, arrivals) -> dict:
    from launch.local_server import local_server
    from launch.torchrun import free_port

    window = CpuWindow()
    listen = f"127.0.0.1:{free_port()}"
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    say(f"lockstep-http: lockstep serve --tp {args.tp} --http {listen} (OMP_NUM_THREADS={args.server_threads})")
    with local_server(args.model, args.tp, preset_toml(args), extra=["--http", listen],
                      env={"OMP_NUM_THREADS": str(args.server_threads)}, ready_timeout=args.ready_timeout) as server:
        records = timed_run(args, f"http://{listen}", bodies_for(args, texts, extra, args.new_tokens),
                            bodies_for(args, warm_texts, extra, WARM_TOKENS), arrivals)
        rc = server.stop()
    others, wall = window.others()
    return {"engine": "lockstep-http", "tp": args.tp, "threads": args.server_threads, "records": records,
            "note": f"through the gateway (a child process of rank 0); server exit status {rc}", "others": (others, wall)}


def run_transformers_serve(args, texts, warm_texts, arrivals) -> dict:
    from launch.torchrun import free_port

    window = CpuWindow()
    port = free_port()
    cmd = ["transformers", "serve", "--continuous-batching", "--cb-block-size", str(PAGE), "--cb-num-blocks",
           str(args.num_blocks), "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", str(args.model)]
    if args.max_batch_tokens:
        cmd[3:3] = ["--cb-max-batch-tokens", str(args.max_batch_tokens)]
    say("transformers-serve: " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, args.ready_timeout, log)
        gen = json.dumps({"do_sample": False, "eos_token_id": -1, "max_new_tokens": args.new_tokens})
        warm_gen = json.dumps({"do_sample": False, "eos_token_id": -1, "max_new_tokens": WARM_TOKENS})
        records = timed_run(args, f"http://127.0.0.1:{port}",
                            bodies_for(args, texts, {"generation_config": gen}, args.new_tokens),
                            bodies_for(args, warm_texts, {"generation_config": warm_gen}, WARM_TOKENS), arrivals)
    finally:
        stop_group(proc)
    if os.environ.get("BENCH_DEBUG"):
        say("transformers serve log:\n" + "".join(log)[-4000:])
    others, wall = window.others()
    return {"engine": "transformers-serve", "tp": 1, "threads": os.cpu_count(), "records": records,
            "note": "transformers serve --continuous-batching, its own process (torch's default threads)",
            "others": (others, wall)}


def stop_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """Stop a server started in its own session: SIGINT to its group, `grace_s` for it to exit, then SIGKILL to
    whatever of the group is left (the server itself past the grace, or a child it left behind: vLLM's engine
    process would otherwise hold the cores through the next engine's run)."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: list[str],
                 what: str = "transformers serve") -> None:
    """Poll `url`/health until it answers 200; RuntimeError naming `what`, with its log's tail, if the process
    exits first or `timeout` s pass."""
    u = urlparse(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (status {proc.returncode}):\n" + "".join(log)[-3000:])
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not healthy within {timeout}s:\n" + "".join(log)[-3000:])


if __name__ == "__main__":
    sys.exit("run benchmarks/serving.py --http")
