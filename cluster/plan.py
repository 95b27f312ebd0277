"""The StepPlan: everything a rank needs to run one step, as fixed-layout integers.

On the wire (cluster/dist.py): one broadcast of a frame (the int64 header, then room for that many int32 payload
words as the previous plan's header announced in NEXT_INLINE: the flat payload, whose layout the header's counts
define, rides there when it fits), then, only when the header says so, one of a payload too long to ride inline,
one of msgpack bytes for commands that carry data, and a gather of every other rank's state row on the driver
(GATHER_STATE: every plan that is not a STEP, and a STEP plan when the rows are STATE_PERIOD_S old). Nothing is pickled. Workers keep no request state: a plan is complete in itself.
Every single-token query comes first (the decode group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

PLAN_MAGIC = 0x10C5
HEADER_LEN = 20
MIN_INLINE = 512  # int32 payload words the first frame of a control group has room for (then NEXT_INLINE's)
STATE_PERIOD_S = 0.05  # how stale the driver lets its copy of the workers' state rows get during STEP plans


class Command(IntEnum):
    STEP = 0  # run the forward described by the arrays
    IDLE = 1  # nothing to run; a heartbeat so workers' waits never time out
    STOP = 2  # leave the loop; `data` may carry results for every rank
    PAUSE = 3  # park at this boundary until RESUME
    RESUME = 4
    PUBLISH = 5  # `data` carries msgpack for every rank (results, errors); no forward
    CALL = 6  # `data` names a collective action every rank performs now (weight updates ...)


class H(IntEnum):
    """Slots of the int64 header."""

    MAGIC = 0
    COMMAND = 1
    STEP = 2
    NUM_TOKENS = 3
    NUM_SEQS = 4
    NUM_DECODE = 5
    TABLE_WIDTH = 6
    PAYLOAD_LEN = 7
    WEIGHT_VERSION = 8
    DATA_LEN = 9
    SHARE_TOKENS = 10  # 1: overlapped step (see StepPlan.share_tokens)
    BURST = 11  # decode steps this STEP plan runs back to back (see StepPlan.burst); 0 or 1: one
    NUM_SWAP_OUT = 12  # KV page copies device -> host pool before the forward (cpu_offload_space)
    NUM_SWAP_IN = 13  # host pool -> device, after the swap-outs
    ARGMAX_ON_SHARDS = 14  # 1: the step's tokens are chosen on the vocab shards (see StepPlan.argmax_on_shards)
    GATHER_STATE = 15  # 1: after the broadcasts every rank's state row is gathered on the driver (StepPlan.gather)
    NEXT_INLINE = 16  # the int32 payload words the next plan's frame has room for (cluster/dist.py `inline_words`)
    NUM_PAGE_COPIES = 17  # KV page -> KV page copies after the swap-outs, before the swap-ins (n samples: forks)
    NUM_SCORED = 18  # rows flagged SCORE_PROMPT: each has its `score_next` at the payload's end
    SCORE_TOP = 19  # the k of the prompt scores' top-k (StepPlan.score_top)


class S(IntEnum):
    """Slots of a worker's state row (gathered on the driver with the plans that set GATHER_STATE; cluster/dist.py
    `send_plan`)."""

    MAGIC = 0  # STATE_MAGIC: the rank is alive and in step with the protocol
    LAST_STEP = 1  # the step number of the last plan it executed
    WANTS_RESULTS = 2  # 1: a caller on this rank reads results, so the driver publishes them


STATE_MAGIC = 0x5747

SAMPLE_LAST = 1  # StepPlan.sample flag: the row's last position's logits are sampled
SCORE_ALL = 2  # StepPlan.sample flag: the logits of all the row's positions come back too (speculative verify rows)
# StepPlan.sample flag: every position of the row is scored against its next token on the vocabulary shards (prompt
# logprobs): only each position's log-normaliser, target logit and top-k come back (worker/prompt_scoring.py)
SCORE_PROMPT = 4


def logits_rows(sample: np.ndarray, q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sampled rows, SCORE_ALL rows, SCORE_PROMPT rows) of a plan: the forward's head rows are one per sampled row
    (its last position), then every position of each SCORE_ALL row, then every position of each SCORE_PROMPT row,
    each group in row order; the gathered logits hold the first two groups."""
    return (np.flatnonzero(sample & SAMPLE_LAST), np.flatnonzero(sample & SCORE_ALL),
            np.flatnonzero(sample & SCORE_PROMPT))


