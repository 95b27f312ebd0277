"""n samples of one prompt (transformers' `num_return_sequences`, OpenAI's `n`): how the samples are named and
ordered, the same on the manager API, the wire and HTTP. The request keeps its id; its other n - 1 samples are its
children `<id>__child#<i>`, i = 0 .. n - 2, as transformers' continuous batching names them, and the samples come in
transformers' `generate_batch` order: the children in turn, then the request itself. Torch-free."""

from __future__ import annotations

CHILD_MARK = "__child#"
MAX_SAMPLES = 128  # the most samples one request may ask for (OpenAI's limit on `n`)


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}{CHILD_MARK}{index}"


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n samples, in order: its children, then itself."""
    return [child_id(request_id, i) for i in range(n - 1)] + [request_id]


def sample_order(request_id: str) -> tuple[str, int, int]:
    """A key that sorts outputs by request, and within one request's samples in `sample_ids` order."""
    base, mark, index = request_id.rpartition(CHILD_MARK)
    if mark and index.isdigit():
        return base, 0, int(index)
    return request_id, 1, 0
