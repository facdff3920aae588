"""Train a DSpark drafter online against its target (DESIGN.md §5; DeepSpec's DSpark trainer).

The target runs in the loop: each step takes token windows of the stdlib corpus, runs the
frozen target once (`forward_dense` with the drafter's hidden layers) and trains the drafter on
many blocks per window. For an anchor position a: context = the target's hidden rows of
positions < a; block input [window[a], MASK×(γ−1)] at positions a..a+γ−1; slot k's label is
window[a+k+1] and its target distribution p_t the target's softmax at position a+k; the Markov
head is teacher-forced (prev = [window[a], labels[:−1]]).

Loss (weighted means, position weights w_k = exp(−k/4), k from 0, as DeepSpec's code):
    0.1·CE(labels) + 0.9·‖p_d − p_t‖₁ + 1.0·BCE(σ(z_k), 1 − ½‖p_d − p_t‖₁)
with p_d the softmax of the Markov-corrected logits and the confidence label detached.
No multi-terabyte target cache: hidden states are recomputed every step.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark.draft_worker.dspark_checkpoint import load_drafter, new_drafter, save_drafter
from dspark.draft_worker.dspark_model import DSparkDrafter
from dspark.models.checkpoint import load_model
from dspark.models.decoder import DecoderLM
from dspark.training.block_eval import block_hidden, eval_blocks, sample_anchors, sample_windows
from dspark.training.lm_training import encode_corpus
from dspark.training.target_samples import sample_continuations

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Settings of one drafter training run."""

    steps: int = 850  # optimizer steps (the shipped demo drafter: 850, ~21 min on one core)
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # tokens per window
    num_anchors: int = 32  # blocks per window (DeepSpec: 512 per 4096 tokens, the same density)
    block_size: int = 7  # γ
    num_draft_layers: int = 2
    target_layer_ids: tuple[int, ...] = (1, 3, 5)
    markov_rank: int = 128
    mask_token_id: int | None = None  # None: the rarest token of the training stream
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    loss_decay_gamma: float = 4.0  # position weights exp(−k/γ_decay)
    eval_every: int = 200  # held-out τ every this many steps (and at the end)
    eval_windows: int = 64  # held-out windows × 4 anchors each
    checkpoint_every: int = 100  # resumable state every this many steps
    autocast_bf16: bool = True  # bf16 autocast on CPU (weights and optimizer stay float32)
    seed: int = 0
    # Share of each step's windows taken from the target's own T = 1 continuations of corpus
    # prompts (the context a drafter serving sampled requests sees) instead of corpus text; the
    # pool of `sampled_windows` continuations is sampled once and kept with the run's state.
    sampled_fraction: float = 0.0
    sampled_windows: int = 4096
    sampled_prompt_len: int = 32
    # Start from this drafter's weights (same shapes, its mask token) instead of random ones;
    # the step count and learning-rate schedule start afresh. The shipped demo drafter continues
    # its first run this way.
    init_from: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "num_anchors",
            "block_size",
            "num_draft_layers",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError(f"sampled_fraction: must be in [0, 1], got {self.sampled_fraction}")
        if self.sampled_fraction and not 0 < self.sampled_prompt_len < self.seq_len:
            raise ValueError(
                f"sampled_prompt_len={self.sampled_prompt_len}: must be in (0, seq_len)")
        if self.seq_len - self.block_size - 2 < self.num_anchors:
            raise ValueError(f"num_anchors={self.num_anchors}: too many for seq_len={self.seq_len}")


def _check_same_shape(drafter: DSparkDrafter, init: DSparkDrafter, path: str | None) -> None:
    mine = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in init.state_dict().items()}
    if mine != theirs:
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise ValueError(f"init_from={path}: shapes differ from this run's drafter at {diff[:4]}")
    if init.config.block_size != drafter.config.block_size or (
        init.config.target_layer_ids != drafter.config.target_layer_ids
    ):
        raise ValueError(f"init_from={path}: block_size or target_layer_ids differ from this run's")


def position_weights(gamma: int, decay: float) -> torch.Tensor:  # [γ]
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / decay)


