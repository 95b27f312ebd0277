"""Gemma 2 (gemma2): Gemma 3's pieces (worker/models/gemma3.py: (1 + w) RMSNorms, sandwich norms, embeddings times
sqrt(hidden_size), softmax scale query_pre_attn_scalar ** -0.5, the tanh GELU MLP, tied embeddings, sliding and
full layers as `layer_types` says: every other one by default) without the per-head q/k norms and with one rope for
every layer, and with its attention scores capped, tanh(s / cap) * cap before the mask and the softmax, where
`attn_logit_softcapping` is set (worker/attention.py `ScoreTerms`; every attention path applies it), as well as
its logits where `final_logit_softcapping` is (worker/models/decoder.py)."""

from __future__ import annotations

from typing import Any

from worker.models.gemma3 import Gemma3


class Gemma2(Gemma3):
    model_types = ("gemma2",)
    qk_norm = False

    def score_softcap(self, config: Any) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)
