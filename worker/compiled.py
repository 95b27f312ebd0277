"""The compiled forwards: the seed's `decode_compile_config` and `varlen_compile_config`, applied
(docs/architecture.md, "Compiled forwards"). The choice of forward follows from the step's shapes, so every rank
takes the same one, and dynamo's guards (shapes again) make every rank compile the same graphs in the same order.
Each padded shape is one graph, so dynamo's recompile limit (8), past which it would silently run eagerly, is
raised to `RECOMPILE_LIMIT`. A failed compile raises `CompileFailed`; nothing falls back to eager."""

from __future__ import annotations

import logging
import time
import weakref
from typing import Callable

import torch

from cluster.compile_settings import CompileSettings
from cluster.config import ResolvedConfig
from cluster.errors import Code, LockstepError
from cluster.plan import StepPlan
from worker.attention import AttnMeta


log = logging.getLogger("lockstep")

RECOMPILE_LIMIT = 4096  # distinct shapes (graphs) one compiled forward may hold before dynamo runs it eagerly

# model -> {(forward name, settings): its CompiledForward}: a later manager of the same model (generate_batch
# makes one a call) reuses the graphs compiled for an earlier one instead of compiling them again
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CompileFailed(LockstepError, RuntimeError):
    """torch.compile could not compile a forward: `config` names the seed's field whose settings failed."""

    code = Code.INTERNAL

    def __init__(self, config: str, settings: CompileSettings, shape: str, cause: BaseException):
        super().__init__(f"{config} ({settings.describe()}) failed to compile the forward for {shape}: "
                         f"{type(cause).__name__}: {cause}")
        self.config, self.settings, self.shape = config, settings, shape


def _decode_entry(model: torch.nn.Module, ids: torch.Tensor, meta: AttnMeta, k: list, v: list,
                  project: bool = True) -> torch.Tensor:
    return model(ids, meta, k, v, project)


def _varlen_entry(model: torch.nn.Module, ids: torch.Tensor, meta: AttnMeta, k: list, v: list,
                  project: bool = True) -> torch.Tensor:
    return model(ids, meta, k, v, project)


# one function (code object) each, so the two forwards keep separate dynamo caches and recompile counts
ENTRIES: dict[str, Callable[..., torch.Tensor]] = {"decode": _decode_entry, "varlen": _varlen_entry}


class CompiledForward:
    """One forward compiled with its settings. Logs each shape it meets first (that call compiles) with the
    time it took, and turns a compile error into `CompileFailed`. Every rank of the device group calls it."""

    def __init__(self, name: str, model: torch.nn.Module, settings: CompileSettings):
        self.name, self.settings = name, settings
        self.model = weakref.ref(model)  # weak: the per-model cache below must not keep its key alive
        self.config = f"{name}_compile_config"
        self.compile_s: dict[str, float] = {}  # shape -> seconds its first call took (compile and run)
        # process-wide (dynamo reads its config at each compile; patching it around every call costs milliseconds);
        # only ever raised, so no compiled function loses graphs
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
        try:
            self.fn = torch.compile(ENTRIES[name], **settings.torch_kwargs())
        except (RuntimeError, TypeError, ValueError) as e:  # torch.compile refuses its arguments
            raise CompileFailed(self.config, settings, "any shape", e) from e

    @staticmethod
    def shape_key(ids: torch.Tensor, meta: AttnMeta, k: list[torch.Tensor]) -> str:
        """The shapes a compiled graph is specialised on, in words."""
        return (f"tokens={ids.shape[0]} decode={tuple(meta.dec_kv_slots.shape)} "
                f"prefill={tuple(meta.pre_q_pos.shape)}x{meta.pre_kv_slots.shape[-1]} "
                f"logits={meta.logits_idx.shape[0]} cache_slots={k[0].shape[0] if k else 0}")

    def __call__(self, ids: torch.Tensor, meta: AttnMeta, k: list[torch.Tensor], v: list[torch.Tensor],
                 project: bool = True) -> torch.Tensor:
        """`project` False (prompt scoring): the head's inputs, a graph of its own (dynamo guards on it)."""
        shape = self.shape_key(ids, meta, k) + ("" if project else " heads")
        first = shape not in self.compile_s
        start = time.perf_counter()
        try:
            out = self.fn(self.model(), ids, meta, k, v, project)
        except torch._dynamo.exc.TorchDynamoException as e:
            raise CompileFailed(self.config, self.settings, shape, e) from e
        if first:
            self.compile_s[shape] = time.perf_counter() - start
            log.info("compiled the %s forward for %s in %.1fs (%d shapes so far)", self.name, shape,
                     self.compile_s[shape], len(self.compile_s))
        return out


def compiled_forward(name: str, model: torch.nn.Module, settings: CompileSettings | None
                     ) -> Callable[..., torch.Tensor]:
    """The model itself when `settings` is None, else its compiled forward for them (made once per model)."""
    if settings is None:
        return model
    kept, key = _COMPILED.setdefault(model, {}), (name, repr(settings))
    if key not in kept:
        kept[key] = CompiledForward(name, model, settings)
    return kept[key]


class ForwardFn:
    """The runner's forward: decode-only steps to the decode forward, others to the varlen forward."""

    def __init__(self, model: torch.nn.Module, rc: ResolvedConfig):
        self.decode = compiled_forward("decode", model, rc.decode_compile)
        self.varlen = compiled_forward("varlen", model, rc.varlen_compile)
        self.warmed, self.warm_up_s = False, 0.0

    @property
    def compiled(self) -> dict[str, CompiledForward]:
        return {f.name: f for f in (self.decode, self.varlen) if isinstance(f, CompiledForward)}

    def __call__(self, ids: torch.Tensor, meta: AttnMeta, k: list[torch.Tensor], v: list[torch.Tensor],
                 project: bool = True) -> torch.Tensor:
        """Every rank of the device group calls it (the forward all-reduces). `project`: CausalLM.forward's."""
        return (self.decode if meta.pre_q_pos.shape[0] == 0 else self.varlen)(ids, meta, k, v, project)

    def warm_up(self, plans: list[tuple[str, StepPlan]], prepare: Callable[[StepPlan], tuple[torch.Tensor, AttnMeta]],
                k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Compile every decode bucket and the smallest varlen shapes, once. Every rank calls it at the same point
        (the runner's first `execute`): the forwards all-reduce. A shape an earlier runner of this model compiled is
        skipped: that follows from the plans every rank ran since the model was loaded, so every rank skips the same."""
        self.warmed = True
        if not plans:
            return
        start = time.perf_counter()
        log.info("compile warm-up: %d steps (%s)", len(plans), ", ".join(name for name, _ in plans))
        for i, (name, plan) in enumerate(plans):
            ids, meta = prepare(plan)
            fn = self.decode if meta.pre_q_pos.shape[0] == 0 else self.varlen
            if isinstance(fn, CompiledForward) and fn.shape_key(ids, meta, k) in fn.compile_s:
                continue  # compiled for an earlier runner of this model (the same on every rank: see warm_up)
            log.info("compile warm-up %d/%d: %s", i + 1, len(plans), name)
            self(ids, meta, k, v)
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)
        self.warm_up_s = time.perf_counter() - start
        log.info("compile warm-up done in %.1fs", self.warm_up_s)
