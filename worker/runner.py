"""The model runner: StepPlan -> static input buffers -> sharded forward -> logits on the driver.

Capture safety, as DESIGN.md asks: every input of the forward is a view into a buffer allocated once, whose
storage never moves; each step only copies the plan into them. Shapes are padded to buckets (decode batches
to powers of two, query tokens to `q_padding`, KV lengths to `kv_padding`), so the set of shapes is finite.
The host-side index arithmetic happens here, before the forward, never inside it.

With decode graphs on (worker/graphs.py) a decode-only step that fits a batch bucket is laid out at that
bucket's fixed shapes and replayed; every other step runs eagerly. The graphs are captured, every bucket,
the first time the runner executes (the manager's warm-up step), on every rank alike.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from cluster.config import ResolvedConfig, next_pow2, round_up
from cluster.dist import DRIVER
from cluster.plan import StepPlan
from worker import flash
from worker.attention import AttnMeta
from worker.compiled import ForwardFn
from worker.graphs import (
    CudaGraphFactory,
    DecodeGraphs,
    GraphFactory,
    decode_buckets,
    tensor_addresses,
)
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.stream import Handle, InlineStream, Stream

INT32_BUFFERS = ("dec_block_table", "dec_kv_lens", "pre_cu_q", "pre_cu_k", "pre_block_table")  # flash-attn's


class StaticBuffers:
    """Flat int64 buffers sized for the largest step; a step's inputs are leading views of them."""

    def __init__(self, rc: ResolvedConfig, device: torch.device):
        t = rc.max_tokens_padded
        b = next_pow2(rc.max_requests_per_batch)
        q = round_up(rc.max_batch_tokens, rc.q_padding)
        kv = rc.max_kv_padded
        nb = rc.max_blocks_per_request
        sizes = {"dec_block_table": b * nb, "dec_kv_lens": b, "input_ids": t, "positions": t, "slot_mapping": t,
                 "dec_kv_slots": b * kv, "dec_q_pos": b, "pre_q_gather": b * q, "pre_q_scatter": b * q,
                 "pre_kv_slots": b * kv, "pre_q_pos": b * q, "logits_idx": b, "pre_cu_q": b + 1, "pre_cu_k": b + 1,
                 "pre_block_table": b * nb}
        self.buffers = {k: torch.zeros(n, dtype=torch.int32 if k in INT32_BUFFERS else torch.int64, device=device)
                        for k, n in sizes.items()}

    def fill(self, name: str, values: np.ndarray) -> torch.Tensor:
        """Copy `values` into the front of buffer `name` and return that view, shaped like `values`."""
        buf = self.buffers[name]
        n = values.size
        if n > buf.numel():
            raise RuntimeError(f"step needs {n} entries in static buffer {name!r}, which holds {buf.numel()}")
        view = buf[:n]
        host = np.ascontiguousarray(values, dtype=np.int32 if buf.dtype == torch.int32 else np.int64)
        view.copy_(torch.from_numpy(host).reshape(-1), non_blocking=True)
        return view.view(values.shape)


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
        self.forwards = ForwardFn(model, rc)  # the model, or its compiled decode/varlen forwards
        if graph_factory is None and rc.use_cuda_graph[1] and device.type == "cuda":
            graph_factory = CudaGraphFactory(device)
        self.graphs = None if graph_factory is None else DecodeGraphs(decode_buckets(rc.max_requests_per_batch),
                                                                      graph_factory)
        # the device queue the forwards (and, overlapped, sampling and the token broadcast) go through
        self.stream: Stream = InlineStream(device)
        # overlapped scheduling: the last step's sampled tokens, broadcast from rank 0 (see `share`)
        self.shared_tokens = torch.zeros(rc.max_requests_per_batch, dtype=torch.int64, device=device)
        self.graph_stats: dict[str, Any] = (self.graphs.stats if self.graphs is not None else
                                            {"captured_buckets": [], "replays": 0, "eager_steps": 0})

    def prepare(self, plan: StepPlan, bucket: int | None = None) -> tuple[torch.Tensor, AttnMeta, int]:
        """Lay the plan out in the static buffers. Returns (input ids, attention metadata, real logit rows).

        `bucket`: a decode-only plan laid out at that graph bucket's fixed shapes (rows, KV width, one logit
        row per bucket row); None: the eager layout, padded only as far as this step needs."""
        rc, page, scratch = self.rc, self.rc.page_size, self.cache.scratch_slot
        q_lens = plan.q_lens.astype(np.int64)
        kv_lens = plan.kv_lens.astype(np.int64)
        tables = plan.block_tables.astype(np.int64)
        b, bd = plan.num_seqs, plan.num_decode
        if bucket is not None and (bd != b or bd > bucket):
            raise ValueError(f"a plan of {b} sequences ({bd} decoding) does not fit decode bucket {bucket}")
        bd_pad = bucket if bucket is not None else next_pow2(bd) if bd else 0
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        t_pre = int(cu[-1] - cu[bd])
        t_pre_pad = round_up(t_pre, rc.q_padding)
        t_pad = bd_pad + t_pre_pad

        # per token: sequence, position, cache slot; then place them in the padded layout
        seq = np.repeat(np.arange(b), q_lens)
        pos = (kv_lens - q_lens)[seq] + np.arange(cu[-1]) - cu[seq]
        slot = tables[seq, pos // page] * page + pos % page
        where = np.arange(cu[-1])
        where[bd:] += bd_pad - bd
        ids = np.zeros(t_pad, np.int64)
        positions = np.zeros(t_pad, np.int64)
        slots = np.full(t_pad, scratch, np.int64)
        ids[where], positions[where], slots[where] = plan.input_ids, pos, slot

        # decode group: one query per sequence; padding rows read and write only the scratch block
        width = rc.max_kv_padded if bucket is not None else round_up(int(kv_lens[:bd].max()), rc.kv_padding) if bd else 0
        dec_slots = np.full((bd_pad, width), scratch, np.int64)
        dec_q_pos = np.zeros(bd_pad, np.int64)
        if bd:
            dec_slots[:bd] = self._kv_slots(tables[:bd], kv_lens[:bd], width)
            dec_q_pos[:bd] = kv_lens[:bd] - 1

        # prefill group: sequences padded to a common query length
        bp = b - bd
        bp_pad = next_pow2(bp) if bp else 0
        qp_pad = round_up(int(q_lens[bd:].max()), rc.q_padding) if bp else 0
        lp_pad = round_up(int(kv_lens[bd:].max()), rc.kv_padding) if bp else 0
        pre_q_gather = np.zeros((bp_pad, qp_pad), np.int64)
        pre_q_scatter = np.full((bp_pad, qp_pad), t_pre_pad, np.int64)  # padding queries: the dropped row
        pre_q_pos = np.zeros((bp_pad, qp_pad), np.int64)
        pre_slots = np.full((bp_pad, lp_pad), scratch, np.int64)
        if bp:
            p = seq[bd:] - bd  # prefill index of each prefill token
            i = np.arange(t_pre) - (cu[bd:-1] - cu[bd])[p]  # offset within its sequence
            pre_q_gather[p, i] = pre_q_scatter[p, i] = np.arange(t_pre)
            pre_q_pos[p, i] = pos[bd:]
            pre_slots[:bp] = self._kv_slots(tables[bd:], kv_lens[bd:], lp_pad)

        sampled = np.nonzero(plan.sample)[0]
        if bucket is not None:  # every bucket row's logits; the sampled rows are picked after the replay
            logits_idx = np.arange(bucket, dtype=np.int64)
        else:
            last_token = where[cu[1:] - 1]
            logits_idx = np.zeros(next_pow2(len(sampled)) if len(sampled) else 0, np.int64)
            logits_idx[:len(sampled)] = last_token[sampled]

        f = self.buffers.fill
        meta = AttnMeta(positions=f("positions", positions), slot_mapping=f("slot_mapping", slots),
                        dec_kv_slots=f("dec_kv_slots", dec_slots), dec_q_pos=f("dec_q_pos", dec_q_pos),
                        pre_q_gather=f("pre_q_gather", pre_q_gather.reshape(-1)),
                        pre_q_scatter=f("pre_q_scatter", pre_q_scatter.reshape(-1)),
                        pre_kv_slots=f("pre_kv_slots", pre_slots), pre_q_pos=f("pre_q_pos", pre_q_pos),
                        logits_idx=f("logits_idx", logits_idx), page_size=page,
                        chunk_elements=rc.attn_chunk_elements)
        if rc.use_flash_attn:
            self._flash_meta(meta, tables, q_lens, kv_lens, bd, bd_pad)
        return f("input_ids", ids), meta, len(sampled)

    def _flash_meta(self, meta: AttnMeta, tables: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
                    bd: int, bd_pad: int) -> None:
        """flash-attn's block tables (fixed width max_blocks_per_request) and varlen metadata."""
        f, nb, scratch_block = self.buffers.fill, self.rc.max_blocks_per_request, self.cache.scratch_block
        if bd:
            table = np.full((bd_pad, nb), scratch_block, np.int64)
            table[:bd, :tables.shape[1]] = tables[:bd]
            lens = np.ones(bd_pad, np.int64)
            lens[:bd] = kv_lens[:bd]
            meta.dec_block_table, meta.dec_kv_lens = f("dec_block_table", table), f("dec_kv_lens", lens)
        if len(q_lens) > bd:
            host = flash.varlen_metadata(q_lens[bd:], kv_lens[bd:], tables[bd:], nb, scratch_block)
            meta.pre_flash = flash.VarlenMeta(
                cu_seqlens_q=f("pre_cu_q", host.cu_seqlens_q), cu_seqlens_k=f("pre_cu_k", host.cu_seqlens_k),
                block_table=f("pre_block_table", host.block_table), max_seqlen_q=host.max_seqlen_q,
                max_seqlen_k=host.max_seqlen_k, num_tokens=host.num_tokens)

    def _kv_slots(self, tables: np.ndarray, kv_lens: np.ndarray, length: int) -> np.ndarray:
        """[B, length] cache slots of each sequence's keys in position order; the scratch slot past its end."""
        page = self.rc.page_size
        j = np.arange(length)
        cols = np.minimum(j // page, tables.shape[1] - 1)
        slots = tables[:, cols] * page + j % page
        return np.where(j[None, :] < kv_lens[:, None], slots, self.cache.scratch_slot)

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
            return (lambda: self.forward_fn(ids, meta)), static_inputs(ids, meta)

        with torch.inference_mode():
            self.graphs.capture_all(prepare, self.graph_reads)

    def check_graph_addresses(self) -> list[str]:
        """Names of the tensors captured graphs read whose storage moved since capture (empty: all is well).
        A weight update must copy into the existing storage; call this after one and refuse to serve on a
        non-empty answer. Local to this rank."""
        return [] if self.graphs is None else self.graphs.changed_addresses(self.graph_reads())

    # ---------------------------------------------------------------- steps
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one step and wait for it. Every rank calls it with the same plan; the driver gets [sampled seqs,
        vocab] logits."""
        return self.launch(plan).value()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Handle[torch.Tensor | None]:
        """Prepare the plan's inputs here (host) and queue its forward on this runner's stream; the handle's
        result is what `execute` returns. Input ids -(1 + j) are resolved on the device from `shared_tokens`
        (row j of the previous step's samples), after the previous step's `share`. Every rank calls it alike."""
        self.forwards.warm_up(self)  # the first time: compile what the compile configs ask for
        if self.graphs is not None:
            self.capture_graphs()
            bucket = self.graphs.bucket(plan.num_seqs) if plan.num_decode == plan.num_seqs else None
            if bucket is not None:
                ids, meta, _ = self.prepare(plan, bucket=bucket)
                rows = torch.from_numpy(np.nonzero(plan.sample)[0]).to(self.device)
                refs = bool(plan.num_tokens) and int(plan.input_ids.min()) < 0

                def replay() -> torch.Tensor | None:
                    self.cache.apply_swaps(plan.swap_out, plan.swap_in)  # the plan's KV page copies come first
                    if refs:
                        self._resolve_ids(ids)
                    logits = self.model.lm_head.gather(self.graphs.replay(bucket, static_inputs(ids, meta)))
                    return None if logits is None else logits[rows].float()

                return self.stream.submit(replay)
        self.graph_stats["eager_steps"] += 1
        ids, meta, n = self.prepare(plan)
        refs = bool(plan.num_tokens) and int(plan.input_ids.min()) < 0

        def forward() -> torch.Tensor | None:
            self.cache.apply_swaps(plan.swap_out, plan.swap_in)  # the plan's KV page copies come first
            if refs:
                self._resolve_ids(ids)
            logits = self.model.lm_head.gather(self.forward_fn(ids, meta))
            return None if logits is None else logits[:n].float()

        return self.stream.submit(forward)

    def forward_fn(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """The forward (eager, or compiled as the compile configs ask): this rank's logits shard for meta's logit
        rows. benchmarks/control_plane.py replaces it with a stand-in."""
        return self.forwards(ids, meta, self.cache.k, self.cache.v)

    def _resolve_ids(self, ids: torch.Tensor) -> None:
        """Replace, in place on the device, every id -(1 + j) by the previous step's sampled token j."""
        shared = self.shared_tokens
        ids.copy_(torch.where(ids < 0, shared[(-ids - 1).clamp(0, shared.numel() - 1)], ids))

    def share(self, tokens: Callable[[], torch.Tensor] | None) -> Handle[None]:
        """Queue, after this step's forward (and on the driver its sampling), the broadcast of the step's sampled
        tokens from rank 0 into every rank's `shared_tokens`, on the device group: the next step's inputs read
        them there, with no trip through the host. The driver passes a function that gives the tokens (in logits
        row order; it runs in stream order), the other ranks None. Every rank calls it for a plan whose
        `share_tokens` is set, after `launch`."""
        shard = self.model.lm_head.shard

        def broadcast() -> None:
            with torch.inference_mode():
                if tokens is not None:
                    got = tokens()
                    self.shared_tokens[:got.numel()].copy_(got)
                if shard.size > 1:
                    dist.broadcast(self.shared_tokens, DRIVER, group=shard.group)

        return self.stream.submit(broadcast)
