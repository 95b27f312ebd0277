"""A step's inputs: the plan laid out with numpy in one host staging buffer (two alternate, pinned on CUDA), then
ONE copy into one flat device buffer whose views are the forward's inputs (docs/architecture.md, "The runner").
On the CPU the copy is synchronous: prepare must not run while a forward reads the buffer."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from cluster.config import ResolvedConfig, next_pow2, round_up
from cluster.plan import StepPlan, logits_rows
from worker import flash
from worker.attention import AttnMeta

ALIGN = 8  # int64 entries (64 bytes): every input starts on such a boundary
VIEWS_KEPT = 4096  # StaticBuffers' device views kept for reuse
UNIT = 16  # the eager CPU decode gathers runs of gcd(page_size, UNIT) slots (`unit_lists`)


def _entries(n: int, int32: bool) -> int:
    """int64 entries (aligned) that `n` values take."""
    return round_up(-(-n // 2) if int32 else n, ALIGN)


def capacity_entries(rc: ResolvedConfig) -> int:
    """int64 entries the largest step of `rc` can need (each input at its largest, all at once)."""
    t, b, nb = rc.max_tokens_padded, next_pow2(rc.max_requests_per_batch), rc.max_blocks_per_request
    q = round_up(rc.max_batch_tokens, rc.q_padding)
    paged = rc.paged_kernels  # flash-attn or Triton: block tables instead of the SDPA path's lists
    wide = 0 if paged else rc.max_kv_padded  # the [B, L] slot lists: SDPA path only
    grid = 0 if paged else b * q  # the padded prefill query grids: SDPA path only
    ahead = 0 if paged else b * (rc.decode_burst - 1)  # a burst's later slots: SDPA path only
    int64 = [t, t, t, b * wide, b, grid, grid, b * wide, grid, b, ahead]
    int32 = [b * nb, b, b + 1, b + 1, b * nb]
    return sum(_entries(n, False) for n in int64) + sum(_entries(n, True) for n in int32)


class StaticBuffers:
    """The flat device buffer, its two host staging buffers and their events."""

    def __init__(self, rc: ResolvedConfig, device: torch.device):
        self.device = device
        self.flat = torch.zeros(capacity_entries(rc), dtype=torch.int64, device=device)
        self.buffers = {"flat": self.flat}  # what graph_reads and the memory accounting see
        self._staging: list[torch.Tensor] = []  # made on first use (never for the meta device)
        self._events: list[object | None] = [None, None]
        self.turn = 0  # which staging buffer (0 or 1) the current or last step was laid out in
        self._host: np.ndarray | None = None  # the staging buffer being laid out, and how far
        self._cursor = 0
        self._entries = self.flat.numel()
        # device views by (offset, shape, int32): made once and handed out again (a torch view costs ~7 us on the
        # host, a dozen of them a step), dropped whole past VIEWS_KEPT shapes
        self._views: dict[tuple[int, tuple[int, ...], bool], torch.Tensor] = {}

    def begin(self) -> None:
        """Start laying out a step in the next staging buffer, once its previous copy has completed."""
        if not self._staging:
            pin = self.device.type == "cuda"
            self._staging = [torch.zeros(self.flat.numel(), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.turn ^= 1
        event = self._events[self.turn]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self._events[self.turn] = None
        self._host = self._staging[self.turn].numpy()
        self._cursor = 0

    def alloc(self, shape: tuple[int, ...], int32: bool = False,
              fill: int | None = None) -> tuple[np.ndarray, torch.Tensor]:
        """The next input: (its host array to write, its device view), both of `shape`."""
        assert self._host is not None, "begin() first"
        n = math.prod(shape)
        start, size = self._cursor, _entries(n, int32)
        if start + size > self._entries:
            raise RuntimeError(f"a step needs more than the {self._entries} entries of the static buffer")
        self._cursor += size
        host = self._host[start:start + size]
        host = (host.view(np.int32) if int32 else host)[:n].reshape(shape)
        dev = self._views.get((start, shape, int32))
        if dev is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            dev = self.flat[start:start + size]
            dev = self._views[(start, shape, int32)] = (dev.view(torch.int32) if int32 else dev)[:n].view(shape)
        if fill is not None:
            host.fill(fill)
        return host, dev

    def put(self, values: np.ndarray, int32: bool = False) -> torch.Tensor:
        """Lay `values` out as the next input; returns its device view."""
        host, dev = self.alloc(values.shape, int32)
        host[...] = values
        return dev

    def commit(self) -> None:
        """The step's one host-to-device copy (everything laid out since begin)."""
        n, src = self._cursor, self._staging[self.turn]
        self.flat[:n].copy_(src[:n], non_blocking=True)
        if self.device.type == "cuda":
            self._events[self.turn] = event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._host = None


