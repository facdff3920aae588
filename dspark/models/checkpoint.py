"""Hugging Face-format checkpoint directories: config.json + single or sharded safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dspark.models.config import ModelConfig
from dspark.models.decoder import DecoderLM

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, single-file or sharded by an index."""
    path = Path(path)
    if (path / _INDEX).exists():
        index = json.loads((path / _INDEX).read_text())
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(load_file(str(path / shard)))
        return state
    if (path / _SINGLE).exists():
        return load_file(str(path / _SINGLE))
    raise FileNotFoundError(f"no {_SINGLE} or {_INDEX} in {path}")


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DecoderLM:
    """Build a `DecoderLM` from an HF directory; every parameter must be present (strict)."""
    config = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = DecoderLM(config)
    state = {
        k: v for k, v in read_state_dict(path).items() if not k.endswith("rotary_emb.inv_freq")
    }
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=True, assign=True)
    # The rotary buffer is not a parameter: rebuild it on the real device, after the dtype cast,
    # so inv_freq stays float32 as in transformers (a bf16 inv_freq shifts every RoPE angle).
    rotary_cls = type(model.rotary)
    del model.rotary
    model = model.to(device=device, dtype=dtype).eval()
    model.rotary = rotary_cls(config).to(device)
    return model


def save_model(
    model: DecoderLM,
    raw_config: dict[str, Any],
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write `config.json` and `model.safetensors` loadable by transformers' Auto classes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(raw_config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {
        k: v.detach().to(dtype).contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith("rotary.")
    }
    save_file(state, str(path / _SINGLE), metadata={"format": "pt"})
