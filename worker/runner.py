"""The model runner: StepPlan -> static input buffers -> sharded forward -> logits on the driver.

Capture safety, as DESIGN.md asks: every input of the forward is a view into one flat buffer allocated once,
whose storage never moves; each step lays the plan out on the host and copies it there once
(worker/step_inputs.py). Shapes are padded to buckets (decode batches to powers of two, query tokens to
`q_padding`, KV lengths to `kv_padding`), so the set of shapes is finite. The host-side index arithmetic
happens there, before the forward, never inside it.

With decode graphs on (worker/graphs.py) a decode-only step that fits a batch bucket is laid out at that
bucket's fixed shapes and replayed; every other step runs eagerly. The graphs are captured, every bucket,
the first time the runner executes (the manager's warm-up step), on every rank alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cluster.config import ResolvedConfig
from cluster.plan import StepPlan
from worker.attention import AttnMeta
from worker.graphs import (
    CudaGraphFactory,
    DecodeGraphs,
    GraphFactory,
    decode_buckets,
    tensor_addresses,
)
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.step_inputs import StaticBuffers, prepare_step

__all__ = ["ModelRunner", "StaticBuffers", "static_inputs"]  # StaticBuffers: worker/memory.py sizes it from here


def static_inputs(ids: torch.Tensor, meta: AttnMeta) -> dict[str, torch.Tensor]:
    """The tensors a captured decode forward reads from the static buffers."""
    found = {"input_ids": ids, "positions": meta.positions, "slot_mapping": meta.slot_mapping,
             "dec_kv_slots": meta.dec_kv_slots, "dec_q_pos": meta.dec_q_pos, "logits_idx": meta.logits_idx}
    if meta.dec_block_table is not None:
        found.update(dec_block_table=meta.dec_block_table, dec_kv_lens=meta.dec_kv_lens)
    return found


class ModelRunner:
    def __init__(self, model: CausalLM, rc: ResolvedConfig, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, graph_factory: GraphFactory | None = None):
        """`graph_factory`: how decode graphs are captured. None: CUDA graphs where rc.use_cuda_graph asks
        for decode graphs on a CUDA device, none otherwise. Tests pass `graphs.EagerStandIn()`."""
        self.model = model
        self.rc = rc
        self.device = device
        self.cache = KVCache(model.config.num_hidden_layers, rc.num_blocks, rc.page_size, kv_heads, head_dim,
                             dtype, device, rc.num_host_blocks)
        self.buffers = StaticBuffers(rc, device)
        if graph_factory is None and rc.use_cuda_graph[1] and device.type == "cuda":
            graph_factory = CudaGraphFactory(device)
        self.graphs = None if graph_factory is None else DecodeGraphs(decode_buckets(rc.max_requests_per_batch),
                                                                      graph_factory)
        self.graph_stats: dict[str, Any] = (self.graphs.stats if self.graphs is not None else
                                            {"captured_buckets": [], "replays": 0, "eager_steps": 0})

    def prepare(self, plan: StepPlan, bucket: int | None = None) -> tuple[torch.Tensor, AttnMeta, int]:
        """Lay the plan out in the static buffers (worker/step_inputs.py). Returns (input ids, attention
        metadata, real logit rows). `bucket`: a decode-only plan laid out at that graph bucket's fixed shapes;
        None: the eager layout, padded only as far as this step needs."""
        return prepare_step(self.rc, self.buffers, plan, self.cache.scratch_block, bucket)

    def warmup_plan(self, num_seqs: int = 1) -> StepPlan:
        """A decode step of `num_seqs` one-token sequences that reads and writes only the scratch block."""
        one = np.ones(num_seqs, np.int32)
        return StepPlan(input_ids=np.zeros(num_seqs, np.int32), q_lens=one, kv_lens=one, sample=one,
                        block_tables=np.full((num_seqs, 1), self.cache.scratch_block, np.int32))

    # ---------------------------------------------------------------- graphs
    def graph_reads(self) -> dict[str, int]:
        """Address of everything a captured graph reads: parameters, buffers, KV cache, static buffers."""
        extra = {f"kv_cache.k.{i}": t for i, t in enumerate(self.cache.k)}
        extra.update({f"kv_cache.v.{i}": t for i, t in enumerate(self.cache.v)})
        extra.update({f"static.{k}": t for k, t in self.buffers.buffers.items()})
        return tensor_addresses(self.model, extra)

    def capture_graphs(self) -> None:
        """Capture the decode step of every bucket. Every rank calls it at the same point (the forward
        all-reduces); `execute` does so the first time it runs."""
        if self.graphs is None or self.graphs.captured:
            return

        def prepare(bucket: int):
            ids, meta, _ = self.prepare(self.warmup_plan(bucket), bucket=bucket)
            return (lambda: self.model(ids, meta, self.cache.k, self.cache.v)), static_inputs(ids, meta)

        with torch.inference_mode():
            self.graphs.capture_all(prepare, self.graph_reads)

    def check_graph_addresses(self) -> list[str]:
        """Names of the tensors captured graphs read whose storage moved since capture (empty: all is well).
        A weight update must copy into the existing storage; call this after one and refuse to serve on a
        non-empty answer. Local to this rank."""
        return [] if self.graphs is None else self.graphs.changed_addresses(self.graph_reads())

    # ---------------------------------------------------------------- steps
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one step. Every rank calls it with the same plan; the driver gets [sampled seqs, vocab] logits."""
        self.cache.apply_swaps(plan.swap_out, plan.swap_in)  # the plan's KV page copies, before its forward
        if self.graphs is not None:
            self.capture_graphs()
            bucket = self.graphs.bucket(plan.num_seqs) if plan.num_decode == plan.num_seqs else None
            if bucket is not None:
                ids, meta, _ = self.prepare(plan, bucket=bucket)
                local = self.graphs.replay(bucket, static_inputs(ids, meta))
                logits = self.model.lm_head.gather(local)
                if logits is None:
                    return None
                return logits[torch.from_numpy(np.nonzero(plan.sample)[0]).to(logits.device)].float()
        self.graph_stats["eager_steps"] += 1
        ids, meta, n = self.prepare(plan)
        local = self.model(ids, meta, self.cache.k, self.cache.v)
        logits = self.model.lm_head.gather(local)
        return None if logits is None else logits[:n].float()
