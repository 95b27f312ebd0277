"""The model users hold: transformers' continuous-batching entry points, made to work across ranks.

`generate_batch`, `init_continuous_batching` and `continuous_batching_context_manager` keep the seed's
signatures. Under torchrun every rank calls them with the same arguments; every rank gets the same results.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from cluster.config import ContinuousBatchingConfig, ResolvedConfig, resolve_config
from cluster.dist import Groups, agree_min, make_control_group
from cluster.outputs import GenerationOutput
from driver.manager import ContinuousBatchingManager
from driver.validation import check_max_new_tokens, check_prompt, default_max_new_tokens
from worker.kv_cache import kv_bytes_per_token
from worker.model import CausalLM, KVHeads, head_dim_of
from worker.runner import ModelRunner


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
        return True
    except Exception:
        return False


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class ClusterModel:
    def __init__(self, model: CausalLM, config: Any, generation_config: Any, groups: Groups, dtype: torch.dtype,
                 model_dir: str):
        self.model = model
        self.config = config
        self.generation_config = generation_config
        self.groups = groups
        self.dtype = dtype
        self.model_dir = model_dir
        self.persistent_manager: ContinuousBatchingManager | None = None
        self.last_stats: dict[str, Any] = {}  # the engine's counters at the end of the last generate_batch

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def build_runner(self, cb: ContinuousBatchingConfig) -> tuple[ModelRunner, ResolvedConfig, Groups]:
        """Size the KV cache (the group agrees on the smallest proposal) and make the runner. Every rank calls it."""
        heads = KVHeads(self.config, self.model.shard)
        d = head_dim_of(self.config)
        per_token = kv_bytes_per_token(self.config.num_hidden_layers, heads.kv_local, d, self.dtype)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else available_host_memory()
        rc = resolve_config(cb, device_kind=self.device.type, max_model_len=self.max_model_len,
                            kv_bytes_per_token=per_token, free_bytes=free, flash_available=flash_attn_available())
        rc.num_blocks = agree_min(rc.num_blocks, self.groups)
        groups = self.groups
        if self.groups.distributed and cb.cpu_group_timeout != self.groups.control_timeout:
            groups = make_control_group(self.groups, cb.cpu_group_timeout)
        return ModelRunner(self.model, rc, heads.kv_local, d, self.dtype, self.device), rc, groups

    # ---------------------------------------------------------------- the seed's entry points
    def init_continuous_batching(self, generation_config: Any = None, continuous_batching_config: Any = None,
                                 **_: Any) -> ContinuousBatchingManager:
        """A manager (the persistent one if kept); every rank calls it."""
        kept = self.persistent_manager
        if kept is not None and not kept.destroyed:
            return kept
        cb = ContinuousBatchingConfig.from_any(continuous_batching_config)
        return ContinuousBatchingManager(self, generation_config or self.generation_config, cb)

    @contextmanager
    def continuous_batching_context_manager(self, generation_config: Any = None,
                                            continuous_batching_config: Any = None, block: bool = True,
                                            timeout: float | None = None, persistent_manager: bool = False,
                                            warmup: bool = True, **kwargs: Any) -> Iterator[ContinuousBatchingManager]:
        manager = self.init_continuous_batching(generation_config, continuous_batching_config, **kwargs)
        with self._running(manager, warmup, block, timeout, persistent_manager):
            yield manager

    @contextmanager
    def _running(self, manager: ContinuousBatchingManager, warmup: bool, block: bool, timeout: float | None,
                 persistent_manager: bool) -> Iterator[ContinuousBatchingManager]:
        if warmup:
            manager.warmup()
        manager.start()
        try:
            yield manager
        finally:
            manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
            if not persistent_manager:
                manager.destroy()

    def generate_batch(self, inputs: list[list[int]], generation_config: Any = None,
                       continuous_batching_config: Any = None, record_timestamps: bool = False,
                       progress_bar: bool = False, persistent_manager: bool = False, warmup: bool = True,
                       **kwargs: Any) -> dict[str, GenerationOutput]:
        """Generate for every prompt; the same dict (request id -> output, in input order) on every rank."""
        if not inputs:
            return {}
        gen = generation_config or self.generation_config
        max_new_tokens = kwargs.pop("max_new_tokens", None)
        # every rank checks the same inputs, so every rank raises the same error before any step runs
        for i, ids in enumerate(inputs):
            check_prompt(ids, f"inputs[{i}]", self.config.vocab_size, self.max_model_len)
        check_max_new_tokens(default_max_new_tokens(gen) if max_new_tokens is None else max_new_tokens,
                             "for every input")
        manager = self.init_continuous_batching(gen, continuous_batching_config)
        manager.wants_results = True  # before start: every rank gets every output of this batch
        with self._running(manager, warmup, block=True, timeout=None, persistent_manager=persistent_manager):
            ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps,
                                       **kwargs)
            results: dict[str, GenerationOutput] = {}
            bar = tqdm(total=len(inputs), disable=not (progress_bar and self.groups.is_driver),
                       desc=f"Solving {len(inputs)} requests", unit="request")
            while len(results) < len(inputs):
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        break
                    continue
                if out.is_finished():
                    results[out.request_id] = out
                    bar.update(1)
            bar.close()
            if ids is not None:
                results = {i: results[i] for i in ids if i in results}
            else:  # a worker: the driver numbered the requests in input order
                results = dict(sorted(results.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1])))
            self.last_stats = manager.stats()
        if manager.loop_error is not None and len(results) < len(inputs):
            raise RuntimeError(f"generation stopped early: {manager.loop_error!r}") from manager.loop_error
        return results
