"""Shared fixtures: tiny random checkpoints written by the tests, and the shipped demo pair."""

from __future__ import annotations

import os

import torch

# Triton decides at its first import whether to interpret; transformers imports it early through
# torch._dynamo, so the choice must be made before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import shutil
from pathlib import Path

import pytest
import torch

from dspark.demo import demo_path, heldout_prompts_path
from dspark.models.checkpoint import save_model
from dspark.models.config import ModelConfig
from dspark.models.decoder import DecoderLM
from dspark.training.lm_training import _COMMON
from dspark.training.prompts import load_prompts


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
    json.loads((path / "config.json").read_text())
    return path


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, drafter): random Qwen3 and Llama checkpoints; peaked logits (std 0.2)."""
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_checkpoint(root / "target", "qwen3", layers=2, seed=1, std=0.2)
    drafter = write_tiny_checkpoint(root / "drafter", "llama", layers=1, seed=2, std=0.2)
    return target, drafter


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    return load_prompts(heldout_prompts_path())
