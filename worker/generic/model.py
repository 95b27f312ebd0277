"""The generic path: a decoder whose `model_type` has no native family, run through transformers' own modelling code
as a `CausalLM` (the same forward signature and outputs, so the runner, the plan, sampling, the KV pages and weight
updates do not change; docs/models.md, "The generic path").

At load, on every rank alike: transformers' causal-LM class is built with no weight initialisation on the host (its
parameters are unwritten allocations, never touched), then its embedding and LM head become Lockstep's
vocab-parallel ones and every `nn.Linear` a Lockstep linear, sharded where `base_model_tp_plan` says
(worker/generic/tp_plan.py) and replicated elsewhere; what is left (norms, rotary tables) moves to the device. Its
attention modules call Lockstep's paged attention (worker/generic/attention.py), registered with transformers'
`AttentionInterface`. A probe forward of two tokens then records each layer's heads, and refuses what the path
cannot serve (worker/generic/refusals.py), before any weight is read. The checkpoint names are transformers' own
(worker/generic/tensors.py)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
from torch import nn

from cluster.errors import ModelRefused
from worker.attention import AttnMeta
from worker.checkpoint_names import Target
from worker.generic.attention import ATTN_NAME, HELD, STEP_KWARG, GenericStep, NoStep, Probe, register
from worker.generic.refusals import check_config, check_probe
from worker.generic.sharded import FlatLMHead
from worker.generic.tensors import tensor_targets
from worker.generic.tp_plan import shard_linears
from worker.layers import Shard, VocabParallelEmbedding
from worker.models.decoder import CausalLM


def _path_of(hf: nn.Module, module: nn.Module) -> str:
    return next(path for path, m in hf.named_modules() if m is module)


class GenericLM(CausalLM):
    """transformers' `<Arch>ForCausalLM` on Lockstep's layers and pages, as `self.hf`."""

    impl = "generic"

    def __init__(self, config: Any, shard: Shard, dtype: torch.dtype, device: torch.device,
                 expert_parallel: bool = False):
        nn.Module.__init__(self)
        check_config(config, shard.size)
        register()
        self.config, self.shard, self.expert_parallel = config, shard, expert_parallel
        self._expected = None
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        try:
            with torch.device("cpu"), no_init_weights():  # a copy: transformers writes dtype and attention into it
                self.hf = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ATTN_NAME,
                                                           dtype=dtype)
        except Exception as e:  # modelling code that picks its attention classes by name, ...
            raise ModelRefused(config.model_type, None, f"transformers could not build it with an attention function "
                                                        f"of Lockstep's: {type(e).__name__}: {e}") from e
        self.hf.requires_grad_(False).eval()
        self.hf.tie_weights()  # as loading would (no_init_weights skipped it)
        self.tied, self._embed_path, self._head_path = self._vocab_layers(shard, dtype, device)
        self.styles = shard_linears(self.hf, config, shard, dtype, device)
        self.hf.to(device)
        self.q_heads, self.kv_heads, self.head_dim, self.windows = self._probe(device)
        self.embed_name = f"{self._embed_path}.weight"
        self._targets = tensor_targets(self.hf, self.lm_head if self.tied else None)

    def _vocab_layers(self, shard: Shard, dtype: torch.dtype, device: torch.device) -> tuple[bool, str, str]:
        """Put Lockstep's vocab-parallel head (and embedding) in place of transformers' (tied again when they were);
        returns (tied, embedding path, head path). An embedding with a forward of its own (a scaled one) stays
        transformers' at TP=1 (replicated) and is refused at TP > 1."""
        kind, emb, head = self.config.model_type, self.hf.get_input_embeddings(), self.hf.get_output_embeddings()
        if type(head) is not nn.Linear or head.bias is not None:
            what = type(head).__name__ + (" with a bias" if isinstance(head, nn.Linear) else "")
            raise ModelRefused(kind, head is not None and _path_of(self.hf, head) or "lm_head",
                               f"the LM head is {what}, not an nn.Linear without bias")
        plain = type(emb) is nn.Embedding
        if not plain and shard.size > 1:
            raise ModelRefused(kind, _path_of(self.hf, emb), f"the input embedding is a {type(emb).__name__} with a "
                                                             f"forward of its own, served at TP=1 only")
        tied = head.weight is emb.weight
        paths = _path_of(self.hf, emb), _path_of(self.hf, head)
        with torch.device(device):
            embed = VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, shard, dtype) if plain else emb
            lm_head = FlatLMHead(head.out_features, head.in_features, shard, dtype)
        if tied:
            lm_head.weight = embed.weight
        self.hf.set_submodule(paths[0], embed)
        self.hf.set_submodule(paths[1], lm_head)
        return tied, *paths

    def _probe(self, device: torch.device) -> tuple[int, int, int, list[int | None]]:
        """One forward of two tokens through every layer (every rank alike: the sharded layers' collectives run),
        the attention function recording instead of attending: first with the step in the forward's kwargs, then,
        if the modelling code drops them on the way, held (`HELD`; then `self.held` for every forward). Returns
        this rank's (query heads, KV heads, head dim) and each layer's window, or raises ModelRefused."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        self.held = False
        while True:
            probe = Probe()
            try:
                with torch.inference_mode():
                    self._run(ids, torch.arange(2, device=device)[None], 1, probe)
                break
            except NoStep:
                if self.held:
                    raise
                self.held = True
            except ModelRefused:
                raise
            except Exception as e:  # the modelling code could not run on the sharded layers
                raise ModelRefused(self.config.model_type, None, f"its forward failed on Lockstep's layers at "
                                   f"tp={self.shard.size}: {type(e).__name__}: {e}") from e
        first = check_probe(self.config, probe)
        windows = [probe.calls[i][0].window for i in range(self.config.num_hidden_layers)]
        return first.q_heads, first.kv_heads, first.k_dim, windows

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | int,
             step: GenericStep | Probe) -> torch.Tensor:
        """transformers' forward of [1, T] tokens at `positions`, the logits of the `keep` rows, `step` in its
        kwargs (and held, where the model needs it)."""
        if not self.held:
            return self.hf(input_ids=ids, position_ids=positions, logits_to_keep=keep, use_cache=False,
                           **{STEP_KWARG: step}).logits
        HELD.step = step
        try:
            return self.hf(input_ids=ids, position_ids=positions, logits_to_keep=keep, use_cache=False).logits
        finally:
            HELD.step = None

    @classmethod
    def check(cls, config: Any) -> None:
        check_config(config, 1)

    @property
    def lm_head(self) -> FlatLMHead:  # type: ignore[override]
        return self.hf.get_submodule(self._head_path)

    def kv_layout(self) -> tuple[int, int, int]:
        return self.q_heads, self.kv_heads, self.head_dim

    def describe(self) -> str:
        counts = Counter(self.styles.values())
        linears = ", ".join(f"{n} {style}" for style, n in sorted(counts.items())) or "none"
        return (f"generic path: transformers' {type(self.hf).__name__} with Lockstep's paged attention; linears: "
                f"{linears}; {self.q_heads} query and {self.kv_heads} KV heads of {self.head_dim} a rank")

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], project: bool = True) -> torch.Tensor:
        """This rank's logits shard for meta's rows: transformers' forward over the step's tokens as one sequence of
        [1, T], its positions given, attention through the pages (every rank calls it: the layers' collectives).
        Whatever `project` says: transformers applies its head, and any post-processing of the logits its family
        does, inside its forward, so the head's inputs here are the logits themselves (`project` passes them on)."""
        return self._run(input_ids[None], meta.positions[None], meta.logits_idx,
                         GenericStep(meta, k_caches, v_caches))[0]

    def project(self, heads: torch.Tensor) -> torch.Tensor:
        """The logits `forward` gave, unchanged (see `forward`)."""
        return heads

    def target(self, name: str) -> Target | None:
        return self._targets.get(name)

    def expected_tensors(self) -> frozenset[str]:
        if self._expected is None:
            self._expected = frozenset(self._targets)
        return self._expected

