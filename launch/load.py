"""`cluster.load`: join the groups, build this rank's shard of the model, read its slices of the weights."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from cluster.config import ContinuousBatchingConfig, expert_parallel, model_impl, read_preset
from cluster.dist import init_groups
from cluster.host_all_reduce import HostAllReduce
from driver.api.model import ClusterModel
from worker.layers import Shard
from worker.loader import load_weights
from worker.memory import use_device
from worker.models import build_model, check_supported

log = logging.getLogger("lockstep")


def load(model_dir: str | os.PathLike, dtype: torch.dtype | str | None = None,
         device: str | torch.device | None = None, cpu_group_timeout: float | None = 300.0,
         expert_parallel: bool = False, model_impl: str = "auto") -> ClusterModel:
    """Every rank calls it under torchrun (WORLD_SIZE > 1); alone it runs TP=1 with no process group.
    `expert_parallel`: a MoE model's ranks hold whole experts, E / tp each, rather than a slice of every expert
    (a preset's [model] `experts = "expert_parallel"`, cluster/config.py). `model_impl`: "auto" (a native family
    where there is one, else the generic path through transformers' modelling code), "native" or "generic" (a
    preset's [model] `impl`; docs/models.md). A model the path cannot serve raises `cluster.ModelRefused`."""
    from transformers import AutoConfig, GenerationConfig

    model_dir = str(model_dir)
    if not Path(model_dir, "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a checkpoint directory "
                                f"(make one with `lockstep make-model {model_dir}`)")
    config = AutoConfig.from_pretrained(model_dir)
    check_supported(config, model_impl)
    groups = init_groups(cpu_group_timeout, device)
    use_device(groups.device)  # this thread's current CUDA device (also at TP=1, and in a launcher's rank thread)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dtype = dtype or (torch.float32 if groups.device.type == "cpu" else torch.bfloat16)
    shard = Shard(groups.rank, groups.world_size, groups.device_group, HostAllReduce.join(groups))
    with torch.device(groups.device):
        model = build_model(config, shard, dtype, groups.device, expert_parallel, model_impl)
    load_weights(model, model_dir)
    model.eval()
    try:
        generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        generation_config = GenerationConfig(eos_token_id=config.eos_token_id)
    log.info("rank %d/%d loaded %s (%s, %s) on %s", groups.rank, groups.world_size, model_dir, config.model_type,
             model.describe(), groups.device)
    return ClusterModel(model, config, generation_config, groups, dtype, model_dir)


def load_with_preset(model_dir: str | os.PathLike, preset: str | os.PathLike | None,
                     ) -> tuple[ClusterModel, ContinuousBatchingConfig | None]:
    """`load` as a TOML preset says (its [model] `experts` placement and `impl`) and the preset's
    [continuous_batching] config (None without a preset): `lockstep run` and `lockstep generate` (`lockstep serve`
    reads the same tables)."""
    table = read_preset(preset)
    model_table = table.get("model")
    model = load(model_dir, expert_parallel=expert_parallel(model_table), model_impl=model_impl(model_table))
    return model, ContinuousBatchingConfig.from_any(table.get("continuous_batching", {})) if preset else None
