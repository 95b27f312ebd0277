"""A rank's vote on a step every rank must take alike (weight updates, trainer groups, memory calls): explicit flags
plus each refusing rank's reason as JSON text (plain data, never pickled), gathered on the control group."""

from __future__ import annotations

import json
from typing import Any

from cluster.dist import Groups, agree_all_ok, agree_messages
from cluster.errors import Code, WeightRefused

VOTE_TEXT_CHARS = 600  # a vote's text is cut to this, so its JSON fits agree_messages' bytes


def vote_of(e: BaseException) -> str:
    """An exception as this rank's vote against: JSON of {text, code, tensor, phase} (plain data, never empty)."""
    fields = {"text": described(e)[:VOTE_TEXT_CHARS], "code": Code.WEIGHT_UPDATE_FAILED, "tensor": None, "phase": None}
    if isinstance(e, WeightRefused):
        fields |= {"code": e.code, "tensor": e.tensor and e.tensor[:200], "phase": e.phase}
    return json.dumps(fields)


def read_vote(text: str) -> dict[str, Any]:
    try:
        vote = json.loads(text)
    except ValueError:  # cut short: keep what it says
        vote = None
    return vote if isinstance(vote, dict) else {"text": text, "code": Code.WEIGHT_UPDATE_FAILED}


def refusals(ok: bool, vote: str, groups: Groups) -> list[tuple[int, dict[str, Any]]]:
    """(rank, vote) of every rank that votes against: an explicit flag per rank, plus its vote (`vote_of`). Every
    rank of the control group calls it (two collectives). A rank that votes against with no text still votes
    against."""
    flags = agree_all_ok(ok, groups)
    texts = agree_messages("" if ok else (vote or vote_of(ValueError())), groups)
    return [(rank, read_vote(text)) for rank, (flag, text) in enumerate(zip(flags, texts)) if not flag]


def refused_result(refused: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The result of a refused update: every refusing rank's text, and the first one's rank, code, tensor, phase."""
    first, vote = refused[0]
    return {"ok": False, "error": "; ".join(f"rank {r}: {v.get('text', '')}" for r, v in refused), "rank": first,
            "reason_code": vote.get("code") or Code.WEIGHT_UPDATE_FAILED, "tensor": vote.get("tensor"),
            "phase": vote.get("phase")}


def described(e: BaseException) -> str:
    """An exception as vote text; never empty, even when its message is."""
    text = str(e)
    if isinstance(e, ValueError) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else f"{type(e).__name__} (no message)"
