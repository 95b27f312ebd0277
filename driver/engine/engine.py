"""Rank 0's step: schedule -> StepPlan -> broadcast -> forward -> sample -> update requests.

Only the manager's loop thread calls the engine, and only it talks on the control group, so every rank sees the
same sequence of plans. Overlapped steps and bursts: docs/architecture.md, "Overlapped scheduling". Before any
plan that is not a STEP the caller flushes (`flush`): no other plan ever meets a step in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from cluster.config import ResolvedConfig
from cluster.dist import Groups, send_plan
from cluster.errors import Code
from cluster.outputs import FINISH_REASONS, RequestStatus
from cluster.plan import SAMPLE_LAST, SCORE_ALL, SCORE_PROMPT, STATE_PERIOD_S, Command, S, StepPlan
from driver.engine.block_manager import BlockManager, token_slice
from driver.engine.prompt_scores import carry_targets, record_scores, scored_rows
from driver.engine.request import Request
from driver.engine.sampler import Draw, Launched, Sampler
from driver.engine.scheduler import Batch, Scheduler
from driver.engine.draft_model import DraftModel
from driver.engine.speculation import speculator_for
from worker.prompt_scoring import ScoredLogits
from worker.runner import ModelRunner
from worker.stream import Handle


@dataclass
class InFlight:
    """An overlapped step whose sampling is queued but not collected."""

    sampled: list[Request]  # one per sampled logits row, in row order
    launched: list[Handle[Launched]]  # one per forward of the step (a burst runs several)
    weight_version: int
    # a persistent-batch slot -> its row of sampled tokens (-1: none): the next step's input id -(1 + row)
    row_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class Engine:
    def __init__(self, runner: ModelRunner, rc: ResolvedConfig, groups: Groups, seed: int | None,
                 draft: DraftModel | None = None):
        """`draft`: method "draft"'s model (speculation.load_draft)."""
        self.spec, rc = speculator_for(rc, draft, seed)  # speculative decoding (speculation.py), None: off
        self.runner, self.rc, self.groups = runner, rc, groups
        self.blocks = BlockManager(rc.num_blocks, rc.page_size, rc.allow_block_sharing)
        self.scheduler = Scheduler(rc, self.blocks)
        self.sampler = Sampler(seed)
        self.step_no = self.weight_version = self.num_tokens_generated = 0
        self.num_burst_forwards = 0  # forwards run by bursts beyond their plan's first (multi-step decode)
        self.num_prompt_tokens = 0  # prompt tokens whose K/V steps computed (recomputations too): prefill work
        self.rank_states = None  # every rank's state row, as of the last plan that gathered them (cluster.plan.S)
        self.gathered_at = 0.0  # when (time.monotonic) the last plan gathered them
        self.in_flight: InFlight | None = None  # overlapped: the step launched last, not collected yet

    def has_work(self) -> bool:
        return self.in_flight is not None or self.scheduler.has_work()

    def end(self, req: Request, status: RequestStatus, error: str | None = None, code: str | None = None,
            reason: str | None = None) -> None:
        """Finish, fail or cancel a request: its pages are freed at once (a step in flight writes them before any
        later step can, in device order). `code`: cluster.errors.Code; `reason`: by default FINISH_REASONS[status]."""
        self.scheduler.finish(req)
        req.status, req.finish_reason = status, reason or FINISH_REASONS[status]
        req.error, req.error_code, req.end_time = error, code, time.perf_counter()

    def send(self, command: Command, data: bytes = b"") -> None:
        """Broadcast a plan that runs no forward (after `flush`); every worker's loop receives it."""
        if self.in_flight is not None:
            raise RuntimeError(f"a {command.name} plan while step {self.step_no - 1} is in flight: flush first")
        plan = StepPlan(command=command, step=self.step_no, weight_version=self.weight_version, data=data)
        self._send(plan)

    def _send(self, plan: StepPlan) -> None:
        """Broadcast a plan; a STEP plan gathers the workers' state rows only when ours are STATE_PERIOD_S old."""
        now = time.monotonic()
        plan.gather = plan.command != Command.STEP or now - self.gathered_at >= STATE_PERIOD_S
        states = send_plan(plan, self.groups)
        if states is not None:
            self.rank_states, self.gathered_at = states, now

    def gather_states_next(self) -> None:
        """The next plan gathers the workers' state rows (a session starts: their callers may read results now)."""
        self.gathered_at = 0.0

    def workers_want_results(self) -> bool:
        return self.rank_states is not None and bool(self.rank_states[1:, S.WANTS_RESULTS].any())

    def flush(self) -> list[Request]:
        """Collect the step in flight, if any; returns the requests that got a token or ended, each once."""
        f, self.in_flight = self.in_flight, None
        if f is None:
            return []
        if len(f.launched) > 1:  # a burst: every row's tokens at once, unless some row failed
            drawn = self.sampler.collect_burst([h.value() for h in f.launched])
            if drawn is not None:
                return self._apply_burst(f.sampled, *drawn, f.weight_version)
        events = []
        for launched in f.launched:
            events += self._collect(f.sampled, launched.value(), f.weight_version, pending=True)
        return list(dict.fromkeys(events)) if len(f.launched) > 1 else events

    def step(self, data: bytes = b"") -> list[Request]:
        """Run one step; returns the requests that got a token or ended (overlapped: in the step it collected).
        `data` (outputs owed to the workers) rides with the plan, or with a PUBLISH plan when nothing can run."""
        # proposals need every earlier token on the host: a running request that may speculate collects first
        events = self.flush() if self.spec and self.in_flight and self.spec.wants_host_tokens(
            self.scheduler.running) else []
        batch, failed = self.scheduler.schedule()
        events += failed
        for req in failed:  # validation refuses these at add time; a request built by hand can still get here
            need = self.blocks.blocks_for(req.num_computed + 1)
            self.end(req, RequestStatus.FAILED, f"request {req.request_id} needs {need} or more KV pages of "
                     f"{self.rc.page_size} tokens; the cache holds {self.rc.num_blocks}", Code.EXCEEDS_KV_CACHE)
        if not batch:
            events += self.flush()
            if data:
                self.send(Command.PUBLISH, data)
            return events
        rows = self.scheduler.batch
        drafts = self.spec.draft(batch.reqs, batch.num_tokens, rows, self.blocks, self.rc.max_batch_tokens - sum(
            batch.num_tokens), self.scheduler.keep_free) if self.spec else {}
        batch = decode_first(batch)
        burst = self.scheduler.burst_length(batch) if self.rc.overlap else 1  # allocates its pages: before _plan
        plan, slots = self._plan(batch, drafts)
        plan.data = data
        plan.swap_out, plan.swap_in = self.scheduler.host.take()
        plan.page_copies = self.scheduler.forks.take()
        sampling = (plan.sample & SAMPLE_LAST).astype(bool)
        sampled = batch.reqs if sampling.all() else [r for r, m in zip(batch.reqs, sampling.tolist()) if m]
        sampled_slots = slots[sampling]
        # a step that scores positions (prompt logprobs: prompt_scores.py; speculative verify rows) runs in series
        # with its logits gathered; its rows never burst (a scored row does not sample unless its query holds prompt
        # positions, or speculates: not a plain one-token decode)
        scoring = (plan.sample & (SCORE_ALL | SCORE_PROMPT)).astype(bool)
        plan.share_tokens = self.rc.overlap and bool(sampled) and not scoring.any()
        plan.burst = burst  # > 1 only when every row samples (so share_tokens is set)
        plan.argmax_on_shards = bool(sampled) and bool(rows.plain[sampled_slots].all()) and not scoring.any()
        self.num_burst_forwards += burst - 1
        self._send(plan)
        logits = self.runner.launch(plan)
        if self.spec is not None and self.spec.model is not None:  # the draft's cache follows every target step
            self.spec.model.mirror(plan)
        rows.computed[slots] += plan.q_lens + (plan.burst - 1)
        self.num_prompt_tokens += int(np.maximum(0, np.minimum(plan.kv_lens, rows.prompt_len[slots])
                                                 - (plan.kv_lens - plan.q_lens)).sum())
        self.scheduler.fork_ready()  # n samples: children start from the prompt K/V this plan computes
        if not plan.share_tokens:  # in series: every token so far is on the host after this step
            events += self.flush()
            self._register(batch.reqs, slots)
            out = logits.value()
            if isinstance(out, ScoredLogits):  # prompt logprobs, scored on the vocabulary shards
                out = record_scores(out, plan, batch.reqs)
            if drafts:  # after the sampled rows' logits, every position of the speculating (SCORE_ALL) rows
                spec_reqs = [r for r in batch.reqs if r in drafts]
                out, spec_logits = out[:len(sampled)], out[len(sampled):]
            launched = self.sampler.launch(out, *self.sampler.rows(sampled))
            events += self._collect(sampled, launched, self.weight_version)
            if drafts:
                events += self._apply_verified(spec_reqs, self.spec.verify(spec_logits, spec_reqs, drafts))
            self.step_no += 1
            return events
        rows.pending[sampled_slots] += plan.burst
        if not rows.history[sampled_slots].any():
            # no row reads its tokens so far: queue this step's sampling (and a burst's every forward) first, then
            # wait for the step in flight, so the device never waits for that wait
            ahead = (rows.pending[sampled_slots] - plan.burst).tolist()
            launched = self._queue_sampling(logits, self.sampler.rows(sampled, ahead))
            events += self.flush()
        else:
            events += self.flush()  # the previous step: now every token this step ran is on the host
            launched = self._queue_sampling(logits, self.sampler.rows([None if r.is_finished else r for r in sampled]))
        self._register(batch.reqs, slots)
        row_of = np.full(len(rows.reqs), -1, np.int64)
        row_of[sampled_slots] = np.arange(len(sampled))
        self.in_flight = InFlight(sampled, launched, self.weight_version, row_of)
        self.step_no += 1
        return events

    def _queue_sampling(self, logits: Handle, host_rows: tuple) -> list[Handle[Launched]]:
        """Queue each forward's sampling and token broadcast behind the plan (ModelRunner.share_burst)."""
        launched: list[Handle[Launched]] = []

        def sample(i: int, forward: Handle) -> Callable[[], torch.Tensor]:
            """Queue the sampling of the burst's forward i (token index + i); give its tokens, in stream order."""
            h = self.runner.stream.submit(lambda: self.sampler.launch(forward.in_order(), *host_rows, offset=i))
            launched.append(h)
            return lambda: h.in_order().tokens

        self.runner.share_burst(logits, sample)
        return launched

    def _register(self, reqs: list[Request], slots: np.ndarray) -> None:
        """Make the batch's newly full blocks findable, as far as their tokens are on the host."""
        if not self.blocks.allow_sharing:
            return
        rows = self.scheduler.batch
        known = rows.prompt_len[slots] + np.fromiter(map(len, [r.generated for r in reqs]), np.int64, len(reqs))
        full = np.minimum(rows.computed[slots], known) // self.rc.page_size
        hashed = np.fromiter(map(len, [r.block_hashes for r in reqs]), np.int64, len(reqs))
        for i in np.flatnonzero(full > hashed).tolist():  # the common decode step: no block completed
            if not reqs[i].is_finished:
                self.blocks.register_full_blocks(reqs[i])

    def _collect(self, sampled: list[Request], launched: Launched | list[Draw | None], version: int,
                 pending: bool = False) -> list[Request]:
        """Append each sampled request's token, ending it on EOS or its limits (`_apply`); as arrays when every row
        drew a token and every request has its row (the common step), else one by one."""
        drawn = launched if isinstance(launched, list) else self.sampler.collect_tokens(launched)
        if isinstance(drawn, tuple):
            slots = self.scheduler.batch.slots_of(sampled)
            if slots.min(initial=0) >= 0:
                return self._apply_tokens(sampled, slots, *drawn, version, pending)
        draws = drawn if isinstance(drawn, list) else self.sampler.collect(launched)
        return self._apply(sampled, draws, version, pending)

    def _apply_tokens(self, sampled: list[Request], slots: np.ndarray, tokens: np.ndarray,
                      logprobs: np.ndarray | None, version: int, pending: bool) -> list[Request]:
        """`_apply` as arrays: one token for each row, every request still holding its row (a finished one drops
        its token); only the rows that start, change weight version, ask for logprobs or end are visited."""
        rows, now = self.scheduler.batch, time.perf_counter()
        if pending:
            rows.pending[slots] -= 1
        status = np.fromiter([r.status for r in sampled], np.int64, len(sampled))
        live = np.flatnonzero(status < RequestStatus.FINISHED)
        if len(live) < len(sampled):
            sampled, slots, tokens, status = ([sampled[i] for i in live.tolist()], slots[live], tokens[live],
                                              status[live])
            logprobs = None if logprobs is None else logprobs[live]
        toks = tokens.tolist()
        for req in [sampled[i] for i in np.flatnonzero(rows.version[slots] != version).tolist()]:
            req.note_version(version)
        rows.version[slots] = version
        for gen, tok in zip([r.generated for r in sampled], toks):
            gen.append(tok)
        for i in np.flatnonzero(status != RequestStatus.DECODING).tolist():
            req = sampled[i]
            if req.start_time < 0:
                req.start_time = now
            if req.status != RequestStatus.PENDING:  # PENDING: preempted while its tokens were in flight
                req.status = RequestStatus.DECODING
        for i in np.flatnonzero(rows.extras[slots]).tolist():  # logprobs, timestamps
            req = sampled[i]
            if logprobs is not None and req.return_logprobs:
                req.logprobs.append(float(logprobs[i]))
            if req.record_timestamps:
                req.timestamps.append(now)
        known = rows.prompt_len[slots] + np.fromiter(map(len, [r.generated for r in sampled]), np.int64, len(toks))
        stop = rows.ends_at(slots, tokens)
        for i in np.flatnonzero(stop | (known >= rows.limit[slots])).tolist():
            self.end(sampled[i], RequestStatus.FINISHED, reason="stop" if stop[i] else "length")
        self.num_tokens_generated += len(toks)
        return sampled

    def _apply(self, sampled: list[Request], draws: list[Draw | None], version: int,
               pending: bool = False) -> list[Request]:
        """Append each request's token (ending it on EOS or its limits); a request that ended meanwhile drops it.
        `pending`: the tokens were counted in `num_pending` until now."""
        events, now = [], time.perf_counter()
        for req, draw in zip(sampled, draws):
            if pending:
                req.num_pending -= 1
            if draw is None or req.status >= RequestStatus.FINISHED:  # ended meanwhile: the token is dropped
                continue
            if draw.error is not None:  # this request alone fails; the rest of the batch gets its tokens
                self.end(req, RequestStatus.FAILED, f"request {req.request_id}: sampling failed: {draw.error!r}",
                         Code.SAMPLING_FAILED)
            else:
                self._append(req, [draw.token], None if draw.logprob is None else [draw.logprob], now, version,
                             None if draw.top is None else [draw.top])
            events.append(req)
        return events

    def _apply_burst(self, sampled: list[Request], live: list[int], tokens: list[list[int]],
                     logprobs: list[list[float]] | None, version: int) -> list[Request]:
        """`_apply` for a burst's forwards at once: each live row's tokens (as applying them one forward at a time)."""
        events, now = [], time.perf_counter()
        for req in sampled:
            req.num_pending -= len(tokens[0]) if tokens else 0
        for j, row in enumerate(tokens):
            req = sampled[live[j]]
            if req.status >= RequestStatus.FINISHED:  # ended meanwhile: its tokens are dropped
                continue
            self._append(req, row, logprobs[j] if logprobs is not None and req.return_logprobs else None, now, version)
            events.append(req)
        return events

    def _append(self, req: Request, row: list[int], logprobs: list[float] | None, now: float, version: int,
                top: list | None = None) -> None:
        """Append a live request's new tokens in order (with their logprobs and top tokens when given), cut after the
        first EOS or at its limits, and end it there."""
        done = len(req.generated)
        n = max(1, min(len(row), req.max_new_tokens - done, self.rc.max_model_len - len(req.prompt_ids) - done))
        eos = req.eos_token_ids
        stop = bool(eos) and not eos.isdisjoint(row[:n])
        if stop:
            n = next(i for i, t in enumerate(row) if t in eos) + 1
        if req.start_time < 0:
            req.start_time = now
        req.note_version(version)
        req.generated.extend(row[:n])
        if logprobs is not None:
            req.logprobs.extend(logprobs[:n])
        if top is not None:
            req.top_logprobs.extend(top[:n])
        if req.record_timestamps:
            req.timestamps.extend([now] * n)
        if req.status != RequestStatus.PENDING:  # PENDING: preempted while its tokens were in flight
            req.status = RequestStatus.DECODING
        if stop:
            self.end(req, RequestStatus.FINISHED, reason="stop")
        elif (len(req.generated) >= req.max_new_tokens
              or len(req.prompt_ids) + len(req.generated) >= self.rc.max_model_len):
            self.end(req, RequestStatus.FINISHED, reason="length")
        self.num_tokens_generated += n

    def _apply_verified(self, reqs: list[Request], draws: list[list[Draw]]) -> list[Request]:
        """Append each speculating request's verified tokens through `_append` (cut at EOS and its limits as plain
        decoding cuts; a failed draw fails it after the tokens before it); a live row's computed tokens go back to
        its tokens less one and its pages past them are freed (speculation.py)."""
        now, rows = time.perf_counter(), self.scheduler.batch
        for req, mine in zip(reqs, draws):
            if req.is_finished:  # ended meanwhile (a cancel): its tokens are dropped
                continue
            good = [d for d in mine if d.error is None]
            if good:
                lps = [d.logprob for d in good] if req.return_logprobs else None
                self._append(req, [d.token for d in good], lps, now, self.weight_version,
                             [d.top for d in good] if req.num_top_logprobs else None)
            if len(good) < len(mine) and not req.is_finished:
                self._apply([req], [mine[len(good)]], self.weight_version)
            if not req.is_finished:
                rows.computed[req.slot] = req.num_tokens - 1
                self.blocks.trim(req, req.num_tokens)
        return reqs

    def _plan(self, batch: Batch, drafts: dict | None = None) -> tuple[StepPlan, np.ndarray]:
        """The STEP plan of a batch (decode rows first) and its rows' slots, from the persistent batch's arrays; a
        token still in flight is input id -(1 + its row in the step in flight). A speculating row (`drafts`: its
        request's proposals) runs its last token and its proposals, every position scored (speculation.py)."""
        rows, reqs = self.scheduler.batch, batch.reqs
        slots = rows.slots(reqs)
        q = np.asarray(batch.num_tokens, np.int64)
        start, p, pending = rows.computed[slots], rows.prompt_len[slots], rows.pending[slots]
        gens = [r.generated for r in reqs]
        known = p + np.fromiter(map(len, gens), np.int64, len(reqs))
        stop = start + q
        row_of = self.in_flight.row_of if self.in_flight is not None else np.zeros(0, np.int64)
        if len(row_of) < len(rows.reqs):
            row_of = np.concatenate([row_of, np.full(len(rows.reqs) - len(row_of), -1, np.int64)])
        one = q == 1
        in_flight = one & (pending > 0) & (start == known + pending - 1)  # a one-token decode of its pending token
        on_host = one & ~in_flight & (stop == known) & (start == known - 1) & (start >= p)  # its last token
        ids = np.where(in_flight, -1 - row_of[slots], 0)
        host_rows = np.flatnonzero(on_host).tolist()
        ids[host_rows] = [gens[i][-1] for i in host_rows]
        parts = [ids]
        other = np.flatnonzero(~(in_flight | on_host)).tolist()
        if other:  # prompt chunks (and a rare one-token row of its prompt): their tokens from the host, in order
            parts = []
            for i in range(len(reqs)):
                if in_flight[i] or on_host[i]:
                    parts.append(ids[i:i + 1])
                    continue
                a, b, k = int(start[i]), int(stop[i]), int(known[i])
                chunk = token_slice(reqs[i], a, min(b, k))
                if drafts and reqs[i] in drafts:
                    chunk = chunk + drafts[reqs[i]].tolist()
                elif b > k:  # its pending token (the scheduler runs it alone, as a one-token decode)
                    chunk = chunk + [-1 - int(row_of[slots[i]])]
                parts.append(np.asarray(chunk, np.int64))
        input_ids = np.concatenate(parts).astype(np.int32)
        flags = (stop == known + pending) * SAMPLE_LAST
        scores = rows.scores[slots].any()  # prompt logprobs: these rows' positions are scored (prompt_scores.py)
        if scores:
            flags = flags + scored_rows(rows.scores[slots], start, p) * SCORE_PROMPT
        if drafts:  # speculating rows: every position's logits come back to be verified (speculation.py)
            flags = flags + np.fromiter([r in drafts for r in reqs], bool, len(reqs)) * SCORE_ALL
        plan = StepPlan(command=Command.STEP, step=self.step_no, weight_version=self.weight_version,
                        input_ids=input_ids, q_lens=q.astype(np.int32), kv_lens=stop.astype(np.int32),
                        sample=flags.astype(np.int32), block_tables=rows.table(slots))
        if scores:
            carry_targets(plan, reqs, self.runner.model.lm_head.vocab_size)
        return plan, slots


def decode_first(batch: Batch) -> Batch:
    """The batch with its one-token rows first (the plan's decode group), each group in its order."""
    q = batch.num_tokens
    c = q.count(1)
    if c in (0, len(q)) or q[:c].count(1) == c:
        return batch
    order = sorted(range(len(q)), key=lambda i: q[i] != 1)
    return Batch([batch.reqs[i] for i in order], [q[i] for i in order])
