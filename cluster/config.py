"""ContinuousBatchingConfig (transformers' fields and defaults, plus `LOCKSTEP_FIELDS`), its validation, and
`resolve_config`: the plain numbers every rank is sized from, a field that cannot apply here resolved to its
effective value with the reason in `ResolvedConfig.notes`."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import warnings
from dataclasses import dataclass, field
from typing import Any

from cluster.compile_settings import CompileSettings, compile_decision
from cluster.speculative import SpeculativeConfig, is_int as _is_int

# ContinuousBatchingConfig's fields that transformers' class does not have
LOCKSTEP_FIELDS = ("decode_burst", "max_weight_lag", "stale_policy", "logprobs_mode", "speculative")
STALE_POLICIES = ("end", "restart")  # what an update does to a request beyond its max_weight_lag (docs/weights.md)
# vLLM's: which figures a token's logprobs (and top_logprobs) report (driver/engine/logprobs_mode.py)
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")
# Defaults where the seed says "inferred" and there is no GPU memory to infer from.
CPU_KV_CACHE_BYTES = 1 << 30  # KV budget on a CPU rank when num_blocks is None (1 GiB)
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 512, "cuda": 4096}
DEFAULT_MAX_REQUESTS_PER_BATCH = {"cpu": 128, "cuda": 1024}
DEFAULT_Q_PADDING = {"cpu": 32, "cuda": 64}  # tokens, when q_padding_interval_size == 0 (fewer shapes to compile)
EAGER_CPU_Q_PADDING = 8  # the eager CPU forward's: a 5-token speculative verify runs 8 rows, not 32 (cost by the row)
DEFAULT_KV_PADDING = {"cpu": 64, "cuda": 256}  # tokens; used when kv_padding_interval_size == 0
DEFAULT_MAX_NEW_TOKENS = 20  # transformers' max_length default, when nothing else says
SCHEDULERS = ("fifo", "prefill_first")
IDLE_HEARTBEAT_S = 0.5  # the driver sends an IDLE plan this often when it has nothing to run
ATTN_CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}  # work of one paged SDPA chunk, in elements
HOST_ALL_REDUCE_ENV = "LOCKSTEP_HOST_ALL_REDUCE"  # "0": CPU ranks on one host all-reduce over gloo
HOST_ALL_REDUCE_SLOT_BYTES = 4 << 20  # a rank's slot in the shared segment; larger tensors go in pieces
PLAN_CHANNEL_ENV = "LOCKSTEP_PLAN_CHANNEL"  # "1": ranks on one host take plans through shared memory (opt-in)


@dataclass
class ContinuousBatchingConfig:
    """Every field of transformers' ContinuousBatchingConfig (shared/seed), then Lockstep's own (LOCKSTEP_FIELDS)."""

    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    default_compile_level: int = 0
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    # deprecated, accepted with a DeprecationWarning
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None
    block_size: int | None = None
    # Lockstep's own: multi-step decode. Overlapped, a decode-only batch whose rows need no token history on the
    # host runs up to this many forwards from one plan (StepPlan.burst); 1: one step a plan
    decode_burst: int = 1
    # Lockstep's own: the default of every request's max_weight_lag (None: unbounded) and stale_policy ("end": finish
    # with finish_reason "stale"; "restart": from its prompt under the new weights); docs/weights.md, "Staleness"
    max_weight_lag: int | None = None
    stale_policy: str = "end"
    logprobs_mode: str = "processed_logprobs"  # every request's default (LOGPROBS_MODES; docs/http.md, "Logprobs")
    speculative: Any = None  # speculative decoding: a SpeculativeConfig or its table (docs/speculative.md); None: off

    def __post_init__(self) -> None:
        if self.use_default_compile_configs is not None:
            warnings.warn("use_default_compile_configs is deprecated: use default_compile_level",
                          DeprecationWarning, stacklevel=3)
            self.default_compile_level = 3 if self.use_default_compile_configs else 0
        if self.max_cached_graphs is not None:
            warnings.warn("max_cached_graphs is deprecated and ignored", DeprecationWarning, stacklevel=3)
        if self.block_size is not None:
            warnings.warn("block_size is deprecated: use page_size", DeprecationWarning, stacklevel=3)
            self.page_size = self.block_size
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value cannot work."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"ContinuousBatchingConfig.{name}={getattr(self, name)!r}: {why}")

        if not _is_int(self.page_size) or self.page_size <= 0:
            bad("page_size", "must be a positive integer")
        for name in ("num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            if (v := getattr(self, name)) is not None and not (_is_int(v) and v > 0):
                bad(name, "must be a positive integer or None")
        if (mbr := self.max_blocks_per_request) is not None and (not isinstance(mbr, int) or mbr < 0):
            bad("max_blocks_per_request", "must be a non-negative integer or None")
        if self.max_memory_percent is not None and not 0 < self.max_memory_percent <= 1:
            bad("max_memory_percent", "must be in (0, 1]")
        for name in ("q_padding_interval_size", "kv_padding_interval_size", "max_queue_size"):
            if not _is_int(v := getattr(self, name)) or v < 0:
                bad(name, "must be a non-negative integer")
        if self.default_compile_level not in (0, 1, 2, 3):
            bad("default_compile_level", "must be 0, 1, 2 or 3")
        for name in ("varlen_compile_config", "decode_compile_config"):
            try:
                CompileSettings.from_any(getattr(self, name))
            except (TypeError, ValueError) as e:
                bad(name, str(e))
        if self.scheduler_type not in SCHEDULERS:
            bad("scheduler_type", f"must be one of {SCHEDULERS}")
        if self.safety_margin is not None and not 0 <= self.safety_margin < 1:
            bad("safety_margin", "must be in [0, 1)")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer or None")
        cg = self.use_cuda_graph
        if not (cg is None or isinstance(cg, bool)
                or (isinstance(cg, (tuple, list)) and len(cg) == 2 and all(isinstance(x, bool) for x in cg))):
            bad("use_cuda_graph", "must be None, a bool or a pair of bools")
        if self.cpu_offload_space is not None and self.cpu_offload_space < 0:
            bad("cpu_offload_space", "must be >= 0 or None")
        if not 0 <= self.cpu_offload_space_safety_threshold <= 1:
            bad("cpu_offload_space_safety_threshold", "must be in [0, 1]")
        if self.cpu_group_timeout is not None and self.cpu_group_timeout <= 0:
            bad("cpu_group_timeout", "must be positive or None")
        if not _is_int(self.decode_burst) or self.decode_burst < 1:
            bad("decode_burst", "must be a positive integer")
        if self.max_weight_lag is not None and not (_is_int(self.max_weight_lag) and self.max_weight_lag >= 0):
            bad("max_weight_lag", "must be a non-negative integer or None")
        if self.stale_policy not in STALE_POLICIES:
            bad("stale_policy", f"must be one of {STALE_POLICIES}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            bad("logprobs_mode", f"must be one of {LOGPROBS_MODES}")
        SpeculativeConfig.from_any(self.speculative)  # SpeculativeConfigError (a ValueError) naming the field

    @classmethod
    def from_any(cls, obj: Any) -> "ContinuousBatchingConfig":
        """Accept ours, transformers' own ContinuousBatchingConfig, a dict, or None."""
        if obj is None or isinstance(obj, cls):
            return cls() if obj is None else obj
        if isinstance(obj, dict):
            data = dict(obj)
        else:  # transformers' class or anything with the same attributes
            data = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}
            # transformers already applied its deprecations; do not warn twice
            for name in ("use_default_compile_configs", "max_cached_graphs", "block_size"):
                data.pop(name, None)
            if "page_size" not in data and getattr(obj, "block_size", None) is not None:
                data["page_size"] = obj.block_size  # transformers before page_size existed (5.17 ...)
        if unknown := set(data) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"ContinuousBatchingConfig: unknown field(s) {sorted(unknown)}")
        return cls(**data)


