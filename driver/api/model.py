"""The model users hold: transformers' continuous-batching entry points (the seed's signatures), across ranks:
under torchrun every rank calls them with the same arguments and gets the same results. It also answers what
transformers scripts touch on a model: `parameters()`, `named_parameters()`, `state_dict()` (this rank's shards
under transformers' names, views into the live weights: worker/named_shards.py), `config`, `device`, `dtype` ...
"""

from __future__ import annotations

import importlib
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from cluster.config import ContinuousBatchingConfig, ResolvedConfig, resolve_config
from cluster.dist import Groups, agree_min, make_control_group
from cluster.errors import ManagerStopped, QueueFull
from cluster.outputs import GenerationOutput
from cluster.samples import sample_ids, sample_order
from driver.api.manager import ContinuousBatchingManager
from driver.api.request_group import samples_asked
from worker.attention import attention_workspace_bytes
from worker.kv_cache import kv_bytes_per_token
from worker.kv_offload import system_ram_bytes
from worker.graphs import GraphFactory
from worker.memory import (CACHE_LEDGER, ReleasedCache, describe, host_memory, propose_num_blocks, tensor_bytes,
                           use_device)
from worker.models.decoder import CausalLM
from worker.named_shards import named_shards, shard_of
from worker.runner import ModelRunner


def importable(module: str) -> bool:
    """Whether `module` imports here (an attention kernel's module: flash-attn, or Lockstep's Triton kernel, which
    needs Triton; cluster.config.attention_decision picks among those that do)."""
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