@dataclass
class StepPlan:
    command: Command = Command.STEP
    step: int = 0
    weight_version: int = 0
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [T]
    q_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [B] tokens run this step
    kv_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [B] context after the step
    # [B] flags: SAMPLE_LAST (its last position's logits are sampled), SCORE_ALL (every position's logits come back
    # after the sampled rows', for speculative verify rows), SCORE_PROMPT (every position scored on the vocabulary
    # shards, for prompt logprobs: driver/engine/prompt_scores.py)
    sample: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # [B, NB]
    swap_out: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))  # [n, 2] (page, host slot)
    swap_in: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))  # [m, 2] (host slot, page)
    # [c, 2] (source page, destination page): a forked child's copy of its parent's partly filled last page
    page_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    # [number of SCORE_PROMPT rows] int32, in row order: the token the row's last position is scored against (its
    # other positions': the row's next input id), -1 for none (the prompt's last position)
    score_next: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    score_top: int = 0  # the k of each SCORE_PROMPT position's top-k (the step's largest prompt_logprobs)
    data: bytes = b""
    # overlapped scheduling: every rank broadcasts this step's sampled tokens on the device group after its
    # forward; the NEXT step's input id -(1 + j) reads sampled row j of this step
    share_tokens: bool = False
    # multi-step decode: every rank runs this decode-only, overlapped plan `burst` times back to back, each forward
    # reading the tokens the one before sampled, positions, slots and KV lengths advanced on the device
    # (worker/runner.py `share_burst`); the driver sends no plan in between
    burst: int = 1
    # every sampled row is plain greedy with no logprobs: each rank takes its vocab shard's argmax, rank 0 gathers
    # the (logit, token) pairs and broadcasts the chosen tokens; no logits gathered (worker/shard_argmax.py)
    argmax_on_shards: bool = False
    # every rank's state row is gathered on the driver after this plan (the driver decides: `send_plan`)
    gather: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.q_lens.shape[0])

    @property
    def num_decode(self) -> int:
        """Sequences at the front whose query is a single token."""
        longer = np.flatnonzero(self.q_lens != 1)
        return int(longer[0]) if longer.size else self.num_seqs

    def header(self) -> np.ndarray:
        h = np.zeros(HEADER_LEN, np.int64)
        h[[H.MAGIC, H.COMMAND, H.STEP, H.NUM_TOKENS, H.NUM_SEQS, H.NUM_DECODE, H.WEIGHT_VERSION, H.DATA_LEN]] = (
            PLAN_MAGIC, self.command, self.step, self.num_tokens, self.num_seqs, self.num_decode, self.weight_version,
            len(self.data))
        h[H.TABLE_WIDTH] = self.block_tables.shape[1] if self.block_tables.ndim == 2 else 0
        h[[H.NUM_SWAP_OUT, H.NUM_SWAP_IN]] = self.swap_out.shape[0], self.swap_in.shape[0]
        h[H.NUM_PAGE_COPIES] = self.page_copies.shape[0]
        h[[H.SHARE_TOKENS, H.BURST, H.ARGMAX_ON_SHARDS]] = self.share_tokens, self.burst, self.argmax_on_shards
        h[H.GATHER_STATE] = self.gather
        h[[H.NUM_SCORED, H.SCORE_TOP]] = self.score_next.shape[0], self.score_top
        h[H.PAYLOAD_LEN] = payload_len(h)
        return h

    def payload(self) -> np.ndarray:
        return np.concatenate([self.input_ids, self.q_lens, self.kv_lens, self.sample,
                               self.block_tables.reshape(-1), self.swap_out.reshape(-1),
                               self.swap_in.reshape(-1), self.page_copies.reshape(-1),
                               self.score_next]).astype(np.int32, copy=False)


def payload_len(h: np.ndarray) -> int:
    t, b, nb = int(h[H.NUM_TOKENS]), int(h[H.NUM_SEQS]), int(h[H.TABLE_WIDTH])
    return (t + 3 * b + b * nb + 2 * (int(h[H.NUM_SWAP_OUT]) + int(h[H.NUM_SWAP_IN]) + int(h[H.NUM_PAGE_COPIES]))
            + int(h[H.NUM_SCORED]))


def plan_from_parts(h: np.ndarray, payload: np.ndarray | None, data: bytes) -> StepPlan:
    """Rebuild a plan from what the broadcasts delivered; rejects a header that is not a plan."""
    if int(h[H.MAGIC]) != PLAN_MAGIC:
        raise RuntimeError(f"control channel out of step: header magic {int(h[H.MAGIC]):#x}")
    t, b, nb = int(h[H.NUM_TOKENS]), int(h[H.NUM_SEQS]), int(h[H.TABLE_WIDTH])
    plan = StepPlan(command=Command(int(h[H.COMMAND])), step=int(h[H.STEP]),
                    weight_version=int(h[H.WEIGHT_VERSION]), data=data, share_tokens=bool(h[H.SHARE_TOKENS]),
                    burst=max(1, int(h[H.BURST])), argmax_on_shards=bool(h[H.ARGMAX_ON_SHARDS]),
                    gather=bool(h[H.GATHER_STATE]), score_top=int(h[H.SCORE_TOP]))
    if payload is not None and payload.size:
        n_out, n_in, n_copies = int(h[H.NUM_SWAP_OUT]), int(h[H.NUM_SWAP_IN]), int(h[H.NUM_PAGE_COPIES])
        (plan.input_ids, plan.q_lens, plan.kv_lens, plan.sample, tables, swap_out, swap_in, copies,
         plan.score_next) = np.split(payload[:payload_len(h)],
                                     np.cumsum([t, b, b, b, b * nb, 2 * n_out, 2 * n_in, 2 * n_copies]))
        plan.block_tables, plan.swap_out, plan.swap_in, plan.page_copies = (
            tables.reshape(b, nb), swap_out.reshape(n_out, 2), swap_in.reshape(n_in, 2), copies.reshape(-1, 2))
    return plan
