"""The submit's `eos_token_id` of a request that names stop tokens of its own (SGLang's and vLLM's `stop_token_ids`,
which stop as well as the model's EOS) or ignores EOS. Torch-free."""

from __future__ import annotations


def eos_ids(model_eos: int | list[int] | None, stop_token_ids: list[int] | None,
            ignore_eos: bool) -> int | list[int] | None:
    """-1 (nothing stops it) with `ignore_eos`; the model's EOS and the stop tokens with `stop_token_ids`; None (the
    server's default: the model's EOS) otherwise."""
    if ignore_eos:
        return -1
    if not stop_token_ids:
        return None
    base = [] if model_eos is None else [model_eos] if isinstance(model_eos, int) else list(model_eos)
    return sorted(set(base) | set(stop_token_ids))
