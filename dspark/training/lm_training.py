"""Train the demo causal LMs (the target and the independent draft model) on the stdlib corpus."""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark.models.checkpoint import save_model
from dspark.models.config import ModelConfig
from dspark.models.decoder import DecoderLM
from dspark.models.tokenizer import Tokenizer
from dspark.training.corpus import SEPARATOR, read_texts

_COMMON: dict[str, Any] = {
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": None,
}

# Sizes: the draft model costs ~1/6 of the target per token (non-embedding FLOPs + LM head).
PRESETS: dict[str, dict[str, Any]] = {
    "target": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "draft-model": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "mlp_bias": False,
    },
}


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one LM training run."""

    preset: str = "target"
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 250
    eval_windows: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: {self.preset!r} is not one of {sorted(PRESETS)}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


def encode_corpus(tokenizer_dir: str | Path, held_out: bool) -> torch.Tensor:
    """All texts of one split as one token stream, files separated by the EOS token. [num_tokens]"""
    tok = Tokenizer(tokenizer_dir)
    sep = tok.eos_token_id
    assert sep is not None, f"{SEPARATOR} missing from the tokenizer"
    ids: list[int] = []
    for text in read_texts(held_out):
        ids.extend(tok.encode(text))
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.int32)


def _windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()]).long()


def lm_loss(model: DecoderLM, batch: torch.Tensor) -> torch.Tensor:
    h, _ = model.forward_dense(batch[:, :-1])
    logits = model.compute_logits(h).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(model: DecoderLM, stream: torch.Tensor, cfg: TrainConfig) -> float:
    gen = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.eval_windows,), generator=gen)
    batch = _windows(stream, starts, cfg.seq_len)
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [lm_loss(model, b).item() for b in batch.split(cfg.batch_size)]
    model.train()
    return sum(losses) / len(losses)


def train_lm(tokenizer_dir: str | Path, out_dir: str | Path, cfg: TrainConfig) -> dict[str, Any]:
    """Train one preset and write an HF directory (weights, config, tokenizer, training log)."""
    torch.manual_seed(cfg.seed)
    tok = Tokenizer(tokenizer_dir)
    raw = {**_COMMON, **PRESETS[cfg.preset], "vocab_size": tok.vocab_size}
    raw["eos_token_id"] = tok.eos_token_id
    model = DecoderLM(ModelConfig.from_dict(raw))
    _init_weights(model)
    train_stream = encode_corpus(tokenizer_dir, held_out=False)
    eval_stream = encode_corpus(tokenizer_dir, held_out=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    log: dict[str, Any] = {
        "preset": cfg.preset,
        "config": cfg.__dict__,
        "train_loss": [],
        "eval": [],
    }
    log["num_params"] = sum(p.numel() for p in model.parameters())
    log["train_tokens_available"] = len(train_stream)
    start = time.time()
    bar = tqdm(range(cfg.steps), desc=f"train {cfg.preset}", unit="step")
    for step in bar:
        lr = cfg.lr * _schedule(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            0, len(train_stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, _windows(train_stream, starts, cfg.seq_len))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log["train_loss"].append(round(loss.item(), 4))
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            log["eval"].append(
                {"step": step + 1, "held_out_loss": held_out_loss(model, eval_stream, cfg)}
            )
    log["train_seconds"] = round(time.time() - start, 1)
    log["held_out_loss"] = log["eval"][-1]["held_out_loss"]
    out = Path(out_dir)
    save_model(model, raw, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    summary = {k: v for k, v in log.items() if k != "train_loss"}
    (out / "training_log.json").write_text(json.dumps(summary, indent=2) + "\n")
    return log


def _schedule(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _init_weights(model: DecoderLM) -> None:
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * model.config.num_hidden_layers)
            torch.nn.init.normal_(p, std=std)