def drafter_loss(
    target: DecoderLM,
    drafter: DSparkDrafter,
    window: torch.Tensor,
    anchors: torch.Tensor,
    cfg: DrafterTrainConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training objective on `window` [B, S] with anchors [B, N]; returns (loss, metrics)."""
    gamma = drafter.config.block_size
    offsets = torch.arange(gamma)
    with torch.no_grad():
        final, hidden = target.forward_dense(window, hidden_layers=drafter.config.target_layer_ids)
        # p_t of slot k: the target at position a + k predicts window[a + k + 1].
        at = anchors[..., None] + offsets  # [B, N, γ]
        t_logits = target.compute_logits(final[torch.arange(window.shape[0])[:, None, None], at])
        p_t = torch.softmax(t_logits.float(), dim=-1)
    h, anchor_tokens = block_hidden(drafter, hidden, window, anchors)  # [B, N, γ, d]
    labels = window.gather(1, (at + 1).flatten(1)).view_as(at)
    prev = torch.cat([anchor_tokens[..., None], labels[..., :-1]], dim=-1)  # teacher forcing
    logits = (drafter.base_logits(h) + drafter.markov_bias(prev)).float()
    log_p_d = torch.log_softmax(logits, dim=-1)
    l1 = (log_p_d.exp() - p_t).abs().sum(-1)  # [B, N, γ]
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(l1)
    w = position_weights(gamma, cfg.loss_decay_gamma).expand_as(l1)

    def wmean(x: torch.Tensor) -> torch.Tensor:
        return (x * w).sum() / w.sum()

    loss = cfg.ce_alpha * wmean(ce) + cfg.l1_alpha * wmean(l1)
    metrics = {"ce": wmean(ce).item(), "l1": wmean(l1).item()}
    z = drafter.confidence_logits(h, prev)
    c_star = (1 - 0.5 * l1).detach().clamp(0, 1)
    if z is not None:
        bce = F.binary_cross_entropy_with_logits(z, c_star, reduction="none")
        loss = loss + cfg.confidence_alpha * wmean(bce)
        metrics["bce"] = wmean(bce).item()
    # DeepSpec's `tau_probabilistic`: 1 + Σ_k Π_{i≤k} c*_i under teacher forcing.
    metrics["tau_prob"] = 1 + c_star.cumprod(-1).sum(-1).mean().item()
    metrics["loss"] = loss.item()
    return loss, metrics


def rarest_token(stream: torch.Tensor, vocab: int) -> int:
    """The least frequent token id (lowest id on ties): the demo's MASK (its frozen embedding)."""
    counts = torch.bincount(stream.long(), minlength=vocab)
    return int(torch.argmin(counts))


def _schedule(step: int, cfg: DrafterTrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _state_path(out: Path) -> Path:
    return out / "train_state" / "state.pt"


def sampled_pool(target_dir: str | Path, out: Path, stream: torch.Tensor,
                 cfg: DrafterTrainConfig) -> torch.Tensor | None:
    """The run's pool of target continuations [sampled_windows, seq_len], made once and kept
    in train_state/ so a resumed run trains on the same pool."""
    if not cfg.sampled_fraction:
        return None
    path = out / "train_state" / "sampled_windows.pt"
    if path.exists():
        pool = torch.load(path, weights_only=True)
        if pool.shape == (cfg.sampled_windows, cfg.seq_len):
            return pool
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = sample_windows(stream, cfg.sampled_windows, cfg.sampled_prompt_len, gen)
    pool = sample_continuations(target_dir, prompts, cfg.seq_len - cfg.sampled_prompt_len,
                                temperature=1.0, seed=cfg.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(pool, path)
    return pool


def training_windows(stream: torch.Tensor, pool: torch.Tensor | None, cfg: DrafterTrainConfig,
                     gen: torch.Generator) -> torch.Tensor:  # [batch_size, seq_len]
    """One step's windows: corpus text, the first round(fraction·B) rows from the pool."""
    window = sample_windows(stream, cfg.batch_size, cfg.seq_len, gen)
    if pool is not None:
        n = round(cfg.sampled_fraction * cfg.batch_size)
        window[:n] = pool[torch.randint(0, len(pool), (n,), generator=gen)]
    return window


def _save_state(
    out: Path,
    drafter: DSparkDrafter,
    opt: torch.optim.Optimizer,
    step: int,
    gen: torch.Generator,
    log: dict[str, Any],
) -> None:
    path = _state_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "step": step,
            "model": drafter.state_dict(),
            "optimizer": opt.state_dict(),
            "generator": gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "log": log,
        },
        tmp,
    )
    tmp.replace(path)  # atomic: an interrupted save leaves the previous state


def train_drafter(
    target_dir: str | Path, out_dir: str | Path, cfg: DrafterTrainConfig, resume: bool = True
) -> dict[str, Any]:
    """Train (or resume) a drafter for `target_dir`; writes an HF directory to `out_dir`."""
    out = Path(out_dir)
    torch.manual_seed(cfg.seed)
    target = load_model(target_dir).eval().requires_grad_(False)
    train_stream = encode_corpus(target_dir, held_out=False)
    eval_stream = encode_corpus(target_dir, held_out=True)
    init = load_drafter(cfg.init_from, target_dir) if cfg.init_from else None
    mask_id = cfg.mask_token_id
    if init is not None:
        mask_id = init.config.mask_token_id
    elif mask_id is None:
        mask_id = rarest_token(train_stream, target.config.vocab_size)
    drafter = new_drafter(
        target_dir,
        block_size=cfg.block_size,
        num_draft_layers=cfg.num_draft_layers,
        target_layer_ids=cfg.target_layer_ids,
        mask_token_id=mask_id,
        markov_rank=cfg.markov_rank,
        num_anchors=cfg.num_anchors,
        seed=cfg.seed,
    )
    if init is not None:
        _check_same_shape(drafter, init, cfg.init_from)
        drafter.load_state_dict(init.state_dict())
        drafter.set_sts_temperatures(None)  # a retrained head needs calibrating again
    pool = sampled_pool(target_dir, out, train_stream, cfg)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    log: dict[str, Any] = {
        "config": asdict(cfg),
        "mask_token_id": mask_id,
        "train": [],
        "eval": [],
        "num_trainable_params": sum(p.numel() for p in params),
        "train_seconds": 0.0,
    }
    step = 0
    if resume and _state_path(out).exists():
        state = torch.load(_state_path(out), weights_only=True)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        step, log = state["step"], state["log"]
        if log["config"] != asdict(cfg):
            # A resumed run may change settings (e.g. more steps): the log keeps every change.
            log.setdefault("resumes", []).append({"step": step, "previous_config": log["config"]})
            log["config"] = asdict(cfg)
        logger.info("resumed from step %d", step)
    bar = tqdm(
        range(step, cfg.steps),
        desc="train dspark drafter",
        unit="step",
        initial=step,
        total=cfg.steps,
    )
    start = time.time() - log["train_seconds"]
    for step in bar:
        lr = cfg.lr * _schedule(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        window = training_windows(train_stream, pool, cfg, gen)
        anchors = sample_anchors(cfg.batch_size, cfg.num_anchors, cfg.seq_len, cfg.block_size, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            loss, metrics = drafter_loss(target, drafter, window, anchors, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        log["train"].append({"step": step + 1, **{k: round(v, 4) for k, v in metrics.items()}})
        bar.set_postfix(
            loss=f"{metrics['loss']:.3f}",
            l1=f"{metrics['l1']:.3f}",
            tau_p=f"{metrics['tau_prob']:.2f}",
        )
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            log["eval"].append({"step": done, **held_out_tau(target, drafter, eval_stream, cfg)})
            logger.info("step %d held-out %s", done, log["eval"][-1])
        log["train_seconds"] = round(time.time() - start, 1)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            _save_state(out, drafter, opt, done, gen, log)
    drafter.eval()
    save_drafter(drafter, out, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, out / name)
    summary = {k: v for k, v in log.items() if k != "train"}
    summary["final_train"] = log["train"][-1] if log["train"] else None
    (out / "training_log.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_training(log, out / "training_loss.png")
    return log


@torch.no_grad()
def held_out_tau(
    target: DecoderLM, drafter: DSparkDrafter, stream: torch.Tensor, cfg: DrafterTrainConfig
) -> dict[str, Any]:
    """τ under greedy verification of full γ-blocks on held-out windows (fixed seed)."""
    was_training = drafter.training
    drafter.eval()
    result = eval_blocks(target, drafter, stream, num_windows=cfg.eval_windows, temperature=0.0)
    drafter.train(was_training)
    return {
        "tau_greedy": round(result.tau, 4),
        "acceptance": [round(a, 4) for a in result.conditional_acceptance()],
    }


def plot_training(log: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log["train"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for key in ("loss", "l1", "ce", "bce"):
        if log["train"] and key in log["train"][0]:
            axes[0].plot(steps, [r[key] for r in log["train"]], lw=0.6, label=key)
    axes[0].set_xlabel("step")
    axes[0].set_yscale("log")
    axes[0].set_title("training losses (weighted means)")
    axes[0].legend()
    axes[1].plot(
        steps, [r["tau_prob"] for r in log["train"]], lw=0.6, label="train τ (probabilistic)"
    )
    if log["eval"]:
        axes[1].plot(
            [e["step"] for e in log["eval"]],
            [e["tau_greedy"] for e in log["eval"]],
            "o-",
            label="held-out τ (greedy, γ=7)",
        )
    axes[1].set_xlabel("step")
    axes[1].set_title("mean accepted length")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
