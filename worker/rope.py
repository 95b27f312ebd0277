"""Rotary position embedding: a cos/sin table per rope setting, indexed by position, gathered once a step for the
step's positions. Every value equals what transformers computes for the same config (tests/test_rope.py compares
them bit for bit with transformers' own rotary embedding classes).

API (for a family, or an attention block such as MLA's rope part):

- `rope_parameters(config, layer_type=None) -> dict`: the settings, whichever way the config spells them
  (transformers 5 `rope_parameters`, or the older `rope_scaling` / `rope_theta` / `partial_rotary_factor`
  attributes); those of `layer_type` when the config nests them by layer type (Gemma 3).
- `inverse_frequencies(config, head_dim, layer_type=None) -> Frequencies`: `inv_freq` [rotary_dim / 2] float32
  and `attention_factor`, the factor transformers multiplies cos and sin by (yarn's mscale, longrope's), as
  transformers' `ROPE_INIT_FUNCTIONS[rope_type]` (or a model's default) computes them; `long_inv_freq` and
  `original_max_positions` for longrope. `head_dim`: the rotated head's width before `partial_rotary_factor`
  (MLA: `qk_rope_head_dim`).
- `RotaryTable(config, head_dim, max_positions, device, layer_type=None)`, a module: `.at(positions, dtype)` ->
  `StepRotary` (cos and sin at those positions, attention factor included), whose `.apply(x)` rotates x [T, H, D]
  in the rotate-half convention (a table narrower than D rotates the first columns only: partial rotary).
- `LayerRotary(config, head_dim, max_positions, device)`: one table per distinct setting of the model's layers
  (`rope_keys`); `.at(positions, dtype)` -> the StepRotary of each layer, each table gathered once.
- `yarn_mscale(scale, mscale)`: yarn's magnitude factor (DeepSeek-V3 also scales its softmax by its square).
- `exact_prompt_limit(config)`: the longest prompt served token-identically (longrope: see below), or None.

rope types: default, linear, dynamic, yarn, longrope, llama3; any other is refused by name (UnsupportedModel).
Lockstep serves at most `max_position_embeddings` positions (driver/api/validation.py), which fixes what the
types whose frequencies transformers changes during a forward become here:

- dynamic (NTK): transformers rescales when a forward's last position reaches past `max_position_embeddings`;
  below that its frequencies are the ones it starts with, so the table holds those, and a request that would go
  past is refused by the context check as for every model.
- longrope: transformers uses the long factors in a forward whose last position + 1 exceeds
  `original_max_position_embeddings`, the short ones otherwise. In a greedy `generate` call a decode token at
  position p is then rotated with the long factors exactly when p >= original (a per-position rule: the table's rows
  below `original` hold the short factors' values, the rows from it the long ones'), and so is every prompt token
  when the prompt is longer than `original`, which depends on the request, not the position. The plan does not
  carry that, so such prompts are refused (`exact_prompt_limit`, checked with the request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.errors import UnsupportedModel

SUPPORTED_ROPE = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_keys(config: Any) -> list[str | None]:
    """Per layer, the key of its rope settings: its layer type when `rope_parameters` is nested by layer type
    (transformers' `nested_rope_parameter_keys`), else None (one setting for all)."""
    types = list(getattr(config, "layer_types", None) or [])
    params = getattr(config, "rope_parameters", None) or {}
    if types and any(key in types for key in params):
        return types
    return [None] * config.num_hidden_layers


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """The rope settings (a copy) whichever way the config spells them, with rope_type and rope_theta filled in."""
    top = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        if top.get(layer_type) is None:
            raise UnsupportedModel(f"layers of type {layer_type!r} have no rotary settings (rope_parameters"
                                   f"[{layer_type!r}] is missing or None): layers without RoPE are not supported")
        params = dict(top[layer_type])
    else:
        params = dict(top)
    legacy = getattr(config, "rope_scaling", None) if layer_type is None else None
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", getattr(
            config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    return params


@dataclass
class Frequencies:
    inv_freq: torch.Tensor  # [rotary_dim / 2] float32
    attention_factor: float = 1.0  # cos and sin are multiplied by it
    long_inv_freq: torch.Tensor | None = None  # longrope: from position original_max_positions on
    original_max_positions: int = 0


def _powers(base: float, dim: int) -> torch.Tensor:
    """base ** (2i / dim) for i < dim / 2, float32, as transformers computes it."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn's attention magnitude factor for a context `scale` times the original (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(params: dict, inv: torch.Tensor) -> torch.Tensor:
    factor, old_len = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _dynamic_base(config: Any, params: dict, dim: int) -> float:
    """Dynamic NTK's base at the length transformers starts with (max_position_embeddings): the base itself, up to
    the rounding of transformers' formula, which is kept."""
    factor, length = params["factor"], config.max_position_embeddings
    return params["rope_theta"] * ((factor * length / length) - (factor - 1)) ** (dim / (dim - 2))


def _yarn(config: Any, params: dict, dim: int) -> Frequencies:
    base, factor = params["rope_theta"], params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)) \
            if mscale and mscale_all_dim else yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    # transformers reads `truncate` from the top level of rope_parameters, even when they are nested by layer type
    if (getattr(config, "rope_parameters", None) or {}).get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos = _powers(base, dim)
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return Frequencies(inv, attention)


