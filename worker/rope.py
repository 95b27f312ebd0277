"""Rotary position embedding: a cos/sin table indexed by position, gathered once a step for its positions.

Default RoPE and llama3 scaling only; any other `rope_type` is refused by name."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE = ("default", "llama3")


def rope_parameters(config) -> dict:
    """The rope settings whichever way the config spells them (transformers 5 `rope_parameters` or older)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    params = rope_parameters(config)
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE:
        raise ValueError(f"rope_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "llama3":
        factor, old_len = params["factor"], params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RotaryTable(torch.nn.Module):
    """cos and sin for every position up to max_positions, float32, looked up by index."""

    def __init__(self, config, head_dim: int, max_positions: int, device: torch.device):
        super().__init__()
        inv = inverse_frequencies(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> "StepRotary":
        """The step's cos/sin, gathered once for its positions (every layer reuses them)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        return StepRotary(cos=cos, signed_sin=torch.cat([-sin[..., :half], sin[..., half:]], dim=-1))


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

