"""One vLLM run for benchmarks/peer_vllm.py, in vLLM's own venv (benchmarks/peer_vllm_env.py): JSON in, JSON out.

    VENV/bin/python benchmarks/peer_vllm_worker.py REQUEST.json RESULT.json

REQUEST (REQUIRED keys): the checkpoint, the engine settings, the warm-up prompts and the timed prompts as token
ids. This process builds vLLM's offline `LLM` (timed: `load_s`, which holds torch.compile's work when it is on),
runs one warm-up `generate` (`warm_s`), then one timed `generate` of every prompt (`wall`), greedy, EOS ignored,
no detokenization. RESULT: {"engine": "vllm", "counts", "tokens" (in prompt order), "wall", "load_s", "warm_s",
"version", "config"}, or {"error": traceback} with exit status 1. Nothing but JSON crosses (no pickle), and this
file imports nothing of Lockstep's: vLLM's venv has neither Lockstep nor its dependencies.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

REQUIRED = ("model", "prompts", "warm", "new_tokens", "warm_new_tokens", "tp", "dtype", "max_batch_tokens",
            "max_seqs", "block_size", "prefix_caching", "enforce_eager", "max_model_len", "seed")
ENV_SHOWN = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")


class BadRequest(ValueError):
    """The request file lacks a key or holds a wrong value."""


def read_request(text: str) -> dict:
    req = json.loads(text)
    missing = [k for k in REQUIRED if k not in req]
    if missing:
        raise BadRequest(f"request lacks {missing}")
    if not req["prompts"] or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p)
                                     for p in req["prompts"] + req["warm"]):
        raise BadRequest("prompts and warm must be non-empty lists of token ids")
    return req


def llm_kwargs(req: dict) -> dict:
    """vLLM's `LLM(...)` arguments for the request: the settings peer_vllm.py states for both engines."""
    kw = dict(model=req["model"], tensor_parallel_size=req["tp"], dtype=req["dtype"],
              max_num_batched_tokens=req["max_batch_tokens"], max_num_seqs=req["max_seqs"],
              block_size=req["block_size"], enable_prefix_caching=req["prefix_caching"],
              enforce_eager=req["enforce_eager"], max_model_len=req["max_model_len"], seed=req["seed"])
    if req["tp"] > 1:
        kw["distributed_executor_backend"] = "mp"
    return kw


def sampling_kwargs(new_tokens: int) -> dict:
    """Greedy, every request to its full length, token ids only."""
    return dict(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def run(req: dict) -> dict:
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(**llm_kwargs(req))
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(token_prompts(req["warm"]), vllm.SamplingParams(**sampling_kwargs(req["warm_new_tokens"])),
                 use_tqdm=False)
    warm = time.perf_counter() - t0
    params = vllm.SamplingParams(**sampling_kwargs(req["new_tokens"]))
    t0 = time.perf_counter()
    outs = llm.generate(token_prompts(req["prompts"]), params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del outs, llm  # its finalizer shuts vLLM's engine processes down before this one exits
    gc.collect()
    kw = llm_kwargs(req)
    config = " ".join(f"{k}={kw[k]}" for k in sorted(kw) if k != "model")
    config += "".join(f" {k}={os.environ[k]}" for k in ENV_SHOWN if k in os.environ)
    return dict(engine="vllm", version=vllm.__version__, counts=[len(t) for t in tokens], tokens=tokens, wall=wall,
                load_s=load, warm_s=warm, config=config)


def main(argv: list[str], runner=run) -> int:
    """Read argv[1]'s request, write argv[2]'s result; `runner` is `run` (a fake in tests/test_peer_vllm.py)."""
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with open(argv[1]) as f:
            result, status = runner(read_request(f.read())), 0
    except Exception:  # the whole traceback goes back to peer_vllm.py, which prints it
        result, status = {"error": traceback.format_exc()}, 1
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return status


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's engine processes and thread pools can hold the interpreter's exit; the result is written
    os._exit(code)