@dataclass
class ResolvedConfig:
    """The numbers every rank sizes itself from; identical on all ranks once the cache size is agreed."""

    device_kind: str  # "cpu" or "cuda"
    page_size: int
    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int
    max_model_len: int
    max_blocks_per_request: int
    q_padding: int
    kv_padding: int
    use_cuda_graph: tuple[bool, bool]
    attention: str  # the attention path (ATTENTION_PATHS), from `attention_decision`
    scheduler_type: str
    allow_block_sharing: bool
    safety_margin: float
    cpu_group_timeout: float | None
    notes: list[str] = field(default_factory=list)
    # torch.compile settings of the varlen (prefill, mixed) and decode forwards; None: eager (`compile_decision`)
    varlen_compile: CompileSettings | None = None
    decode_compile: CompileSettings | None = None
    attn_chunk_elements: int = ATTN_CHUNK_ELEMENTS["cpu"]  # a paged SDPA chunk's gather: bounds the attention workspace
    # the pinned host pool's pages for preempted requests' KV (cpu_offload_space; 0: recompute); the group's minimum
    num_host_blocks: int = 0
    overlap: bool = False  # use_async_batching: step N+1 is scheduled, broadcast and prepared while step N runs
    decode_burst: int = 1  # the most forwards one decode-only plan runs; 1 unless overlap is on
    speculative: SpeculativeConfig | None = None  # speculative decoding (docs/speculative.md); None: off

    @property
    def paged_kernels(self) -> bool:
        """Attention runs kernels that read the pages through block tables (flash-attn's or our Triton kernel):
        the steps carry block tables, kv lens and cu_seqlens instead of [B, L] slot lists and padded query grids."""
        return self.attention in PAGED_KERNELS

    @property
    def max_tokens_padded(self) -> int:
        """The largest token count a step's static buffers must hold."""
        return round_up(self.max_batch_tokens, self.q_padding) + next_pow2(self.max_requests_per_batch)

    @property
    def max_kv_padded(self) -> int:
        return round_up(self.max_model_len, self.kv_padding)