def prepare_step(rc: ResolvedConfig, buf: StaticBuffers, plan: StepPlan, scratch_block: int,
                 bucket: int | None = None, row_views: bool = False,
                 graph_width: int | None = None) -> tuple[torch.Tensor, AttnMeta, int]:
    """Lay `plan` out in the static buffers. Returns (input ids, attention metadata, real logit rows).

    `bucket`: a decode-only plan laid out at that graph bucket's fixed shapes, its gathered keys `graph_width` wide
    (None: max_kv_padded; graphs.decode_widths); None: padded only as far as this step needs. A burst's later
    key slots (`dec_ahead`): docs/architecture.md, "Multi-step decode". `row_views` (an eager float32 CPU
    forward): a plan of one forward lists each decode row's keys by runs of slots (`unit_lists`)."""
    page, paged, tables = rc.page_size, rc.paged_kernels, plan.block_tables
    scratch = scratch_block * page
    q_lens, kv_lens = plan.q_lens.astype(np.int64), plan.kv_lens.astype(np.int64)
    b, bd = plan.num_seqs, plan.num_decode
    if bucket is not None and (bd != b or bd > bucket):
        raise ValueError(f"a plan of {b} sequences ({bd} decoding) does not fit decode bucket {bucket}")
    # row counts padded to a power of two bound the shapes a compiled forward meets; the eager CPU forward
    # (`row_views`) runs each product at the step's own row count (9 decode rows padded to 16: ~4 ms more a step)
    exact = row_views and bucket is None and not paged
    pad_rows = (lambda n: n) if exact else next_pow2
    bd_pad = bucket if bucket is not None else pad_rows(bd) if bd else 0
    cu = np.concatenate([[0], np.cumsum(q_lens)])  # each sequence's first token
    total, t_pre = int(cu[-1]), int(cu[-1] - cu[bd])  # tokens, prefill tokens
    t_pre_pad = round_up(t_pre, rc.q_padding)
    t_pad = bd_pad + t_pre_pad
    buf.begin()

    # per token: sequence, position, cache slot; placed in the padded layout (decode rows, then prefill)
    seq = np.repeat(np.arange(b), q_lens)
    pos = (kv_lens - q_lens)[seq] + np.arange(total) - cu[seq]
    slot = tables[seq, pos // page].astype(np.int64) * page + pos % page
    where = np.arange(total)
    where[bd:] += bd_pad - bd
    ids, ids_dev = buf.alloc((t_pad,), fill=0)
    positions, positions_dev = buf.alloc((t_pad,), fill=0)
    slots, slots_dev = buf.alloc((t_pad,), fill=scratch)
    ids[where], positions[where], slots[where] = plan.input_ids, pos, slot

    # decode group: one query per sequence; padding rows read and write only the scratch block
    ahead = plan.burst - 1
    rows = row_views and bucket is None and not paged and not ahead  # each row's pages, read in place
    width = 0 if paged or rows else (graph_width or rc.max_kv_padded) if bucket is not None else \
        round_up(int(kv_lens[:bd].max()) + ahead, rc.kv_padding) if bd else 0
    dec_slots, dec_slots_dev = buf.alloc((bd_pad, width), fill=scratch)
    dec_q_pos, dec_q_pos_dev = buf.alloc((bd_pad,), fill=0)
    if bd and width:
        dec_slots[:bd] = kv_slots(tables[:bd], kv_lens[:bd], width, page, scratch)
    dec_q_pos[:bd] = kv_lens[:bd] - 1

    # prefill group: sequences padded to a common query length (the SDPA path's grids)
    bp = b - bd
    bp_pad = pad_rows(bp) if bp else 0
    qp_pad = 0 if paged or not bp else round_up(int(q_lens[bd:].max()), rc.q_padding)
    lp_pad = 0 if paged or not bp else round_up(int(kv_lens[bd:].max()), rc.kv_padding)
    gather, gather_dev = buf.alloc((bp_pad * qp_pad,), fill=0)
    scatter, scatter_dev = buf.alloc((bp_pad * qp_pad,), fill=t_pre_pad)  # padding queries: the dropped row
    q_pos, q_pos_dev = buf.alloc((bp_pad, qp_pad), fill=0)
    pre_slots, pre_slots_dev = buf.alloc((bp_pad, lp_pad), fill=scratch)
    if bp and qp_pad:
        p = seq[bd:] - bd  # prefill index of each prefill token
        i = np.arange(t_pre) - (cu[bd:-1] - cu[bd])[p]  # offset within its sequence
        flat_idx = p * qp_pad + i
        gather[flat_idx] = scatter[flat_idx] = np.arange(t_pre)
        q_pos[p, i] = pos[bd:]
        pre_slots[:bp] = kv_slots(tables[bd:], kv_lens[bd:], lp_pad, page, scratch)

    sampled, full, prompt = logits_rows(plan.sample, q_lens)
    # the sampled rows' last positions, then every position of each SCORE_ALL row (speculative verify), then of
    # each SCORE_PROMPT row (prompt logprobs)
    picked = np.concatenate([where[cu[1:][sampled] - 1]] + [where[cu[r]:cu[r + 1]] for r in full.tolist()]
                            + [where[cu[r]:cu[r + 1]] for r in prompt.tolist()])
    if bucket is not None:  # every bucket row's logits; the sampled rows are picked after the replay
        logits_dev = buf.put(np.arange(bucket))
    else:
        logits_idx, logits_dev = buf.alloc((pad_rows(len(picked)) if len(picked) else 0,), fill=0)
        logits_idx[:len(picked)] = picked

    meta = AttnMeta(positions=positions_dev, slot_mapping=slots_dev, dec_kv_slots=dec_slots_dev,
                    dec_q_pos=dec_q_pos_dev, pre_q_gather=gather_dev, pre_q_scatter=scatter_dev,
                    pre_kv_slots=pre_slots_dev, pre_q_pos=q_pos_dev, logits_idx=logits_dev, page_size=page,
                    scratch_slot=scratch, chunk_elements=rc.attn_chunk_elements, attention=rc.attention)
    if row_views and not paged and bp:  # each prefill sequence attended unpadded (attention.py `_prefill_runs`)
        meta.pre_runs = [(int(cu[bd + i] - cu[bd]), int(q_lens[bd + i]), int(kv_lens[bd + i] - q_lens[bd + i]))
                         for i in range(bp)]
    if rows:
        meta.unit = math.gcd(page, UNIT)
        meta.dec_units, meta.dec_tail, meta.dec_tail_at = unit_lists(tables[:bd], kv_lens[:bd], page, meta.unit,
                                                                     scratch_block)
    if paged:
        _block_table_meta(buf, meta, tables, q_lens, kv_lens, bd, bd_pad, rc.max_blocks_per_request, scratch_block)
    elif ahead and bd:  # last: what a graph reads keeps its offsets whatever the burst
        later, meta.dec_ahead = buf.alloc((bd_pad, ahead), fill=scratch)
        j = kv_lens[:bd, None] + np.arange(ahead)
        later[:bd] = tables[np.arange(bd)[:, None], j // page].astype(np.int64) * page + j % page
    buf.commit()
    return ids_dev, meta, len(picked)


def _block_table_meta(buf: StaticBuffers, meta: AttnMeta, tables: np.ndarray, q_lens: np.ndarray,
                      kv_lens: np.ndarray, bd: int, bd_pad: int, nb: int, scratch_block: int) -> None:
    """The paged kernels' inputs (flash-attn's layout, the Triton kernel's too): block tables of fixed width
    max_blocks_per_request (padding rows: the scratch block, one key long), kv lens, varlen metadata."""
    if tables.shape[1] > nb:
        raise ValueError(f"block table of width {tables.shape[1]} exceeds max_blocks_per_request={nb}")
    if bd:
        table, meta.dec_block_table = buf.alloc((bd_pad, nb), int32=True, fill=scratch_block)
        table[:bd, :tables.shape[1]] = tables[:bd]
        lens, meta.dec_kv_lens = buf.alloc((bd_pad,), int32=True, fill=1)
        lens[:bd] = kv_lens[:bd]
    if len(q_lens) > bd:
        host = flash.varlen_metadata(q_lens[bd:], kv_lens[bd:], tables[bd:], nb, scratch_block)
        meta.pre_flash = replace(host, **{k: buf.put(getattr(host, k), int32=True)
                                          for k in ("cu_seqlens_q", "cu_seqlens_k", "block_table")})


def kv_slots(tables: np.ndarray, kv_lens: np.ndarray, length: int, page: int, scratch: int) -> np.ndarray:
    """[B, length] cache slots of each sequence's keys in position order; the scratch slot past its end."""
    j = np.arange(length)
    cols = np.minimum(j // page, tables.shape[1] - 1)
    slots = tables[:, cols].astype(np.int64) * page + j % page
    return np.where(j[None, :] < kv_lens[:, None], slots, scratch)


def unit_lists(tables: np.ndarray, kv_lens: np.ndarray, page: int, unit: int,
               scratch_block: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The eager CPU decode's gather (`AttnMeta.dec_units`): [B, U] runs of `unit` slots (a divisor of `page`) of
    each row's keys in position order, U covering the longest row (the scratch block's first run past a row's
    last: masked), and the positions past each row's length inside its last run, flat over [B, U * unit], with
    each row's first among them."""
    runs = -(-int(kv_lens.max()) // unit) if len(kv_lens) else 0
    j = np.arange(runs) * unit  # each run's first position
    per_page = page // unit
    units = tables[:, np.minimum(j // page, tables.shape[1] - 1)].astype(np.int64) * per_page + (j % page) // unit
    units = np.where(j[None, :] < kv_lens[:, None], units, scratch_block * per_page)
    ends = -(-kv_lens // unit) * unit  # each row's gathered positions end here
    count = ends - kv_lens
    at = np.concatenate([[0], np.cumsum(count)])
    row = np.repeat(np.arange(len(kv_lens)), count)
    tail = row * (runs * unit) + kv_lens[row] + np.arange(int(at[-1])) - at[row]
    return torch.from_numpy(units), torch.from_numpy(tail.astype(np.int64)), at.tolist()
