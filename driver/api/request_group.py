"""n samples of one prompt on the API side (driver/engine/fork.py runs them): the request and its children are
built alike, each through the same checks, before anything is queued; the children then wait inside their parent
until the engine forks them after its prefill."""

from __future__ import annotations

from typing import Any, Callable

from cluster.errors import Code, RequestRejected
from cluster.samples import MAX_SAMPLES, child_id
from driver.api.option_checks import integer, shown
from driver.engine.request import Request, ResumedRequest


def check_samples(n: Any, request_id: str | None) -> int:
    """How many samples a request asks for: an integer in [1, MAX_SAMPLES], else bad_field."""
    k = integer(n)
    if k is None or not 1 <= k <= MAX_SAMPLES:
        where = f"request {request_id}" if request_id is not None else "generation_config"
        raise RequestRejected(f"{where}: num_return_sequences={shown(n)}; it must be an integer in [1, {MAX_SAMPLES}]",
                              Code.BAD_FIELD, request_id)
    return k


def samples_asked(generation_config: Any, n: Any = None, request_id: str | None = None) -> int:
    """A request's sample count: its own `n` when given, else the generation config's num_return_sequences."""
    if n is not None:
        return check_samples(n, request_id)
    n = getattr(generation_config, "num_return_sequences", None)
    return check_samples(1 if n is None else n, None)


def build_group(request_id: str, n: int, build: Callable[[str], Request]) -> Request:
    """The request `build(request_id)` makes, carrying its n - 1 children (each built by `build` under its child
    id, so each has its own checks, grammar matcher and noise key). A resumed request cannot ask for samples."""
    req = build(request_id)
    if n > 1 and isinstance(req, ResumedRequest):
        raise RequestRejected(f"request {request_id}: a resume continues one sample; resume each sample on its own "
                              f"(num_return_sequences={n})", Code.BAD_FIELD, request_id)
    req.children = [build(child_id(request_id, i)) for i in range(n - 1)]
    for i, child in enumerate(req.children):
        child.child_index = i
    return req


def group_of(req: Request) -> list[Request]:
    """The request and the children it has not forked yet."""
    return [req, *req.children]
