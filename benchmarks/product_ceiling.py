"""How close an engine runs to what this machine's matrix products allow: a workload's product FLOPs, the machine's
float32 product rate measured in the same run, and the ratio to a peer engine that no engine could pass.

On a CPU in float32 a dense model's step is mostly products of activations by weights: 2 x (the weights of every
linear layer) FLOPs per token run, plus 2 x (the LM head's) per token sampled. Whatever else an engine does
(attention, norms, sampling, scheduling) only adds time. So an engine that ran every product at the machine's
rate and spent nothing on the rest would take FLOPs / rate, and against a peer that took `wall`, no engine can
reach more than (FLOPs / rate)^-1 x wall = rate / (the peer's FLOPs / wall): the `most` column of
benchmarks/peer_vllm.py's ceiling table (docs/benchmarks.md, "The product ceiling").
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

ROWS = 512  # the product the rate is measured on: ROWS x hidden by hidden x intermediate (a prefill chunk's MLP)
SECONDS = 1.0


def product_weights(model_dir: str | Path) -> tuple[int, int] | None:
    """(weights multiplied for every token run: every linear layer's but the LM head's, the LM head's) of a
    dense checkpoint, counted on the meta device; None for a mixture of experts (a token runs only its experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    return body, head.weight.numel()


def workload_flops(prompt_lens: list[int], new_tokens: int, weights: tuple[int, int]) -> int:
    """Product FLOPs of running every prompt and generating `new_tokens` each: the body on every prompt token and
    every generated token but the last (it is sampled, never run), the head on every sampled token."""
    body, head = weights
    n = len(prompt_lens)
    return 2 * body * (sum(prompt_lens) + n * (new_tokens - 1)) + 2 * head * n * new_tokens


def product_rate(hidden: int, intermediate: int, threads: int) -> float:
    """GFLOP/s of this machine's best float32 product of ROWS x hidden by a weight of intermediate x hidden, on
    `threads` threads: the better of torch's plain product (MKL) and oneDNN's against a packed weight (Lockstep's,
    worker/packed_linear.py), each run for SECONDS after a warm-up."""
    from worker.packed_linear import packed_product

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w = torch.randn(ROWS, hidden), torch.randn(intermediate, hidden)
        best = 0.0
        for product in (lambda: torch.nn.functional.linear(x, w), lambda: packed_product(x, w)):
            if product() is None:  # no oneDNN here
                continue
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < SECONDS:
                product()
                n += 1
            best = max(best, 2 * ROWS * hidden * intermediate * n / (time.perf_counter() - t0) / 1e9)
        return best
    finally:
        torch.set_num_threads(before)


def ceiling_lines(rows: list[dict], rate: float) -> list[str]:
    """The ceiling table: per (workload, TP) row with `tflop` and each engine's median `lockstep_wall` /
    `vllm_wall`, each engine's product GFLOP/s, its share of `rate`, and the most any engine could reach against
    vLLM's run (rate over vLLM's GFLOP/s)."""
    lines = [f"{'wl':<2} {'TP':>2} {'TFLOP':>6} {'lockstep GFLOP/s':>16} {'vllm GFLOP/s':>12} {'most L/V':>8}"]
    for r in rows:
        got = {e: r["tflop"] * 1e3 / r[f"{e}_wall"] if r.get(f"{e}_wall") else None for e in ("lockstep", "vllm")}
        cells = [f"{got[e]:.0f} ({got[e] / rate:.0%})" if got[e] else "-" for e in ("lockstep", "vllm")]
        most = f"{rate / got['vllm']:.2f}x" if got["vllm"] else "-"
        lines.append(f"{r['workload']:<2} {r['tp']:>2} {r['tflop']:>6.3f} {cells[0]:>16} {cells[1]:>12} {most:>8}")
    return lines
