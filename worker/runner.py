"""The model runner: StepPlan -> static input buffers (worker/step_inputs.py) -> sharded forward -> logits on the
driver; decode graphs (worker/graphs.py) are captured at the first execute on every rank alike (docs/architecture.md,
"The runner")."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from cluster.config import ResolvedConfig
from cluster.device_lists import on_device
from cluster.dist import DRIVER
from cluster.plan import SCORE_PROMPT, StepPlan, logits_rows
from worker.attention import AttnMeta
from worker.compiled import ForwardFn
from worker.graphs import (CudaGraphFactory, DecodeGraphs, GraphFactory, GraphKey, decode_buckets, decode_widths,
                           tensor_addresses)
from worker.kv_cache import KVCache
from worker.models.decoder import CausalLM
from worker.prompt_scoring import ScoredLogits, score_on_shards, score_targets
from worker.shard_argmax import ShardArgmax
from worker.step_inputs import StaticBuffers, prepare_step
from worker.stream import Handle, InlineStream, Stream


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
        """`graph_factory`: how decode graphs are captured (tests pass `graphs.EagerStandIn()`); None: CUDA graphs
        where rc.use_cuda_graph asks for decode graphs on a CUDA device, none otherwise."""
        self.model, self.rc, self.device = model, rc, device
        self.cache = KVCache(model.config.num_hidden_layers, rc.num_blocks, rc.page_size, kv_heads, head_dim,
                             dtype, device, rc.num_host_blocks, values=model.kv_values)
        self.buffers = StaticBuffers(rc, device)
        self.forwards = ForwardFn(model, rc)  # the model, or its compiled decode/varlen forwards
        # an eager float32 CPU forward: the decode group gathers its keys by runs of slots, not slot by slot
        # (worker/attention.py, `dec_units`)
        self.row_views = device.type == "cpu" and dtype == torch.float32 and not self.forwards.compiled
        if graph_factory is None and rc.use_cuda_graph[1] and device.type == "cuda":
            graph_factory = CudaGraphFactory(device)
        self.graphs = DecodeGraphs(decode_buckets(rc.max_requests_per_batch), graph_factory,
                                   decode_widths(rc.paged_kernels, rc.max_kv_padded)) if graph_factory else None
        self.stream: Stream = InlineStream(device)  # the forwards' queue (overlapped: sampling and broadcasts too)
        # overlapped scheduling: the last step's sampled tokens, broadcast from rank 0 (see `share_burst`)
        self.shared_tokens = torch.zeros(rc.max_requests_per_batch, dtype=torch.int64, device=device)
        self.graph_stats: dict[str, Any] = (self.graphs.stats if self.graphs is not None else
                                            {"captured_buckets": [], "replays": 0, "eager_steps": 0})
        # the most sequences a decode step of this runner's current manager can hold: graphs are captured up to it
        self.batch_cap = min(rc.max_requests_per_batch, rc.num_blocks)

    def expect_batch(self, num_requests: int | None) -> None:
        """Cap the decode graphs at what the next manager can run: min(max_requests_per_batch, num_blocks, and
        `num_requests` when the caller knows them all, as generate_batch does). A later larger cap captures only
        the buckets it adds. Every rank calls it with the same number, before the manager's first step."""
        cap = min(self.rc.max_requests_per_batch, self.rc.num_blocks)
        self.batch_cap = cap if num_requests is None else max(1, min(cap, num_requests))

    def prepare(self, plan: StepPlan, bucket: int | None = None,
                width: int | None = None) -> tuple[torch.Tensor, AttnMeta, int]:
        """(input ids, attention metadata, real logit rows): `prepare_step` on this runner's buffers."""
        return prepare_step(self.rc, self.buffers, plan, self.cache.scratch_block, bucket, self.row_views, width)

    def warmup_plan(self, num_seqs: int = 1) -> StepPlan:
        """A decode step of `num_seqs` one-token sequences that reads and writes only the scratch block."""
        return self.scratch_plan([1] * num_seqs, [1] * num_seqs)

    def scratch_plan(self, q_lens: list[int], sample: list[int]) -> StepPlan:
        """A step whose sequences (contexts as long as their queries) read and write only the scratch block."""
        q = np.array(q_lens, np.int32)
        width = max(1, -(-int(q.max()) // self.rc.page_size))
        return StepPlan(input_ids=np.zeros(int(q.sum()), np.int32), q_lens=q, kv_lens=q.copy(),
                        sample=np.array(sample, np.int32),
                        block_tables=np.full((len(q_lens), width), self.cache.scratch_block, np.int32))

    def compile_plans(self) -> list[tuple[str, StepPlan]]:
        """(name, plan) of each compile warm-up step (worker/compiled.py): every decode bucket the graphs do not
        cover, then one prefill and one mixed step at the smallest padded query length the limits allow."""
        rc, compiled = self.rc, self.forwards.compiled
        plans: list[tuple[str, StepPlan]] = []
        if "decode" in compiled and self.graphs is None:
            plans += [(f"decode bucket {b}", self.warmup_plan(b)) for b in decode_buckets(rc.max_requests_per_batch)]
        q = min(max(rc.q_padding, 2), rc.max_batch_tokens)
        if "varlen" in compiled and q >= 2:
            plans.append((f"prefill of {q} tokens", self.scratch_plan([q], [1])))
        mixed_q = min(q, rc.max_batch_tokens - 1)
        if "varlen" in compiled and rc.max_requests_per_batch >= 2 and mixed_q >= 2:
            plans.append((f"1 decode + prefill of {mixed_q} tokens", self.scratch_plan([1, mixed_q], [1, 1])))
        return plans

    def graph_reads(self) -> dict[str, int]:
        """Address of everything a captured graph reads: parameters, buffers, KV cache, static buffers."""
        extra = {f"kv_cache.{kv}.{i}": t for kv in "kv" for i, t in enumerate(getattr(self.cache, kv))}
        extra.update({f"static.{k}": t for k, t in self.buffers.buffers.items()})
        return tensor_addresses(self.model, extra)

    def capture_graphs(self) -> None:
        """Capture the decode step of every bucket up to `batch_cap` not captured yet. Every rank calls it at once
        (all-reduces): `execute`, each step (it returns at once when nothing is missing)."""
        if self.graphs is None or not self.graphs.missing(self.batch_cap):
            return

        def prepare(key: GraphKey):
            ids, meta, _ = self.prepare(self.warmup_plan(key[0]), bucket=key[0], width=key[1])
            return (lambda: self.forward_fn(ids, meta)), static_inputs(ids, meta)

        with torch.inference_mode():
            self.graphs.capture_all(prepare, self.graph_reads, cap=self.batch_cap)

    def check_graph_addresses(self) -> list[str]:
        """Names of the tensors captured graphs read whose storage moved since capture (empty: all is well).
        Called after a weight update (which must copy in place): refuse to serve on any. Local to this rank."""
        return [] if self.graphs is None else self.graphs.changed_addresses(self.graph_reads())

    def execute(self, plan: StepPlan) -> torch.Tensor | ShardArgmax | ScoredLogits | None:
        """Run one step and wait for it. Every rank calls it with the same plan; the driver gets [sampled seqs +
        SCORE_ALL positions, vocab] logits (cluster.plan.logits_rows), with SCORE_PROMPT rows those and their
        positions' scores (ScoredLogits), or with `argmax_on_shards` every rank the greedy tokens (ShardArgmax)."""
        return self.launch(plan).value()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Handle[torch.Tensor | ShardArgmax | ScoredLogits | None]:
        """Prepare the plan's inputs on the host and queue its (first) forward on the stream; the handle's result
        is what `execute` returns. Every rank calls it alike, then, with `share_tokens`, `share_burst`."""
        if not self.forwards.warmed:  # the first time: compile what the compile configs ask for
            self.forwards.warm_up(self.compile_plans(), lambda p: self.prepare(p)[:2], self.cache.k, self.cache.v)
        run = self._prepared(plan)
        self._burst = (plan, run)  # what share_burst queues the rest of a burst with
        return self.stream.submit(lambda: run(True))

    def _prepared(self, plan: StepPlan) -> Callable[[bool], torch.Tensor | ShardArgmax | ScoredLogits | None]:
        """Lay the plan out (at its graph's shapes when one holds it); returns the function that runs its
        first forward (KV page copies and shared token ids first) or, for a burst, a later one (`_advance` first).
        SCORE_PROMPT rows (prompt logprobs; never in a graph) leave the forward as the head's inputs and are scored
        on the vocabulary shards after the logits gather (worker/prompt_scoring.py)."""
        key, scores = None, bool((plan.sample & SCORE_PROMPT).any())
        if self.graphs is not None and not scores:
            self.capture_graphs()
            if plan.num_decode == plan.num_seqs:  # the gather's keys: each row's context and the burst's later ones
                need = 0 if self.rc.paged_kernels else int(plan.kv_lens.max(initial=0)) + plan.burst - 1
                key = self.graphs.key_for(plan.num_seqs, need)
        if key is None:
            self.graph_stats["eager_steps"] += plan.burst
        ids, meta, n = self.prepare(plan, *(key or (None, None)))
        refs = bool(plan.num_tokens) and int(plan.input_ids.min()) < 0
        targets = on_device(score_targets(plan), torch.int64, self.device) if scores else None
        projected = n - (0 if targets is None else targets.shape[0])  # rows whose logits the gather returns
        rows = None if key is None else on_device(np.concatenate(logits_rows(plan.sample, plan.q_lens)), torch.int64,
                                                  self.device)  # a decode row's positions: its own row

        def run(first: bool) -> torch.Tensor | ShardArgmax | ScoredLogits | None:
            if first:
                self.cache.apply_swaps(plan.swap_out, plan.swap_in, plan.page_copies)  # KV page copies first
                if refs:
                    self._resolve_ids(ids)
            else:
                self._advance(ids, meta, plan.num_seqs)
            if key is not None:
                local = self.graphs.replay(key, static_inputs(ids, meta))[rows]
            elif targets is not None:
                heads = self.forward_fn(ids, meta, project=False)[:n]
                local = self.model.project(heads[:projected])
            else:
                local = self.forward_fn(ids, meta)[:n]
            if plan.argmax_on_shards:  # every rank gets the tokens: the next forward reads them from shared_tokens
                chosen = self.model.lm_head.argmax(local)
                if plan.share_tokens:
                    self.shared_tokens[:n].copy_(chosen.tokens)
                return chosen
            logits = self.model.lm_head.gather(local)
            if targets is not None:  # every rank, after the gather (docs/architecture.md, the lockstep rules)
                found = score_on_shards(self.model.project, self.model.lm_head, heads[projected:], targets,
                                        plan.score_top)
                return None if logits is None or found is None else ScoredLogits(logits.float(), found)
            return None if logits is None else logits.float()

        return run

    def _advance(self, ids: torch.Tensor, meta: AttnMeta, b: int) -> None:
        """The next forward of a decode-only burst, in place in the static buffers: each row's input is the token
        just sampled for it (`shared_tokens`), one position further (docs/architecture.md, "Multi-step decode")."""
        ids[:b].copy_(self.shared_tokens[:b])
        pos = meta.positions[:b].add_(1)
        meta.dec_q_pos[:b] += 1
        if meta.dec_block_table is not None:
            meta.dec_kv_lens[:b] += 1
            page = meta.page_size
            block = meta.dec_block_table[:b].gather(1, (pos // page)[:, None])[:, 0]
            meta.slot_mapping[:b].copy_(block.long() * page + pos % page)
        else:
            later = meta.dec_ahead[:b]
            slot = later[:, 0].clone()
            later[:, :-1] = later[:, 1:].clone()
            meta.dec_kv_slots[:b].scatter_(1, pos[:, None], slot[:, None])
            meta.slot_mapping[:b].copy_(slot)

    def forward_fn(self, ids: torch.Tensor, meta: AttnMeta, project: bool = True) -> torch.Tensor:
        """This rank's logits shard for meta's rows (`project` False: the head's inputs, CausalLM.forward), eager or
        compiled (benchmarks/control_plane.py stands in)."""
        return self.forwards(ids, meta, self.cache.k, self.cache.v, project)

    def _resolve_ids(self, ids: torch.Tensor) -> None:
        """Replace, in place on the device, every id -(1 + j) by the previous step's sampled token j."""
        shared = self.shared_tokens
        ids.copy_(torch.where(ids < 0, shared[(-ids - 1).clamp(0, shared.numel() - 1)], ids))

    @torch.inference_mode()
    def share_burst(self, logits: Handle[torch.Tensor | ShardArgmax | None],
                    sample: Callable[[int, Handle], Callable[[], torch.Tensor]] | None) -> None:
        """Queue after each forward of the plan last launched (`burst` of them): on the driver its sampling
        (`sample(i, handle)`, None elsewhere, gives a function returning forward i's tokens); on every rank the
        broadcast of its tokens into `shared_tokens` (device group; none with `argmax_on_shards`); then the burst's
        next forward. Every rank calls it right after `launch` (whose handle is `logits`) for a `share_tokens` plan."""
        plan, run = self._burst
        for i in range(plan.burst):
            tokens = None if sample is None else sample(i, logits)
            if not plan.argmax_on_shards:  # else every rank holds the tokens already (see `_prepared`)
                self._share(tokens)
            if i + 1 < plan.burst:
                logits = self.stream.submit(lambda: run(False))

    def _share(self, tokens: Callable[[], torch.Tensor] | None) -> Handle[None]:
        """Queue one forward's token broadcast from rank 0 into `shared_tokens` (device group): every rank, in the
        same order, through `share_burst` only."""
        shard = self.model.lm_head.shard

        def broadcast() -> None:
            with torch.inference_mode():
                if tokens is not None:
                    got = tokens()
                    self.shared_tokens[:got.numel()].copy_(got)
                if shard.size > 1:
                    dist.broadcast(self.shared_tokens, DRIVER, group=shard.group)

        return self.stream.submit(broadcast)
