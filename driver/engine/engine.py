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
from cluster.plan import Command, S, StepPlan
from driver.engine.block_manager import BlockManager, token_slice
from driver.engine.request import Request
from driver.engine.sampler import Draw, Launched, Sampler
from driver.engine.scheduler import Scheduled, Scheduler
from worker.runner import ModelRunner
from worker.stream import Handle


@dataclass
class InFlight:
    """An overlapped step whose sampling is queued but not collected."""

    sampled: list[Request]  # one per sampled logits row, in row order
    launched: list[Handle[Launched]]  # one per forward of the step (a burst runs several)
    weight_version: int
    row_of: dict[int, int] = field(default_factory=dict)  # id(request) -> its row: input id -(1 + row) next step


class Engine:
    def __init__(self, runner: ModelRunner, rc: ResolvedConfig, groups: Groups, seed: int | None):
        self.runner, self.rc, self.groups = runner, rc, groups
        self.blocks = BlockManager(rc.num_blocks, rc.page_size, rc.allow_block_sharing)
        self.scheduler = Scheduler(rc, self.blocks)
        self.sampler = Sampler(seed)
        self.step_no = self.weight_version = self.num_tokens_generated = 0
        self.num_burst_forwards = 0  # forwards run by bursts beyond their plan's first (multi-step decode)
        self.rank_states = None  # every rank's state row, as of the last plan (see cluster.plan.S)
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
        self.rank_states = send_plan(plan, self.groups)

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
            events += self._apply(f.sampled, self.sampler.collect(launched.value()), f.weight_version, pending=True)
        return list(dict.fromkeys(events)) if len(f.launched) > 1 else events

    def step(self, data: bytes = b"") -> list[Request]:
        """Run one step; returns the requests that got a token or ended (overlapped: in the step it collected).
        `data` (outputs owed to the workers) rides with the plan, or with a PUBLISH plan when nothing can run."""
        batch, events = self.scheduler.schedule()
        for req in events:  # validation refuses these at add time; a request built by hand can still get here
            need = self.blocks.blocks_for(req.num_computed + 1)
            self.end(req, RequestStatus.FAILED, f"request {req.request_id} needs {need} or more KV pages of "
                     f"{self.rc.page_size} tokens; the cache holds {self.rc.num_blocks}", Code.EXCEEDS_KV_CACHE)
        if not batch:
            events += self.flush()
            if data:
                self.send(Command.PUBLISH, data)
            return events
        batch.sort(key=lambda s: s.num_tokens != 1)  # the decode group goes first
        burst = self.scheduler.burst_length(batch) if self.rc.overlap else 1  # allocates its pages: before _plan
        plan = self._plan(batch)
        plan.data = data
        plan.swap_out, plan.swap_in = self.scheduler.host.take()
        sampled = [s.req for s, m in zip(batch, plan.sample) if m]
        plan.share_tokens = self.rc.overlap and bool(sampled)
        plan.burst = burst  # > 1 only when every row samples (so share_tokens is set)
        plan.argmax_on_shards = bool(sampled) and all(r.sampling.greedy and not r.return_logprobs for r in sampled)
        self.num_burst_forwards += burst - 1
        self.rank_states = send_plan(plan, self.groups)
        logits = self.runner.launch(plan)
        for s in batch:
            s.req.num_computed += s.num_tokens + plan.burst - 1
        if not plan.share_tokens:  # in series: every token so far is on the host after this step
            events += self.flush()
            self._register(batch)
            events += self._apply(sampled, self.sampler(logits.value(), sampled), self.weight_version)
            self.step_no += 1
            return events
        for req in sampled:
            req.num_pending += plan.burst
        if not any(r.sampling.needs_history for r in sampled):
            # no row reads its tokens so far: queue this step's sampling (and a burst's every forward) first, then
            # wait for the step in flight, so the device never waits for that wait
            ahead = [r.num_pending - plan.burst for r in sampled]
            launched = self._queue_sampling(logits, self.sampler.rows(sampled, ahead))
            events += self.flush()
        else:
            events += self.flush()  # the previous step: now every token this step ran is on the host
            launched = self._queue_sampling(logits, self.sampler.rows([None if r.is_finished else r for r in sampled]))
        self._register(batch)
        self.in_flight = InFlight(sampled, launched, self.weight_version, {id(r): j for j, r in enumerate(sampled)})
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

    def _register(self, batch: list[Scheduled]) -> None:
        """Make the batch's newly full blocks findable, as far as their tokens are on the host."""
        for s in batch:
            if not s.req.is_finished:
                self.blocks.register_full_blocks(s.req)

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
                self._append(req, [draw.token], None if draw.logprob is None else [draw.logprob], now, version)
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

    def _append(self, req: Request, row: list[int], logprobs: list[float] | None, now: float, version: int) -> None:
        """Append a live request's new tokens in order, cut after the first EOS or at its limits, and end it there."""
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

    def _plan(self, batch: list[Scheduled]) -> StepPlan:
        """The STEP plan of a batch; a token still in flight is input id -(1 + its row in the step in flight)."""
        ids: list[int] = []
        row_of = self.in_flight.row_of if self.in_flight is not None else {}
        q_lens, kv_lens, sample = [0] * len(batch), [0] * len(batch), [0] * len(batch)
        width = max(len(s.req.block_ids) for s in batch)
        for i, s in enumerate(batch):  # one pass: at hundreds of sequences a step, every pass costs
            r = s.req
            start, stop = r.num_computed, r.num_computed + s.num_tokens
            p, known = len(r.prompt_ids), len(r.prompt_ids) + len(r.generated)
            if r.num_pending and start == known + r.num_pending - 1:  # a one-token decode of its last pending token
                ids.append(-1 - row_of[id(r)])
            elif stop == known and start == known - 1 and start >= p:  # a one-token decode, on the host
                ids.append(r.generated[start - p])
            else:
                ids.extend(token_slice(r, start, min(stop, known)))
                if stop > known:  # its pending token (the scheduler runs it alone, as a one-token decode)
                    ids.append(-1 - row_of[id(r)])
            q_lens[i], kv_lens[i] = s.num_tokens, stop
            sample[i] = int(stop == known + r.num_pending)
        tables = np.asarray([s.req.block_ids + [0] * (width - len(s.req.block_ids)) for s in batch], np.int32)
        return StepPlan(command=Command.STEP, step=self.step_no, weight_version=self.weight_version,
                        input_ids=np.asarray(ids, np.int32), q_lens=np.asarray(q_lens, np.int32),
                        kv_lens=np.asarray(kv_lens, np.int32), sample=np.asarray(sample, np.int32),
                        block_tables=tables)
