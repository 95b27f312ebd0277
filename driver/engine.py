"""Rank 0's step: schedule -> StepPlan -> broadcast -> forward -> sample -> update requests.

The engine is single-threaded: only the manager's loop thread calls it, and only it talks on the control
group, so every rank sees the same sequence of plans.
"""

from __future__ import annotations

import time

import numpy as np

from cluster.config import ResolvedConfig
from cluster.dist import Groups, send_plan
from cluster.errors import Code
from cluster.outputs import RequestStatus
from cluster.plan import Command, S, StepPlan
from driver.block_manager import BlockManager
from driver.request import Request
from driver.sampler import Sampler
from driver.scheduler import Scheduled, Scheduler
from worker.runner import ModelRunner


class Engine:
    def __init__(self, runner: ModelRunner, rc: ResolvedConfig, groups: Groups, seed: int | None):
        self.runner = runner
        self.rc = rc
        self.groups = groups
        self.blocks = BlockManager(rc.num_blocks, rc.page_size, rc.allow_block_sharing)
        self.scheduler = Scheduler(rc, self.blocks)
        self.sampler = Sampler(seed)
        self.step_no = 0
        self.weight_version = 0
        self.num_tokens_generated = 0
        self.rank_states = None  # every rank's state row, as of the last plan (see cluster.plan.S)

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def end(self, req: Request, status: RequestStatus, error: str | None = None, code: str | None = None) -> None:
        """Finish, fail or cancel a request: its pages are freed at once. `code` (cluster.errors.Code) says why
        it failed."""
        self.scheduler.finish(req)
        req.status = status
        req.error = error
        req.error_code = code
        req.end_time = time.perf_counter()

    def send(self, command: Command, data: bytes = b"") -> None:
        """Broadcast a plan that runs no forward. The driver calls it; the workers' loops receive it."""
        self.rank_states = send_plan(StepPlan(command=command, step=self.step_no,
                                              weight_version=self.weight_version, data=data), self.groups)

    def workers_want_results(self) -> bool:
        s = self.rank_states
        return s is not None and bool(s[1:, S.WANTS_RESULTS].any())

    def step(self, data: bytes = b"") -> list[Request]:
        """Run one step; returns the requests that got a token or ended during it. `data` (outputs owed to the
        workers) rides along with the plan, or with a PUBLISH plan when nothing can run."""
        batch, impossible = self.scheduler.schedule()
        events = []
        for req in impossible:  # validation refuses these at add time; a request built by hand can still get here
            self.end(req, RequestStatus.FAILED,
                     f"request {req.request_id} needs {self.blocks.blocks_for(req.num_computed + 1)} or more KV "
                     f"pages of {self.rc.page_size} tokens; the cache holds {self.rc.num_blocks}",
                     Code.EXCEEDS_KV_CACHE)
            events.append(req)
        if not batch:
            if data:
                self.send(Command.PUBLISH, data)
            return events
        batch.sort(key=lambda s: s.num_tokens != 1)  # the decode group goes first
        plan = self._plan(batch)
        plan.data = data
        plan.swap_out, plan.swap_in = self.scheduler.take_swaps()
        self.rank_states = send_plan(plan, self.groups)
        logits = self.runner.execute(plan)
        sampled = [s.req for s in batch if s.samples]
        for s in batch:
            s.req.num_computed += s.num_tokens
            self.blocks.register_full_blocks(s.req)
        draws = self.sampler(logits, sampled)
        now = time.perf_counter()
        for req, draw in zip(sampled, draws):
            if draw.error is not None:  # this request alone fails; the rest of the batch gets its tokens
                self.end(req, RequestStatus.FAILED, f"request {req.request_id}: sampling failed: {draw.error!r}",
                         Code.SAMPLING_FAILED)
                events.append(req)
                continue
            tok = draw.token
            if req.start_time < 0:
                req.start_time = now
            req.note_version(self.weight_version)
            req.generated.append(tok)
            if draw.logprob is not None:
                req.logprobs.append(draw.logprob)
            if req.record_timestamps:
                req.timestamps.append(now)
            req.status = RequestStatus.DECODING
            if (tok in req.eos_token_ids or len(req.generated) >= req.max_new_tokens
                    or req.num_tokens >= self.rc.max_model_len):
                self.end(req, RequestStatus.FINISHED)
            events.append(req)
            self.num_tokens_generated += 1
        self.step_no += 1
        return events

    def _plan(self, batch: list[Scheduled]) -> StepPlan:
        ids: list[int] = []
        for s in batch:
            r = s.req
            start, stop = r.num_computed, r.num_computed + s.num_tokens
            p = len(r.prompt_ids)
            if start >= p:
                ids.extend(r.generated[start - p:stop - p])
            else:
                ids.extend((r.prompt_ids + r.generated[:max(0, stop - p)])[start:stop])
        width = max(len(s.req.block_ids) for s in batch)
        tables = np.zeros((len(batch), width), np.int32)
        for i, s in enumerate(batch):
            tables[i, :len(s.req.block_ids)] = s.req.block_ids
        return StepPlan(
            command=Command.STEP, step=self.step_no, weight_version=self.weight_version,
            input_ids=np.asarray(ids, np.int32),
            q_lens=np.asarray([s.num_tokens for s in batch], np.int32),
            kv_lens=np.asarray([s.req.num_computed + s.num_tokens for s in batch], np.int32),
            sample=np.asarray([s.samples for s in batch], np.int32), block_tables=tables)
