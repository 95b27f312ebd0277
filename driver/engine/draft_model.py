"""The draft-model proposer (docs/speculative.md): a small checkpoint with the target's vocabulary, on rank 0 alone
(TP=1 on the driver's device), proposing greedily.

Its paged cache has as many pages as the target's, of the same size, so the target's block tables address it: a
row's pages hold the draft's K/V of the same tokens in the draft's cache and the target's in the target's. Every
STEP plan the target runs is run on the draft too (`mirror`: prefill chunks, decode and verifying rows, KV page
copies and swaps alike), so the draft's cache holds every computed token of every row; a step's proposals are then
k decode forwards of the speculating rows (`propose`), each reading the token the one before chose. Positions past a
row's context (rejected proposals) are overwritten later, as in the target's cache. The workers never see it: it
changes nothing of the plans, so every lockstep rule holds as for the n-gram proposer. Its plans' input ids are
plain tokens, so the engine runs in series with it (no overlap, no bursts)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cluster.config import ResolvedConfig
from cluster.errors import SpeculativeConfigError
from cluster.plan import SAMPLE_LAST, StepPlan
from worker.layers import Shard
from worker.loader import load_weights
from worker.models import build_model, check_supported
from worker.runner import ModelRunner


class DraftModel:
    """The draft checkpoint's model and its own runner (paged cache, static buffers), on rank 0."""

    def __init__(self, model_dir: str, rc: ResolvedConfig, device: torch.device, dtype: torch.dtype,
                 vocab_size: int):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        if config.vocab_size != vocab_size:
            raise SpeculativeConfigError(f"speculative.model={model_dir!r}: its vocabulary has {config.vocab_size} "
                                         f"tokens, the target's {vocab_size}: a draft shares the target's tokenizer",
                                         "model")
        if getattr(config, "max_position_embeddings", rc.max_model_len) < rc.max_model_len:
            raise SpeculativeConfigError(f"speculative.model={model_dir!r}: its context "
                                         f"({config.max_position_embeddings}) is shorter than the target's "
                                         f"({rc.max_model_len})", "model")
        check_supported(config)
        with torch.device(device):
            model = build_model(config, Shard(), dtype, device)
        load_weights(model, model_dir)
        model.eval()
        _, kv_heads, head_dim = model.kv_layout()
        # eager, uncaptured: its steps are the target's shapes and k small decode steps
        local = dataclasses.replace(rc, use_cuda_graph=(False, False), varlen_compile=None, decode_compile=None,
                                    overlap=False, decode_burst=1)
        self.runner = ModelRunner(model, local, kv_heads, head_dim, dtype, device)

    def mirror(self, plan: StepPlan) -> None:
        """Run the target's STEP plan on the draft (no logits: nothing of it is sampled), so its cache holds the
        same tokens' K/V. The plan's input ids are all tokens (the engine runs in series)."""
        self.runner.execute(dataclasses.replace(plan, sample=np.zeros_like(plan.sample), share_tokens=False,
                                                burst=1, argmax_on_shards=False, score_next=plan.score_next[:0],
                                                score_top=0))

    def propose(self, last: list[int], known: np.ndarray, k: np.ndarray, tables: np.ndarray) -> list[np.ndarray]:
        """Each row's k[i] greedy tokens after its `last` token (at position known[i] - 1, `tables` its block table
        rows, pages allocated for known[i] + k[i] tokens): max(k) decode forwards, a row leaving when it has its k."""
        out = np.zeros((len(last), int(k.max(initial=0))), np.int64)
        ids = np.asarray(last, np.int64)
        for j in range(out.shape[1]):
            rows = np.flatnonzero(k > j)
            plan = StepPlan(input_ids=ids[rows].astype(np.int32), q_lens=np.ones(len(rows), np.int32),
                            kv_lens=(known[rows] + j).astype(np.int32),
                            sample=np.full(len(rows), SAMPLE_LAST, np.int32), block_tables=tables[rows])
            logits = self.runner.execute(plan)
            out[rows, j] = ids[rows] = logits.argmax(-1).cpu().numpy()
        return [out[i, :k[i]] for i in range(len(last))]
