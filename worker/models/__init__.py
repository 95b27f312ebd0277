"""The families Lockstep serves, one file each, and the registry from transformers' `model_type` to the family's
class (docs/models.md says how to add one). A `model_type` without a family goes the generic path
(worker/generic/): transformers' own modelling code on Lockstep's layers and pages."""

from __future__ import annotations

from typing import Any

import torch

from cluster.errors import UnsupportedModel
from cluster.config import MODEL_IMPLS
from worker.layers import Shard
from worker.models.decoder import CausalLM
from worker.models.gemma2 import Gemma2
from worker.models.deepseek_v3 import DeepseekV3
from worker.models.gemma3 import Gemma3
from worker.models.glm4_moe import Glm4Moe
from worker.models.gpt_oss import GptOss
from worker.models.llama import Llama, Mistral, Qwen2
from worker.models.mixtral import Mixtral
from worker.models.qwen3 import Qwen3
from worker.models.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, type[CausalLM]] = {t: family for family in (Llama, Mistral, Qwen2, Qwen3, Qwen3Moe, Mixtral,
                                                                 Glm4Moe, Gemma3, Gemma2, GptOss, DeepseekV3)
                                       for t in family.model_types}


def family_of(config: Any, model_impl: str = "auto") -> type[CausalLM]:
    """The class serving `config.model_type` under `model_impl` (cluster.config.MODEL_IMPLS: "auto" takes a family
    where there is one, else the generic path; "generic" takes it even where a family exists); ValueError for an
    unknown `model_impl`; UnsupportedModel (a ValueError) for "native" without a family (naming the native ones)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl={model_impl!r}: expected one of {MODEL_IMPLS}")
    from worker.generic.model import GenericLM  # not at the top: it imports worker.models.decoder, so this package

    family = FAMILIES.get(getattr(config, "model_type", None))
    if model_impl == "native" and family is None:
        raise UnsupportedModel(f"model_type {config.model_type!r} has no native family (native: "
                               f"{', '.join(FAMILIES)}); model_impl='auto' or 'generic' serves it through "
                               "transformers' modelling code")
    return GenericLM if model_impl == "generic" or family is None else family


def check_supported(config: Any, model_impl: str = "auto") -> None:
    family_of(config, model_impl).check(config)


def build_model(config: Any, shard: Shard, dtype: torch.dtype, device: torch.device,
                expert_parallel: bool = False, model_impl: str = "auto") -> CausalLM:
    """This rank's shard of the model `config` describes (weights not loaded). `expert_parallel`: a MoE family's
    ranks hold whole experts, E / tp each, instead of a slice of every expert (worker/experts.py)."""
    return family_of(config, model_impl)(config, shard, dtype, device, expert_parallel)