def round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple if multiple > 1 else x


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def resolve_config(cfg: ContinuousBatchingConfig, *, device_kind: str, max_model_len: int,
                   kv_bytes_per_token: int, free_bytes: int | None, flash_available: bool,
                   dtype: Any = None, head_dim: int | None = None, system_ram: int | None = None,
                   triton_available: bool = False) -> ResolvedConfig:
    """Fill in what the user left to us. `kv_bytes_per_token`: this rank's K+V bytes per token, all layers;
    `system_ram` (None: unknown) caps the host KV pool; `dtype`, `head_dim` and what imports (`flash_available`,
    `triton_available`) decide the attention path (`attention_decision`; dtype or head_dim left out: paged SDPA).
    A computed `num_blocks` is this rank's proposal: the group takes the minimum (`agree_min`)."""
    notes: list[str] = []
    page = cfg.page_size
    max_batch_tokens = cfg.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS[device_kind]
    max_requests = cfg.max_requests_per_batch or DEFAULT_MAX_REQUESTS_PER_BATCH[device_kind]
    max_requests = min(max_requests, max_batch_tokens)  # a request needs at least one token per step
    max_blocks = math.ceil(max_model_len / page)
    if cfg.max_blocks_per_request:
        max_blocks = min(max_blocks, cfg.max_blocks_per_request)
        max_model_len = min(max_model_len, max_blocks * page)
    num_blocks = cfg.num_blocks
    if num_blocks is None:
        if device_kind == "cpu" and cfg.max_memory_percent is None:
            budget = CPU_KV_CACHE_BYTES
        else:
            budget = int((free_bytes or 0) * (cfg.max_memory_percent if cfg.max_memory_percent is not None else 0.9))
        # never more than every request at full length could use
        num_blocks = min(max(1, budget // (kv_bytes_per_token * page)), max_requests * max_blocks)
    graphs = graph_decision(cfg.use_cuda_graph, device_kind, notes)
    attention, attention_note = attention_decision(
        device_kind=device_kind, flash_available=flash_available, triton_available=triton_available,
        wanted=cfg.auto_switch_to_flash, dtype=dtype, head_dim=head_dim, page_size=page)
    notes += [attention_note] if attention_note else []
    # overlapped scheduling hides the host's step work behind an asynchronous forward; the CPU's forward is
    # synchronous, so there it would only add one collective a step
    overlap = cfg.use_async_batching if cfg.use_async_batching is not None else device_kind == "cuda"
    burst = cfg.decode_burst if overlap else 1
    if cfg.decode_burst > 1 and not overlap:
        notes.append(f"decode_burst {cfg.decode_burst} -> 1: multi-step decode needs overlapped scheduling "
                     "(use_async_batching=True)")
    num_host_blocks = host_pool_pages(cfg, kv_bytes_per_token * page, system_ram, notes)
    varlen_compile, decode_compile, compile_notes = compile_decision(
        cfg.varlen_compile_config, cfg.decode_compile_config, cfg.default_compile_level,
        paged_kernels=attention in PAGED_KERNELS)
    notes += compile_notes
    if graphs[1] and decode_compile is not None and decode_compile.uses_cudagraphs:
        graphs = (False, False)
        notes.append(f"use_cuda_graph -> {graphs}: decode_compile_config mode {decode_compile.mode!r} captures "
                     "the decode forward in inductor's own CUDA graphs (no second capture)")
    return ResolvedConfig(
        device_kind=device_kind, page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests, max_model_len=max_model_len, max_blocks_per_request=max_blocks,
        q_padding=cfg.q_padding_interval_size or (EAGER_CPU_Q_PADDING if device_kind == "cpu" and varlen_compile is None
                                                  else DEFAULT_Q_PADDING[device_kind]),
        kv_padding=cfg.kv_padding_interval_size or DEFAULT_KV_PADDING[device_kind],
        use_cuda_graph=graphs, attention=attention, scheduler_type=cfg.scheduler_type,
        allow_block_sharing=cfg.allow_block_sharing,
        safety_margin=cfg.safety_margin if cfg.safety_margin is not None else 0.0,
        cpu_group_timeout=cfg.cpu_group_timeout, notes=notes, attn_chunk_elements=ATTN_CHUNK_ELEMENTS[device_kind],
        num_host_blocks=num_host_blocks, overlap=bool(overlap), decode_burst=burst, varlen_compile=varlen_compile,
        decode_compile=decode_compile, speculative=SpeculativeConfig.from_any(cfg.speculative))


GIB = 1 << 30


def host_pool_pages(cfg: ContinuousBatchingConfig, page_bytes: int, system_ram: int | None, notes: list[str]) -> int:
    """Pages of the host KV pool: cpu_offload_space GiB (0: off), capped at its safety threshold of the RAM."""
    want = int((cfg.cpu_offload_space or 0) * GIB)
    if want and system_ram is not None and want > cfg.cpu_offload_space_safety_threshold * system_ram:
        capped = int(cfg.cpu_offload_space_safety_threshold * system_ram)
        notes.append(f"cpu_offload_space -> {capped / GIB:.2f} GiB: capped at "
                     f"cpu_offload_space_safety_threshold={cfg.cpu_offload_space_safety_threshold} of the RAM")
        want = capped
    pages = want // page_bytes if page_bytes > 0 else 0
    if want and not pages:
        notes.append("cpu_offload_space -> 0: smaller than one KV page; preemption recomputes")
    return pages


def graph_decision(asked: bool | tuple[bool, bool] | None, device_kind: str, notes: list[str]) -> tuple[bool, bool]:
    """(varlen, decode) CUDA graphs that will run; why any asked for will not goes to `notes`. None: "where it
    can", decode graphs on CUDA. Only the decode step is captured; prefill and mixed steps always run eagerly."""
    pair = (asked, asked) if isinstance(asked, bool) else tuple(asked) if asked is not None else None
    if device_kind != "cuda":
        if pair and any(pair):
            notes.append("use_cuda_graph -> (False, False): no CUDA device")
        return (False, False)
    pair = (False, True) if pair is None else pair
    resolved = (False, bool(pair[1]))
    if any(pair):
        notes.append(f"use_cuda_graph -> {resolved}: only the decode step is captured (one graph a batch bucket, "
                     "powers of two); prefill and mixed steps run eagerly")
    return resolved


ATTENTION_PATHS = ("flash_attn", "triton_paged", "paged_sdpa")  # in order of preference
PAGED_KERNELS = ("flash_attn", "triton_paged")  # the paths whose kernels read the pages through block tables
FLASH_DTYPES = ("float16", "bfloat16")
FLASH_MAX_HEAD_DIM, FLASH_PAGE_MULTIPLE = 256, 256  # flash-attn's paged kernels: head_dim at most, page_size's multiple
TRITON_DTYPES = ("float16", "bfloat16", "float32")
TRITON_MAX_HEAD_DIM = 256  # its tiles hold a query block and a key block of the head dim padded to a power of two


def _why_not_flash(flash_available: bool, wanted: bool, name: str | None, head_dim: int | None,
                   page_size: int) -> str | None:
    """Why flash-attn cannot serve (None: it can): CUDA, importable, float16/bfloat16, head_dim <= 256 and
    page_size % 256 == 0 for its paged kernels."""
    if not wanted:
        return "flash-attn off: auto_switch_to_flash=False"
    if not flash_available:
        return "flash-attn not importable"
    if name not in FLASH_DTYPES:
        return f"flash-attn off: it runs float16/bfloat16 only, the model is {name or 'of unknown dtype'}"
    if head_dim is None or head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash-attn off: it needs head_dim <= {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    if page_size % FLASH_PAGE_MULTIPLE:
        return f"flash-attn off: its paged kernels need page_size % {FLASH_PAGE_MULTIPLE} == 0, got {page_size}"
    return None


def attention_decision(*, device_kind: str, flash_available: bool, triton_available: bool, wanted: bool,
                       dtype: Any, head_dim: int | None, page_size: int) -> tuple[str, str | None]:
    """The attention path (ATTENTION_PATHS) and, on CUDA, the note that says which and why. flash-attn's paged
    kernels where they import and fit (`_why_not_flash`; `wanted`: auto_switch_to_flash); else our Triton kernel
    (worker/triton_attention.py: any of float16/bfloat16/float32, head_dim <= 256, any page size) where Triton
    imports; else the paged SDPA attention (worker/attention.py), always on the CPU, where nothing is noted."""
    if device_kind != "cuda":
        return "paged_sdpa", None
    name = None if dtype is None else str(dtype).removeprefix("torch.")
    why = _why_not_flash(flash_available, wanted, name, head_dim, page_size)
    if why is None:
        return "flash_attn", (f"attention -> flash_attn: flash-attn's paged kernels ({name}, head_dim {head_dim}, "
                              f"page_size {page_size})")
    if not triton_available:
        return "paged_sdpa", f"attention -> paged_sdpa: {why}, and Triton is not importable"
    if name not in TRITON_DTYPES or head_dim is None or head_dim > TRITON_MAX_HEAD_DIM:
        return "paged_sdpa", (f"attention -> paged_sdpa: {why}, and the Triton kernel needs "
                              f"float16/bfloat16/float32 and head_dim <= {TRITON_MAX_HEAD_DIM} "
                              f"(the model is {name or 'of unknown dtype'}, head_dim {head_dim})")
    return "triton_paged", (f"attention -> triton_paged: {why}; Lockstep's Triton kernel reads the pages in place "
                            f"({name}, head_dim {head_dim}, page_size {page_size})")


def read_preset(preset: dict | str | os.PathLike | None) -> dict[str, Any]:
    """A preset as a dict: given as one (as the Ray launcher ships it), read from a TOML path, or empty."""
    if preset is None or isinstance(preset, dict):
        return preset or {}
    with open(preset, "rb") as f:
        return tomllib.load(f)


def load_preset(path: str | os.PathLike) -> ContinuousBatchingConfig:
    """Read a TOML preset from configs/: its [continuous_batching] table holds config fields."""
    return ContinuousBatchingConfig.from_any(read_preset(path).get("continuous_batching", {}))


# ---------------------------------------------------------------- weight pushes ([serve] push_timeout_s)
PUSH_TIMEOUT_S = 30.0  # a push member silent this long: every rank gives up (keep it below cpu_group_timeout)


# ---------------------------------------------------------------- a MoE model's experts ([model] experts)
EXPERT_PLACEMENTS = ("tensor_parallel", "expert_parallel")


def expert_parallel(model_table: dict[str, Any] | None) -> bool:
    """[model] `experts`: "tensor_parallel" (the default: every rank holds a slice of every expert) or
    "expert_parallel" (every rank holds E / tp whole experts); docs/models.md. Dense models ignore it."""
    placement = (model_table or {}).get("experts", "tensor_parallel")
    if placement not in EXPERT_PLACEMENTS:
        raise ValueError(f"[model] experts = {placement!r}: expected one of {EXPERT_PLACEMENTS}")
    return placement == "expert_parallel"


# ---------------------------------------------------------------- which code serves the model ([model] impl)
MODEL_IMPLS = ("auto", "native", "generic")


def model_impl(model_table: dict[str, Any] | None) -> str:
    """[model] `impl`: "auto" (the default: a native family where the model_type has one, else the generic path
    through transformers' modelling code), "native" or "generic" (docs/models.md, "The generic path")."""
    impl = (model_table or {}).get("impl", "auto")
    if impl not in MODEL_IMPLS:
        raise ValueError(f"[model] impl = {impl!r}: expected one of {MODEL_IMPLS}")
    return impl
