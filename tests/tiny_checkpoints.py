"""Checkpoints the tests write: tiny random-weight HF directories sharing the demo tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dspark.demo import demo_path
from dspark.models.checkpoint import save_model
from dspark.models.config import ModelConfig
from dspark.models.decoder import DecoderLM
from dspark.training.lm_training import _COMMON


def write_tiny_checkpoint(
    path: Path, arch: str = "qwen3", layers: int = 2, hidden: int = 64, seed: int = 0,
    std: float = 0.02,
) -> Path:
    """A random-weight HF checkpoint sharing the demo tokenizer (vocab 4096)."""
    tok_dir = demo_path("draft-model")
    raw = {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": 4096,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "eos_token_id": 0,
    }
    torch.manual_seed(seed)
    model = DecoderLM(ModelConfig.from_dict(raw))
    for p in model.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=std)
    save_model(model, raw, path, dtype=torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, path / name)
    return path


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return ((ours - ref).abs().max() / ref.abs().max()).item()
