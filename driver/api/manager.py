"""The seed's ContinuousBatchingManager, across ranks.

Every rank builds a manager (the constructor agrees on the cache size, a collective) and starts a loop thread: on
the driver it runs the engine and owns the control group; elsewhere it runs the worker loop. User threads never
touch the control group: they leave requests, cancels, pauses and stops in the inbox for the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Callable, Iterable, Iterator

import msgpack
import numpy as np

from cluster.config import ContinuousBatchingConfig
from cluster.dist import agree_all_ok, recv_plan, send_plan
from cluster.errors import Code, ManagerStopped, QueueFull, RequestRejected
from cluster.liveness import Liveness
from cluster.outputs import GenerationOutput, RequestStatus
from cluster.pause import PauseGate, check_pause_mode
from driver.api.driver_loop import DriverLoop, is_collective_error
from driver.api.group_calls import GroupCalls
from driver.api.memory_calls import MemoryCalls
from driver.api.result_router import ResultRouter
from driver.engine.engine import Engine
from driver.engine.request import Request
from driver.engine.speculation import load_draft
from driver.engine.staleness import bound_staleness
from driver.api.serving_metrics import ServingMetrics
from driver.api.update_calls import WeightUpdates
from driver.api.request_group import build_group, group_of, samples_asked
from driver.api.validation import build_request, supported_generation_config
from worker.cpu_threads import release_openmp_pool
from worker.loop import worker_loop
from worker.memory import use_device
from worker.moe_block import routed_tokens
from worker.memory_release import MemoryCall
from worker.packed_linear import weights_changed
from worker.trainer_group import GroupCall
from worker.trainer_groups import TrainerGroups
from worker.weights import UpdateCall

log = logging.getLogger("lockstep")


class ContinuousBatchingManager:
    def __init__(self, model: Any, generation_config: Any, continuous_batching_config: ContinuousBatchingConfig):
        """Every rank calls it (the cache size is agreed over the control group)."""
        self.model = model
        self.config = continuous_batching_config
        self.generation_config = supported_generation_config(generation_config,
                                                             continuous_batching_config.drop_unsupported_processors)
        self.runner, self.effective_config, self.groups = model.build_runner(continuous_batching_config)
        self.is_driver = self.groups.is_driver
        draft = load_draft(self.effective_config, self.runner, self.groups)  # every rank: one agreement
        self.engine = Engine(self.runner, self.effective_config, self.groups, self.config.seed, draft) \
            if self.is_driver else None
        self.results = ResultRouter()
        self.metrics = ServingMetrics()  # fed by the driver's loop (DriverLoop.emit); read by `stats`
        self.gate = PauseGate()
        self.inbox: queue.Queue = queue.Queue()
        self.requests: dict[str, Request] = {}  # live requests by id (driver)
        self.thread: threading.Thread | None = None
        self.stop_event = threading.Event()
        self.hard = self.destroyed = False
        self.held = False  # scheduling held by a client's pause (set by the loop): requests queue, nothing steps
        self.loop_error: BaseException | None = None
        self.failure: str | None = None  # what the loop died of, naming the rank when it can
        self.failure_code: str | None = None  # cluster.errors.Code of that failure (rank_failed, driver_failed)
        self.restart_count = 0  # the launcher's restarts of this group so far (launch/serve.py sets it)
        self.liveness: Liveness | None = None
        self.wants_results = False  # a worker whose caller reads results asks the driver for them
        self.updates = WeightUpdates(self)
        self.memory = MemoryCalls(self)  # release_memory / resume_memory (memory_calls.py)
        self.trainer_groups = TrainerGroups()  # this rank's weight-sync groups the trainer owns (group_calls.py)
        self.group_calls = GroupCalls(self)
        self.loop_beat = time.monotonic()  # when the loop last came round (the front door's deadline reads it)
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()
        self.closed = False  # set (under _lock) once the loop has stopped or died: submit refuses
        if self.effective_config.notes and self.is_driver:
            log.info("lockstep effective config: %s", "; ".join(self.effective_config.notes))

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the loop thread. Every rank calls it."""
        if self.destroyed:
            raise RuntimeError("this manager was destroyed; make a new one")
        if self.is_running():
            return
        self.stop_event.clear()
        self.hard, self.loop_error = False, None
        self.failure = self.failure_code = None
        if self.liveness is None and self.groups.distributed:
            self.liveness = Liveness(self.groups).start()
        with self._lock:
            self.closed = False
        self.thread = threading.Thread(target=self._run_loop, name="lockstep-loop", daemon=True)
        self.groups.control_owner = self.thread  # the loop's from here on, before it even runs
        if self.groups.device.type == "cpu":  # the loop thread runs the forwards: this thread's OpenMP pool goes
            release_openmp_pool()
        weights_changed()  # written in place between sessions (named_shards views): decode's packed copies are stale
        if self.is_driver:  # a reused manager's rows are the last session's: a worker may read results from the first
            self.engine.gather_states_next()
        self.thread.start()

    def is_running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def loop_answers(self, deadline_s: float) -> bool:
        """The loop runs, has not closed the door (a failing loop closes it before it ends its requests, so a
        resubmit never lands on a loop that is going down), and came round within `deadline_s` or a pause parks
        it (a pause may last any time)."""
        return (self.is_running() and not self.closed
                and (self.gate.parked or time.monotonic() - self.loop_beat < deadline_s))

    def warmup(self) -> None:
        """One padded step on the scratch block (first-request costs paid now). Every rank calls it, before `start`."""
        if self.is_running():
            return
        plan = self.runner.warmup_plan()
        if self.is_driver:
            send_plan(plan, self.groups)
        elif self.groups.distributed:
            plan = recv_plan(self.groups, np.zeros(0, np.int64))
        self.runner.execute(plan)

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Flush what is queued and stop (hard_stop: fail it). Every rank calls it; the driver decides."""
        self.hard = hard_stop
        self.held = False
        self.stop_event.set()
        self.inbox.put(None)  # wake the loop
        if block:
            self.join(timeout=timeout)
        if keep_for_next_session:
            self.model.persistent_manager = self

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def destroy(self) -> None:
        """Stop, free the process groups this model made, and hand the runner back to the model for the next manager
        of an equal config (after a clean stop; the ranks agree on reuse when it is taken). Idempotent."""
        if self.destroyed:
            return
        if self.is_running():
            self.stop(block=True, timeout=60)
        self.destroyed = True
        if (self.runner is not None and self.loop_error is None and self.failure is None and not self.is_running()
                and not self.memory.released):
            self.model.keep_idle(self.config, self.runner, self.effective_config)
        if getattr(self.model, "persistent_manager", None) is self:
            self.model.persistent_manager = None
        if self.liveness is not None:
            self.liveness.stop()
        if self.groups is not self.model.groups:
            self.groups.destroy()
        self.runner = None
        self.engine = None

    def switch_to_cb_friendly_attn(self, model: Any = None, auto_switch_to_flash: bool = True) -> str:
        """Lockstep's attention is always paged; reports which kernel serves it."""
        return self.effective_config.attention  # "flash_attn", "triton_paged" or "paged_sdpa"

    def stats(self) -> dict[str, Any]:
        """Counters of the driver's engine (empty elsewhere)."""
        e = self.engine
        if e is None:
            return {}
        return {"step": e.step_no, "weight_version": e.weight_version, "tokens_generated": e.num_tokens_generated,
                "preemptions": e.scheduler.num_preemptions, "prefix_hit_blocks": e.blocks.prefix_hit_blocks,
                "burst_forwards": e.num_burst_forwards, "running": len(e.scheduler.running), "waiting":
                len(e.scheduler.waiting), "free_blocks": e.blocks.num_free, "num_blocks": e.blocks.num_blocks,
                "num_host_blocks": e.scheduler.host.num_slots, **e.scheduler.offload_stats(),
                "prompt_tokens_computed": e.num_prompt_tokens, **asdict(e.scheduler.forks.stats),
                "cuda_graphs": dict(self.runner.graph_stats), "attention": self.effective_config.attention,
                "model_impl": self.runner.model.impl, **self.routing_stats(),
                **(e.spec.stats.as_dict() | {"spec_method": e.spec.config.method} if e.spec else {})}

    def routing_stats(self) -> dict[str, Any]:
        """A MoE model's `experts_routed`: MoE layer -> real tokens routed to each expert since the model was
        loaded (worker/moe_block.py, `routed_tokens`; rank 0's counts are the cluster's, routing being replicated)."""
        routed = routed_tokens(self.runner.model)
        return {"experts_routed": routed} if routed else {}

    # ---------------------------------------------------------------- requests (driver)
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False,
                    eos_token_id: int | list[int] | None = None, priority: int = 0, top_logprobs: int = 0,
                    max_weight_lag: int | None = None, stale_policy: str | None = None,
                    prompt_logprobs: int | None = None, logprobs_mode: str | None = None, speculative: bool = True,
                    **logit_processor_kwargs: Any) -> str | None:
        """Queue a request; its id on the driver, None on other ranks (a no-op there). `priority`: lower numbers are
        scheduled first (vLLM's meaning; FCFS within one; docs/architecture.md, "Fair scheduling"). `top_logprobs`
        (1..20): each output's `top_logprobs` holds every token's most probable (token, logprob) pairs.
        `max_weight_lag`, `stale_policy`: its staleness bound (None: the config's; docs/weights.md, "Staleness").
        `prompt_logprobs` (vLLM's; 0..20): each output's `prompt_logprobs` and `prompt_top_logprobs`.
        `logprobs_mode` (vLLM's; None: the config's): what its logprobs report (driver/engine/logprobs_mode.py).
        `speculative=False`: it never speculates, even when the config's `speculative` is set (docs/speculative.md)."""
        if not self.is_driver:
            return None
        return self.submit(self.build_request(input_ids, request_id, max_new_tokens, streaming, record_timestamps,
                                              eos_token_id, priority=priority, top_logprobs=top_logprobs,
                                              max_weight_lag=max_weight_lag, stale_policy=stale_policy,
                                              prompt_logprobs=prompt_logprobs, logprobs_mode=logprobs_mode,
                                              speculative=speculative, **logit_processor_kwargs))

    def build_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                      streaming: bool = False, record_timestamps: bool = False,
                      eos_token_id: int | list[int] | None = None, *, strict_processors: bool = False,
                      resume_tokens: list[int] | None = None, resume_versions: list[tuple[int, int]] | None = None,
                      resumes: int = 0, priority: int = 0, top_logprobs: int = 0, max_weight_lag: int | None = None,
                      stale_policy: str | None = None, num_return_sequences: int | None = None,
                      prompt_logprobs: int | None = None, logprobs_mode: str | None = None, speculative: bool = True,
                      **logit_processor_kwargs: Any) -> Request:
        """A validated request, not yet queued (RequestRejected, with its code, if it cannot be served).
        `strict_processors`: refuse per-request sampling parameters this manager would ignore (the wire).
        `resume_tokens`, `resume_versions`, `resumes`: an earlier run's delivered tokens (docs/recovery.md).
        `num_return_sequences` (else the generation config's): n samples, its n - 1 children forked after its
        prefill (request_group.py); each sample bounded by `max_weight_lag` / `stale_policy` (staleness.py)."""
        rid = f"req_{next(self._ids)}" if request_id is None else request_id
        n = samples_asked(self.generation_config, num_return_sequences, rid)
        if n > 1 and prompt_logprobs is not None:
            raise RequestRejected(f"request {rid}: prompt_logprobs with n={n} samples is not supported (the samples "
                                  f"share one prefill: ask once with n=1)", Code.UNSUPPORTED, rid)
        return build_group(rid, n, lambda i: bound_staleness(build_request(
            self, input_ids, i, max_new_tokens, streaming, record_timestamps, eos_token_id, logit_processor_kwargs,
            strict_processors=strict_processors, resume_tokens=resume_tokens, resume_versions=resume_versions,
            resumes=resumes, priority=priority, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
            logprobs_mode=logprobs_mode, speculative=speculative),
            max_weight_lag, stale_policy, self.config))

    def submit(self, req: Request, sink: Callable[[GenerationOutput], None] | None = None) -> str:
        """Queue a built request (driver only); `sink` receives its outputs on the loop thread (else the result
        router). Raises RequestRejected (duplicate id), QueueFull or ManagerStopped; never queues what no loop runs."""
        rid = req.request_id
        req.sink = sink
        with self._lock:  # the inbox put is under the lock too, so a cancel can never overtake its add
            if self.closed:
                raise ManagerStopped(f"request {rid}: the manager is stopped"  # a failure's code: clients resume
                                     + (f" ({self.failure})" if self.failure else ""), self.failure_code, rid)
            group = group_of(req)  # n samples: its children are registered with it
            if any(r.request_id in self.requests for r in group):
                raise RequestRejected(f"request {rid}: a request with this id (or one of its samples') is already "
                                      f"in flight", Code.DUPLICATE_REQUEST_ID, rid)
            limit = self.config.max_queue_size  # the live requests are scanned only under a limit (each submit's
            # scan made a big generate_batch's feeding quadratic in its requests)
            if limit and sum(1 for r in self.requests.values() if r.status == RequestStatus.PENDING) >= limit:
                raise QueueFull(f"request {rid}: the queue is full (max_queue_size={limit})",
                                request_id=rid)
            self.requests.update((r.request_id, r) for r in group if not r.is_finished)
            self.inbox.put(("add", req))
        return rid

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs: Any) -> list[str] | None:
        ids = [self.add_request(x, max_new_tokens=max_new_tokens, streaming=streaming,
                                record_timestamps=record_timestamps, **logit_processor_kwargs) for x in inputs]
        return ids if self.is_driver else None

    def cancel_request(self, request_id: str, finish_reason: str | None = None) -> None:
        """End a request (CANCELLED); `finish_reason` says why when not "cancelled" (a stop string: "stop")."""
        if self.is_driver:
            self.inbox.put(("cancel", (request_id, finish_reason)))

    # ---------------------------------------------------------------- results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of `request_id` if given), or None after `timeout`; a worker rank asks for results now."""
        self.wants_results = True
        return self.results.get(request_id, timeout)

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Every output of one request until its final one (blocking)."""
        self.wants_results = True
        while True:
            out = self.results.get(request_id, timeout=1.0)
            if out is None:
                if not self.is_running() and request_id not in self.requests:
                    return
                continue
            yield out
            if out.is_finished():
                return

    def register_result_handler(self, request_id: str, callback: Callable) -> None:
        """Deliver this request's outputs to `callback` on the caller's asyncio loop; removed when it ends."""
        self.wants_results = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = asyncio.get_event_loop()
        self.results.register(request_id, callback, loop)

    # ---------------------------------------------------------------- pause
    @contextmanager
    def pause(self, mode: str = "keep") -> Iterator[None]:
        """Park every rank's loop at one step boundary; every rank must enter it. `mode` (the driver's rules): what
        happens first to in-flight requests, "keep", "abort", "wait" or "retract" (docs/weights.md, "Pause modes")."""
        check_pause_mode(mode)
        if self.is_driver:
            self.inbox.put(None)
        with self.gate.hold(self.is_running, mode):
            yield

    # ---------------------------------------------------------------- weight updates
    def update_weights(self, source: Any, kv_policy: str = "keep", timeout: float | None = None,
                       partial: bool = False) -> dict[str, Any]:
        """Swap the weights at one step boundary on every rank, all or none (update_calls.py); `partial`: `source`
        holds a subset of the model's tensors, the others stay. Every rank calls it."""
        return self.updates.update_weights(source, kv_policy, timeout, partial)

    def update_weights_async(self, call: UpdateCall, done: Callable[[dict], None]) -> None:
        """The front door's path (driver only): `done(result)` is called from the loop thread."""
        self.updates.update_weights_async(call, done)

    # ---------------------------------------------------------------- memory between rollouts (memory_calls.py)
    def release_memory(self, tags: Iterable[str] = ("kv_cache", "weights"), keep_weights_on_host: bool = True,
                       timeout: float | None = None) -> dict[str, Any] | None:
        """Free the tagged device memory on every rank of a paused engine; figures per rank. Every rank calls it
        inside `pause()`; outside, only the driver's call acts (scheduling must be held)."""
        return self.memory.call("release", tags, keep_weights_on_host, timeout)

    def resume_memory(self, tags: Iterable[str] = ("kv_cache", "weights"),
                      timeout: float | None = None) -> dict[str, Any] | None:
        """Take the tagged memory back on every rank (weights from their host copy or the update since); as above."""
        return self.memory.call("resume", tags, timeout=timeout)

    def hold_scheduling(self, hold: bool, mode: str = "keep", done: Callable[[bool], None] | None = None) -> None:
        """Stop (or restart) stepping without parking the ranks: the serving pause. New requests queue; workers keep
        receiving heartbeats, so a hold may last any time. `mode` acts on in-flight requests first (as `pause`);
        `done(True)` from the loop thread once the hold is in force (False: a resume or pause came first)."""
        self.inbox.put(("hold", (check_pause_mode(mode), done) if hold else None))

    def barrier(self) -> None:
        """All ranks meet (the pause's two barriers). Every rank's loop thread calls it."""
        agree_all_ok(True, self.groups)

    # ---------------------------------------------------------------- the loop thread
    def _run_loop(self) -> None:
        """The loop thread; whatever ends it, waiting callers are woken and new requests are refused."""
        try:
            use_device(self.groups.device)  # the current CUDA device is per thread
            with self.groups.owned_by_this_thread():
                if self.is_driver:
                    DriverLoop(self).run()
                else:
                    run_worker_side(self)
        finally:
            with self._lock:
                self.closed = True
            self.updates.loop_ended()
            self.memory.calls.loop_ended()
            self.group_calls.calls.loop_ended()
            self.trainer_groups.close_all()  # no loop drives a bucket or a destroy any more


