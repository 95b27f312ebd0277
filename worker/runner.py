"""The model runner: StepPlan -> static input buffers -> sharded forward -> logits on the driver.

Capture safety, as DESIGN.md asks: every input of the forward is a view into a buffer allocated once, whose
storage never moves; each step only copies the plan into them. Shapes are padded to buckets (decode batches
to powers of two, query tokens to `q_padding`, KV lengths to `kv_padding`), so the set of shapes is finite.
The host-side index arithmetic happens here, before the forward, never inside it.
"""

from __future__ import annotations

import numpy as np
import torch

from cluster.config import ResolvedConfig, next_pow2, round_up
from cluster.plan import StepPlan
from worker.attention import AttnMeta
from worker.kv_cache import KVCache
from worker.model import CausalLM


class StaticBuffers:
    """Flat int64 buffers sized for the largest step; a step's inputs are leading views of them."""

    def __init__(self, rc: ResolvedConfig, device: torch.device):
        t = rc.max_tokens_padded
        b = next_pow2(rc.max_requests_per_batch)
        q = round_up(rc.max_batch_tokens, rc.q_padding)
        kv = rc.max_kv_padded
        nb = rc.max_blocks_per_request
        sizes = {"dec_block_table": b * nb, "dec_kv_lens": b, "input_ids": t, "positions": t, "slot_mapping": t, "dec_kv_slots": b * kv, "dec_q_pos": b,
                 "pre_q_gather": b * q, "pre_out_gather": t, "pre_kv_slots": b * kv, "pre_q_pos": b * q,
                 "logits_idx": b}
        int32 = ("dec_block_table", "dec_kv_lens")  # flash-attn takes these as int32
        self.buffers = {k: torch.zeros(n, dtype=torch.int32 if k in int32 else torch.int64, device=device)
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


class ModelRunner:
    def __init__(self, model: CausalLM, rc: ResolvedConfig, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.rc = rc
        self.device = device
        self.cache = KVCache(model.config.num_hidden_layers, rc.num_blocks, rc.page_size, kv_heads, head_dim,
                             dtype, device)
        self.buffers = StaticBuffers(rc, device)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, AttnMeta, int]:
        """Lay the plan out in the static buffers. Returns (input ids, attention metadata, real logit rows)."""
        rc, page, scratch = self.rc, self.rc.page_size, self.cache.scratch_slot
        q_lens = plan.q_lens.astype(np.int64)
        kv_lens = plan.kv_lens.astype(np.int64)
        tables = plan.block_tables.astype(np.int64)
        b, bd = plan.num_seqs, plan.num_decode
        bd_pad = next_pow2(bd) if bd else 0
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

        # decode group: one query per sequence
        dec_slots = np.full((bd_pad, 0), scratch, np.int64)
        dec_q_pos = np.zeros(bd_pad, np.int64)
        if bd:
            dec_slots = np.full((bd_pad, round_up(int(kv_lens[:bd].max()), rc.kv_padding)), scratch, np.int64)
            dec_slots[:bd] = self._kv_slots(tables[:bd], kv_lens[:bd], dec_slots.shape[1])
            dec_q_pos[:bd] = kv_lens[:bd] - 1

        # prefill group: sequences padded to a common query length
        bp = b - bd
        bp_pad = next_pow2(bp) if bp else 0
        qp_pad = round_up(int(q_lens[bd:].max()), rc.q_padding) if bp else 0
        lp_pad = round_up(int(kv_lens[bd:].max()), rc.kv_padding) if bp else 0
        pre_q_gather = np.zeros((bp_pad, qp_pad), np.int64)
        pre_q_pos = np.zeros((bp_pad, qp_pad), np.int64)
        pre_slots = np.full((bp_pad, lp_pad), scratch, np.int64)
        pre_out = np.zeros(t_pre_pad, np.int64)
        if bp:
            p = seq[bd:] - bd  # prefill index of each prefill token
            i = np.arange(t_pre) - (cu[bd:-1] - cu[bd])[p]  # offset within its sequence
            pre_q_gather[p, i] = np.arange(t_pre)
            pre_q_pos[p, i] = pos[bd:]
            pre_out[:t_pre] = p * qp_pad + i
            pre_slots[:bp] = self._kv_slots(tables[bd:], kv_lens[bd:], lp_pad)

        sampled = np.nonzero(plan.sample)[0]
        last_token = where[cu[1:] - 1]
        logits_idx = np.zeros(next_pow2(len(sampled)) if len(sampled) else 0, np.int64)
        logits_idx[:len(sampled)] = last_token[sampled]

        f = self.buffers.fill
        meta = AttnMeta(positions=f("positions", positions), slot_mapping=f("slot_mapping", slots),
                        dec_kv_slots=f("dec_kv_slots", dec_slots), dec_q_pos=f("dec_q_pos", dec_q_pos),
                        pre_q_gather=f("pre_q_gather", pre_q_gather.reshape(-1)),
                        pre_out_gather=f("pre_out_gather", pre_out),
                        pre_kv_slots=f("pre_kv_slots", pre_slots), pre_q_pos=f("pre_q_pos", pre_q_pos),
                        logits_idx=f("logits_idx", logits_idx), page_size=page)
        if rc.use_flash_attn and bd:
            table = np.full((bd_pad, tables.shape[1]), self.cache.scratch_block, np.int64)
            table[:bd] = tables[:bd]
            lens = np.ones(bd_pad, np.int64)
            lens[:bd] = kv_lens[:bd]
            meta.dec_block_table, meta.dec_kv_lens = f("dec_block_table", table), f("dec_kv_lens", lens)
        return f("input_ids", ids), meta, len(sampled)

    def _kv_slots(self, tables: np.ndarray, kv_lens: np.ndarray, length: int) -> np.ndarray:
        """[B, length] cache slots of each sequence's keys in position order; the scratch slot past its end."""
        page = self.rc.page_size
        j = np.arange(length)
        cols = np.minimum(j // page, tables.shape[1] - 1)
        slots = tables[:, cols] * page + j % page
        return np.where(j[None, :] < kv_lens[:, None], slots, self.cache.scratch_slot)

    def warmup_plan(self) -> StepPlan:
        """A one-token decode step that reads and writes only the scratch block."""
        one = np.ones(1, np.int32)
        return StepPlan(input_ids=np.zeros(1, np.int32), q_lens=one, kv_lens=one, sample=one,
                        block_tables=np.full((1, 1), self.cache.scratch_block, np.int32))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one step. Every rank calls it with the same plan; the driver gets [sampled seqs, vocab] logits."""
        ids, meta, n = self.prepare(plan)
        local = self.model(ids, meta, self.cache.k, self.cache.v)
        logits = self.model.lm_head.gather(local)
        return None if logits is None else logits[:n].float()
