"""DSpark drafter checkpoints: HF-style directories in DeepSpec's layout.

`Qwen3DSparkModel.save_pretrained` in DeepSpec writes config.json (the target's Qwen3 config plus
the drafter fields, see `DSparkConfig`) and model.safetensors with every parameter, the frozen
embedding and LM head included. We read and write the same; loading takes the embedding and LM
head from the target when its directory is given (they are the target's by construction).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dspark.draft_worker.dspark_model import STS_FIELD, DSparkConfig, DSparkDrafter
from dspark.models.checkpoint import read_state_dict
from dspark.models.rope import RotaryEmbedding

_WEIGHTS = "model.safetensors"
_SHARED = ("embed_tokens.weight", "lm_head.weight")


def target_embeddings(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """The target's input embedding and LM head (tied checkpoints: the embedding twice)."""
    state = read_state_dict(target_dir)
    embed = state["model.embed_tokens.weight"]
    return {"embed_tokens.weight": embed, "lm_head.weight": state.get("lm_head.weight", embed)}


def new_drafter(
    target_dir: str | Path,
    *,
    block_size: int = 7,
    num_draft_layers: int = 2,
    target_layer_ids: Sequence[int] = (1,),
    mask_token_id: int = 0,
    markov_rank: int = 256,
    num_anchors: int = 512,
    std: float = 0.02,
    seed: int = 0,
) -> DSparkDrafter:
    """A freshly initialised drafter for a target: random layers and heads (normal(0, std), as
    HF's init; DeepSpec starts from random layers too), the target's embedding and LM head
    copied and frozen."""
    target_raw = json.loads((Path(target_dir) / "config.json").read_text())
    config = DSparkConfig.for_target(
        target_raw,
        block_size=block_size,
        num_draft_layers=num_draft_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        markov_rank=markov_rank,
        num_anchors=num_anchors,
    )
    torch.manual_seed(seed)
    model = DSparkDrafter(config)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    with torch.no_grad():
        for name, tensor in target_embeddings(target_dir).items():
            model.get_parameter(name).copy_(tensor)
    model.freeze_embeddings()
    return model


def load_drafter(
    path: str | Path,
    target_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DSparkDrafter:
    """A drafter directory (config.json + safetensors, DeepSpec names); strict.

    Embedding and LM head come from `target_dir` when given (the drafter's copies, which
    DeepSpec also stores, must then have the same shapes), else from the drafter's directory.
    """
    config = DSparkConfig.from_dir(path)
    with torch.device("meta"):
        model = DSparkDrafter(config)
    state = {
        k: v for k, v in read_state_dict(path).items() if not k.endswith("rotary_emb.inv_freq")
    }
    if target_dir is not None:
        shared = target_embeddings(target_dir)
        for name, tensor in shared.items():
            if name in state and state[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: drafter {tuple(state[name].shape)} != target {tuple(tensor.shape)}"
                )
        state.update(shared)
    missing = [n for n in _SHARED if n not in state]
    if missing:
        raise ValueError(f"{path} lacks {missing}: pass the target directory")
    model.load_state_dict(state, strict=True, assign=True)
    # Rebuild the non-persistent buffers on the device after the cast (RoPE stays float32).
    del model.rotary
    model = model.to(device=device, dtype=dtype).eval()
    model.rotary = RotaryEmbedding(config.layers).to(device)
    model.sts_temperatures = DSparkDrafter._sts_tensor(config).to(device)
    model.freeze_embeddings()
    return model


def save_sts_temperatures(path: str | Path, temps: Sequence[float] | None) -> None:
    """Store (or clear, with None) the STS temperatures in a drafter's config.json."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text())
    raw.pop(STS_FIELD, None)
    if temps is not None:
        raw[STS_FIELD] = [float(t) for t in temps]
    DSparkConfig.from_dict(raw)  # validates
    file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def save_drafter(
    model: DSparkDrafter,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    include_embeddings: bool = True,
) -> None:
    """Write config.json and model.safetensors in DeepSpec's layout (which keeps the frozen
    embedding and LM head: `include_embeddings=False` drops them, then loading needs the target)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = model.config.to_dict()
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    state = {
        k: v.detach().to(dtype).contiguous()
        for k, v in model.state_dict().items()
        if include_embeddings or k not in _SHARED
    }
    save_file(state, str(path / _WEIGHTS), metadata={"format": "pt"})
