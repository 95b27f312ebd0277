"""Fault injection for the chaos tests. `LOCKSTEP_FAULTS` holds comma-separated rules `point[:key=value...]`, e.g.
`worker_execute:rank=1:step=3`: a point raises `InjectedFault` when every key of a rule equals (as text) the value
passed at the call. Unset (always, outside tests), `hit` only reads and returns."""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    """Raised at a fault point that LOCKSTEP_FAULTS names."""


def _parse(spec: str) -> list[tuple[str, dict[str, str]]]:
    rules = []
    for rule in filter(None, (r.strip() for r in spec.split(","))):
        point, *conds = rule.split(":")
        rules.append((point, dict(c.split("=", 1) for c in conds)))
    return rules


RULES = _parse(os.environ.get("LOCKSTEP_FAULTS", ""))


def hit(point: str, **context: object) -> None:
    """Raise InjectedFault if a rule names `point` and all its conditions match `context`."""
    if not RULES:
        return
    for name, conds in RULES:
        if name == point and all(str(context.get(k)) == v for k, v in conds.items()):
            raise InjectedFault(f"injected fault at {point} {context}")
