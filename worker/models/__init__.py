"""The families Lockstep serves, one file each, and the registry from transformers' `model_type` to the family's
class (docs/models.md says how to add one)."""

from __future__ import annotations

from typing import Any

import torch

from cluster.errors import UnsupportedModel
from worker.layers import Shard
from worker.models.decoder import CausalLM
from worker.models.gemma3 import Gemma3
from worker.models.glm4_moe import Glm4Moe
from worker.models.llama import Llama, Mistral, Qwen2
from worker.models.mixtral import Mixtral
from worker.models.qwen3 import Qwen3
from worker.models.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, type[CausalLM]] = {t: family for family in (Llama, Mistral, Qwen2, Qwen3, Qwen3Moe, Mixtral,
                                                                 Glm4Moe, Gemma3)
                                       for t in family.model_types}


def family_of(config: Any) -> type[CausalLM]:
    """The family class serving `config.model_type`, or ValueError naming the supported ones."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise UnsupportedModel(f"model_type {config.model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    return family


def check_supported(config: Any) -> None:
    family_of(config).check(config)


def build_model(config: Any, shard: Shard, dtype: torch.dtype, device: torch.device,
                expert_parallel: bool = False) -> CausalLM:
    """This rank's shard of the model `config` describes (weights not loaded). `expert_parallel`: a MoE family's
    ranks hold whole experts, E / tp each, instead of a slice of every expert (worker/experts.py)."""
    return family_of(config)(config, shard, dtype, device, expert_parallel)
