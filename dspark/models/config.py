"""Model configuration read from a Hugging Face `config.json` (Llama and Qwen3 decoders)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Architecture = Literal["llama", "qwen3"]

_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings: `rope_type` is one of default, linear, dynamic, llama3, yarn."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a decoder-only Llama/Qwen3 config that the forward pass needs."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises queries and keys per head before RoPE."""
        return self.architecture == "qwen3"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
        if arch is None:
            arch = {"llama": "llama", "qwen3": "qwen3"}.get(raw.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(_ARCHITECTURES)}"
            )
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_dict(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    # Older configs carry `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    orig = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and orig:
        # As transformers: a yarn config without `factor` scales from the original context.
        factor = raw.get("max_position_embeddings", orig) / orig
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if orig is None else int(orig),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