def _longrope(config: Any, params: dict, dim: int) -> Frequencies:
    base, factor, original = params["rope_theta"], params.get("factor"), params["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def scaled(ext: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** shape)

    return Frequencies(scaled(params["short_factor"]), attention, scaled(params["long_factor"]), original)


def inverse_frequencies(config: Any, head_dim: int, layer_type: str | None = None) -> Frequencies:
    """The inverse frequencies and attention factor of `config`'s rope (of `layer_type`'s, when nested)."""
    params = rope_parameters(config, layer_type)
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE:
        raise UnsupportedModel(f"rope_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if kind == "yarn":
        return _yarn(config, params, dim)
    if kind == "longrope":
        return _longrope(config, params, dim)
    base = _dynamic_base(config, params, dim) if kind == "dynamic" else params["rope_theta"]
    inv = 1.0 / _powers(base, dim)
    if kind == "linear":
        inv /= params["factor"]
    elif kind == "llama3":
        inv = _llama3(params, inv)
    return Frequencies(inv)


def exact_prompt_limit(config: Any) -> int | None:
    """The longest prompt whose rotary values equal transformers' `generate` (longrope: its original length; the
    module docstring says why), or None when every prompt the context holds is exact."""
    settings = [rope_parameters(config, key) for key in dict.fromkeys(rope_keys(config))]
    limits = [p["original_max_position_embeddings"] for p in settings if p["rope_type"] == "longrope"]
    return min(limits) if limits else None


def _half_table(inv: torch.Tensor, positions: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions x inv, times factor: transformers' values (its cos of cat(freqs, freqs) repeats
    these halves)."""
    freqs = positions[:, None] * inv[None, :]
    return freqs.cos() * factor, freqs.sin() * factor


class RotaryTable(nn.Module):
    """cos and sin for every position below max_positions, float32, half the rotary width (the other half repeats
    it), looked up by index."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, device: torch.device,
                 layer_type: str | None = None):
        super().__init__()
        f = inverse_frequencies(config, head_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float32)
        cos, sin = _half_table(f.inv_freq, positions, f.attention_factor)
        if f.long_inv_freq is not None and max_positions > f.original_max_positions:
            at = f.original_max_positions
            cos[at:], sin[at:] = _half_table(f.long_inv_freq, positions[at:], f.attention_factor)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        """The step's cos/sin, gathered once for its positions (every layer of this setting reuses them)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return StepRotary(cos=torch.cat([cos, cos], dim=-1), signed_sin=torch.cat([-sin, sin], dim=-1))


class LayerRotary(nn.Module):
    """The rotary tables of a model's layers: one per distinct setting (`rope_keys`: a layer type, or one for all)."""

    def __init__(self, config: Any, head_dim: int, max_positions: int, device: torch.device):
        super().__init__()
        keys = rope_keys(config)
        self.names = list(dict.fromkeys(keys))  # each table's layer type (None: every layer's)
        self.tables = nn.ModuleList(RotaryTable(config, head_dim, max_positions, device, key) for key in self.names)
        self.table_of = [self.names.index(key) for key in keys]  # per layer, its table

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> list[StepRotary]:
        """Each layer's StepRotary at the step's positions; each table gathered once."""
        step = [table.at(positions, dtype) for table in self.tables]
        return [step[i] for i in self.table_of]


@dataclass
class StepRotary:
    """cos and sin at a step's positions, [T, 1, D]; sin with its first half negated, so that
    rotate_half(x) * sin == x.roll(D / 2, -1) * signed_sin."""

    cos: torch.Tensor
    signed_sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] rotated in the rotate-half convention; with a partial rotary factor (a table narrower
        than D) only the first columns rotate and the rest pass through, as transformers' GLM-4 MoE does."""
        rot = self.cos.shape[-1]
        if rot < x.shape[-1]:
            return torch.cat([self.apply(x[..., :rot]), x[..., rot:]], dim=-1)
        half = rot // 2
        return x * self.cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * self.signed_sin