def run_worker_side(m: ContinuousBatchingManager) -> None:
    """The loop thread of a non-driver rank: execute every plan (worker/loop.py) and act on what plans carry for
    this rank's callers. A loop that dies stops stamping liveness at once, so the driver names this rank; one that
    died of a collective kills the peers that went silent on this host (a hung driver: docs/recovery.md)."""
    try:
        for plan in worker_loop(m.runner, m.groups, m.gate, m.barrier, lambda: m.wants_results, m.liveness):
            data = msgpack.unpackb(plan.data)
            for d in data.get("outputs", []):
                m.results.put(GenerationOutput.from_dict(d))
            if "call" in data:
                m.updates.worker_call(UpdateCall(**data["call"]), plan.weight_version)
            if "memory" in data:
                m.memory.worker_call(MemoryCall(**data["memory"]))
            if "group" in data:
                m.group_calls.worker_call(GroupCall(**data["group"]))
    except BaseException as e:  # never silently: the driver must be able to name this rank
        m.loop_error = e
        m.failure = f"rank {m.groups.rank}: worker loop failed: {type(e).__name__}: {str(e)[:300]}"
        log.exception("lockstep worker loop failed")
        if m.liveness is not None:
            m.liveness.mark_down()
            if is_collective_error(e):  # a hung driver (or peer) is killed, so the launcher restarts the group now
                m.liveness.condemn(m.liveness.silent_ranks())
