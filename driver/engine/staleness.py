"""Staleness bounded by the engine (docs/weights.md, "Staleness").

A request's `max_weight_lag` is how many weight versions its tokens (and the KV they read) may span: at an update
to version v, a request whose oldest token (or KV it keeps) comes from a version older than v - max_weight_lag
either ends with its partial output and finish_reason "stale" (`stale_policy` "end") or starts over from its prompt
under the new weights ("restart"). Rank 0 decides, right after every rank applied the update and before any later
plan: an ended request is never scheduled again and a restarted one is prefilled like a new one, so the other ranks
see it only through the plans, as any other request (workers hold no request state)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.config import STALE_POLICIES
from cluster.errors import Code, RequestRejected
from cluster.outputs import RequestStatus
from driver.engine.request import Request

if TYPE_CHECKING:
    from driver.engine.engine import Engine
    from driver.engine.scheduler import Scheduler


def bound_staleness(req: Request, max_weight_lag: Any, stale_policy: Any, config: Any) -> Request:
    """Give a built request its staleness bound: its own, else the preset's (`config`, a ContinuousBatchingConfig).
    RequestRejected (bad_field) for a value that cannot work, naming it."""
    lag = config.max_weight_lag if max_weight_lag is None else max_weight_lag
    policy = config.stale_policy if stale_policy is None else stale_policy
    rid = req.request_id
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
        raise RequestRejected(f"request {rid}: max_weight_lag={lag!r}; it must be a non-negative integer",
                              Code.BAD_FIELD, rid)
    if policy not in STALE_POLICIES:
        raise RequestRejected(f"request {rid}: stale_policy={policy!r}; it must be one of {STALE_POLICIES}",
                              Code.BAD_FIELD, rid)
    req.max_weight_lag, req.stale_policy = lag, policy
    settle_policy(req, explicit=stale_policy is not None)
    return req


def settle_policy(req: Request, explicit: bool) -> None:
    """A request whose tokens stream never restarts (streamed tokens are never taken back): refused (bad_field) when
    it asked for "restart" itself, else it ends instead. Call again when the request comes to stream later."""
    if req.stale_policy == "restart" and req.streaming:
        if explicit:
            raise RequestRejected(f"request {req.request_id}: stale_policy='restart' cannot apply to a request whose "
                                  "tokens stream (or that has stop strings): streamed tokens are never taken back",
                                  Code.BAD_FIELD, req.request_id)
        req.stale_policy = "end"


def oldest_version(req: Request, kept_kv_version: int | None) -> int | None:
    """The oldest weight version the request depends on: its first token's (resumed ones first), else
    `kept_kv_version` (the version of KV it keeps through the update; None: it keeps none)."""
    resumed = getattr(req, "resume_versions", None) if req.resumed_tokens else None
    if resumed:
        return resumed[0][1]
    if req.weight_versions:
        return req.weight_versions[0][1]
    return kept_kv_version


def enforce_weight_lag(engine: Engine, kv_policy: str) -> list[Request]:
    """Right after an update to `engine.weight_version` (the driver, no step in flight): end or restart every request
    the scheduler holds that would now span more than its max_weight_lag versions. Returns the ended ones (to emit)."""
    new, sched = engine.weight_version, engine.scheduler
    ended: list[Request] = []
    for req in [*sched.running, *sched.waiting]:
        if req.max_weight_lag is None:
            continue
        keeps_kv = kv_policy == "keep" and (bool(req.block_ids) or sched.host.holds(req))
        first = oldest_version(req, new - 1 if keeps_kv else None)
        if first is None or new - first <= req.max_weight_lag:
            continue
        if req.stale_policy == "restart" and not req.resumed_tokens:  # a resumed request's tokens were delivered
            restart(sched, req)
        else:
            engine.end(req, RequestStatus.FINISHED, reason="stale")
            ended.append(req)
    return ended


def restart(sched: Scheduler, req: Request) -> None:
    """Start a request over from its prompt, first in line at its priority: its tokens (with their logprobs,
    timestamps, versions and pause notes), its KV and its sampling state go; it counts the restart."""
    sched.finish(req)  # out of the queues, its pages and host copy freed, its row left
    req.generated, req.logprobs, req.top_logprobs, req.timestamps = [], [], [], []
    req.weight_versions, req.pauses = [], []
    req.history = req.sample_cache = None
    if req.grammar is not None:
        req.grammar.matcher.reset()
        req.grammar.consumed = 0
    req.num_computed = req.num_pending = 0
    req.cacheable, req.status = True, RequestStatus.PENDING
    req.stale_restarts += 1
    sched.batch.join(req)
    sched.waiting.push_front(req)