class ClusterModel:
    def __init__(self, model: CausalLM, config: Any, generation_config: Any, groups: Groups, dtype: torch.dtype,
                 model_dir: str):
        self.model, self.config, self.generation_config = model, config, generation_config
        self.groups, self.dtype, self.model_dir = groups, dtype, model_dir
        self.persistent_manager: ContinuousBatchingManager | None = None
        self.last_stats: dict[str, Any] = {}  # the engine's counters at the end of the last generate_batch
        self._params: dict[str, nn.Parameter] | None = None
        # the runner of the last manager destroyed cleanly, with the config it was built for: the next manager of an
        # equal config takes it (KV cache, static buffers, compiled forwards, CUDA graphs) instead of building anew
        self._idle: tuple[ContinuousBatchingConfig, ModelRunner, ResolvedConfig] | None = None
        self.graph_factory: Callable[[], GraphFactory] | None = None  # tests: graphs.EagerStandIn on the CPU

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    # ---------------------------------------------------------------- what transformers scripts touch
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """(transformers name, this rank's shard) for every checkpoint tensor, as Parameters sharing storage with
        the live weights (worker/named_shards.py). A tied lm_head appears once (remove_duplicate=False adds it)."""
        if self._params is None:  # views never move: the parameters' storage is fixed for the model's life
            self._params = {n: nn.Parameter(t, requires_grad=False)
                            for n, t in named_shards(self.model, with_tied=True).items()}
        tied = self.model.tied and remove_duplicate
        for name, p in self._params.items():
            if not (tied and name == "lm_head.weight"):
                yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def state_dict(self, *args: Any, prefix: str = "", keep_vars: bool = False, **kwargs: Any) -> dict[str, Any]:
        """This rank's shard of every tensor under transformers' names (lm_head.weight included when tied),
        as tensors that share storage with the live weights (detached, as transformers' state_dict)."""
        return {prefix + n: (p if keep_vars else p.detach()) for n, p in self.named_parameters(remove_duplicate=False)}

    def shard_of(self, name: str, full: Any) -> torch.Tensor:
        """This rank's part of a full (unsharded) tensor `name`, shaped like its entry in state_dict(): e.g.
        `p.copy_(model.shard_of(name, full_state[name]))` for every (name, p) in named_parameters()."""
        return shard_of(self.model, name, full)

    def eval(self) -> ClusterModel:
        self.model.eval()
        return self

    def build_runner(self, cb: ContinuousBatchingConfig) -> tuple[ModelRunner, ResolvedConfig, Groups]:
        """The runner a new manager steps with, its resolved config and its groups. Every rank calls it. The idle
        runner of an equal config is taken as it is when every rank holds one (the group agrees: nothing is sized,
        allocated, compiled or captured again); otherwise the KV cache is sized (the group agrees on the smallest
        proposal) and a runner made, after this model's earlier caches were released, so it gets the same memory."""
        use_device(self.device)
        idle, self._idle = self._idle, None
        if agree_min(int(idle is not None and idle[0] == cb), self.groups):
            _, runner, rc = idle
            runner.expect_batch(None)
            return runner, rc, self._control_groups(cb)
        idle = None  # released below (CUDA) or when nothing refers to it any more
        q_heads, kv_heads, d = self.model.kv_layout()
        per_token = kv_bytes_per_token(self.config.num_hidden_layers, kv_heads, d, self.dtype, self.model.kv_values)
        cuda = self.device.type == "cuda"
        rc = resolve_config(cb, device_kind=self.device.type, max_model_len=self.max_model_len,
                            kv_bytes_per_token=per_token, free_bytes=None if cuda else host_memory()[0] or None,
                            flash_available=importable("flash_attn"), dtype=self.dtype, head_dim=d,
                            system_ram=system_ram_bytes(),
                            triton_available=cuda and importable("worker.triton_attention"))
        if cuda and cb.num_blocks is None:
            workspace = attention_workspace_bytes(rc, q_heads, kv_heads, d, self.dtype)
            rc.num_blocks, breakdown = propose_num_blocks(
                rc, self.config, self.model.shard.size, self.dtype, self.device, per_token, self.model,
                max_memory_percent=cb.max_memory_percent,
                attention_workspace_bytes=workspace)  # one layer at a time: its bound is the peak
            rc.notes.append(describe(breakdown))
        rc.num_blocks = agree_min(rc.num_blocks, self.groups)
        rc.num_host_blocks = agree_min(rc.num_host_blocks, self.groups)  # the driver's slots exist on every rank
        groups = self._control_groups(cb)
        if cuda:
            CACHE_LEDGER.release_all(self.device, self.model)
        runner = ModelRunner(self.model, rc, kv_heads, d, self.dtype, self.device,
                             graph_factory=self.graph_factory() if self.graph_factory else None)
        if cuda:
            CACHE_LEDGER.hold(runner.cache, self.device, self.model, tensor_bytes(runner.cache.tensors()))
        return runner, rc, groups

    def _control_groups(self, cb: ContinuousBatchingConfig) -> Groups:
        """The model's groups, with a control group of its own where `cb` asks for another timeout. Every rank."""
        if self.groups.distributed and cb.cpu_group_timeout != self.groups.control_timeout:
            return make_control_group(self.groups, cb.cpu_group_timeout)
        return self.groups

    def keep_idle(self, cb: ContinuousBatchingConfig, runner: ModelRunner, rc: ResolvedConfig) -> None:
        """Keep a destroyed manager's runner for the next manager of an equal config (`build_runner`). Called by
        every rank's manager as it is destroyed after a clean stop. Not one whose cache a newer manager took."""
        if not isinstance(runner.cache.k, ReleasedCache):
            self._idle = (cb, runner, rc)

    def release_idle_runner(self) -> None:
        """Let go of the runner kept for the next call (its KV cache, buffers and graphs are freed once nothing
        refers to them), e.g. to hand the device memory to something else between generate_batch calls."""
        if self._idle is not None and self.device.type == "cuda":
            CACHE_LEDGER.release_all(self.device, self.model)
        self._idle = None

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
        """Generate for every prompt; the same dict (request id -> output, in input order) on every rank. A bad input
        raises the same ValueError on every rank; a batch larger than max_queue_size is fed as room appears. With
        num_return_sequences n, each prompt's n samples (cluster/samples.py: its children, then itself)."""
        if not inputs:
            return {}
        gen = generation_config or self.generation_config
        n = samples_asked(gen, kwargs.get("num_return_sequences"))
        total = n * len(inputs)
        kept = self.persistent_manager
        manager = self.init_continuous_batching(gen, continuous_batching_config)
        try:  # the driver's validation, on every rank with the same names: every rank raises the same error or none
            with warnings.catch_warnings():  # the driver warns once more when it builds the real requests
                warnings.simplefilter("ignore")
                for i, ids in enumerate(inputs):
                    manager.build_request(ids, f"inputs[{i}]", record_timestamps=record_timestamps, **kwargs)
        except Exception:
            if manager is not kept:
                manager.destroy()
            raise
        manager.wants_results = True  # before start: every rank gets every output of this batch
        manager.runner.expect_batch(len(inputs))  # decode graphs only up to the bucket this batch can fill
        with self._running(manager, warmup, block=True, timeout=None, persistent_manager=persistent_manager):
            # the driver numbers the requests in input order; workers' add_request would be a no-op
            reqs = [manager.build_request(x, record_timestamps=record_timestamps, **kwargs) for x in inputs] \
                if self.groups.is_driver else []
            results: dict[str, GenerationOutput] = {}
            bar = tqdm(total=total, disable=not (progress_bar and self.groups.is_driver),
                       desc="requests finished", unit="request")
            generated = fed = 0
            while len(results) < total:
                fed = self._feed(manager, reqs, fed)
                out = manager.get_result(timeout=0.05 if fed < len(reqs) else 1)
                if out is None:
                    if not manager.is_running():
                        break
                    continue
                if out.is_finished():
                    results[out.request_id] = out
                    generated += len(out.generated_tokens)
                    bar.set_postfix_str(f"{generated} tokens generated", refresh=False)
                    bar.update(1)
            bar.close()
            if reqs:
                ids = [i for r in reqs for i in sample_ids(r.request_id, n)]
                results = {i: results[i] for i in ids if i in results}
            else:  # a worker: the driver numbered the requests in input order
                results = dict(sorted(results.items(), key=lambda kv: output_order(kv[0])))
            self.last_stats = manager.stats()
        if manager.loop_error is not None and len(results) < total:
            raise RuntimeError(f"generation stopped early: {manager.loop_error!r}") from manager.loop_error
        return results

    @staticmethod
    def _feed(manager: ContinuousBatchingManager, reqs: list, fed: int) -> int:
        """Submit requests from `fed` on while the queue has room (driver); returns how many are in."""
        while fed < len(reqs):
            try:
                manager.submit(reqs[fed])
            except QueueFull:
                return fed  # again once the scheduler has taken some
            except ManagerStopped:
                return len(reqs)  # the loop ended; the caller sees it and raises like every rank
            fed += 1
        return fed


def output_order(request_id: str) -> tuple[int, int, int]:
    """generate_batch's order of the driver's ids req_<k> (and their samples, cluster/samples.py), on a worker."""
    base, is_parent, index = sample_order(request_id)
    return int(base.rsplit("_", 1)[1]), is_parent, index
