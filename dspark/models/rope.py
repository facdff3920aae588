"""Rotary position embeddings with the scaling types Llama and Qwen3 configs use."""

from __future__ import annotations

import math

import torch

from dspark.models.config import ModelConfig, RopeConfig


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2], attention_factor) for `rope`.

    `dynamic` NTK scaling only changes frequencies beyond `max_position_embeddings`; the engine
    never runs past that length, so inside it dynamic equals default (and stays cache-consistent).
    """
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope, max_positions), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_positions)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_positions
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    # YaRN (Peng et al. 2023): interpolate low frequencies, extrapolate high ones, ramp between.
    base, factor = rope.theta, rope.factor
    old_len = rope.original_max_position_embeddings or max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = inverse_frequencies(
            config.rope, config.head_dim, config.max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: tuple[int, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [..., head_dim] for `positions` [...]."""
        # Computed per call in float32 like the reference implementations; tables would round
        # differently from them by an ulp and break parity at 1e-4 only on very long contexts.
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (
            emb.sin() * self.attention_factor
        ).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos/sin: [..., head_dim] (same leading dims as x)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)
