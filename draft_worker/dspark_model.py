"""The DSpark drafter (DESIGN.md §5; DeepSeek's DSpark paper, DeepSpec's `Qwen3DSparkModel`).

Terms:
- anchor: the last committed token, not yet seen by the target; it sits at position P, the
  number of context rows.
- context rows: for every committed target position before the anchor, the raw outputs of the
  target layers `target_layer_ids` concatenated (m·d), projected by `fc` (bias-free m·d → d) and
  RMS-normed by `hidden_norm`. In every draft layer they are extra keys/values placed before the
  block's own (K = k_norm(k_proj(row)) with RoPE at the row's position, V = v_proj(row)).
- block: γ = `block_size` inputs [anchor, MASK×(γ−1)] at positions P..P+γ−1, one non-causal pass
  (each slot sees every context row and the whole block); slot k's final-normed hidden h_k gives
  the base logits U_k = lm_head(h_k) of draft token x_{k+1}.
- Markov head: logits_k = U_k + W2(W1[x_{k−1}]) with x_0 the anchor; rank r = `markov_rank`.
- confidence head: c_k = σ((w·[h_k; W1[x_{k−1}]] + b) / T_k), T_k the per-position STS
  temperatures (1 until `dspark calibrate` fits them).
Embedding and LM head are the target's, frozen.

Parameter names and config.json fields follow DeepSpec's released Qwen3 drafters (e.g.
`deepseek-ai/dspark_qwen3_4b_block7`), so their checkpoints load here and ours load there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.config import ModelConfig
from dspark.models.decoder import Attention, DecoderLayer, RMSNorm
from dspark.models.rope import RotaryEmbedding, apply_rotary

MARKOV_HEAD_TYPES = ("vanilla",)
ARCHITECTURE = "Qwen3DSparkModel"
# Our one extension of DeepSpec's config: STS temperatures, one per block position.
STS_FIELD = "confidence_sts_temperatures"

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer: k, v [..., n, kv_heads, hd]


def with_block_room(t: torch.Tensor, width: int) -> torch.Tensor:
    """Context keys or values [B, C, kv_heads, hd] -> [B, kv_heads, C + width, hd]: the layout
    `DSparkDrafter.run_blocks` reads, the last `width` rows left for the block's own."""
    room = t.new_zeros(t.shape[0], width, *t.shape[2:])
    return torch.cat([t, room], dim=1).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class DSparkConfig:
    """A DSpark drafter's config.json: the target's config plus DeepSpec's drafter fields."""

    layers: ModelConfig  # shapes of the draft layers (the target's, with fewer layers)
    block_size: int  # γ: drafts per block; the input is [anchor, MASK×(γ−1)]
    target_layer_ids: tuple[int, ...]  # target layers read as the context (-1: embeddings)
    num_target_layers: int  # layers of the target the drafter was trained against
    mask_token_id: int  # token whose (frozen target) embedding fills the block's masked slots
    markov_rank: int  # r of the Markov head; 0 disables it (plain DFlash)
    markov_head_type: str  # "vanilla": bias W2(W1[x_{k−1}])
    enable_confidence_head: bool  # the drafter predicts conditional acceptance c_k
    confidence_head_with_markov: bool  # the confidence head also reads W1[x_{k−1}]
    num_anchors: int  # training: blocks sampled per sequence
    sts_temperatures: tuple[float, ...] | None = None  # [block_size] STS; None: uncalibrated
    raw: tuple[tuple[str, Any], ...] = ()  # every config.json field, for writing it back

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size}: must be >= 1")
        ids = self.target_layer_ids
        if not ids or any(not (i == -1 or 0 <= i < self.num_target_layers) for i in ids):
            raise ValueError(
                f"target_layer_ids={list(ids)}: each must be -1 or in [0, {self.num_target_layers})"
            )
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"target_layer_ids={list(ids)}: must be strictly increasing")
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id}: outside the vocabulary")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank={self.markov_rank}: must be >= 0")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type={self.markov_head_type!r}: supported {list(MARKOV_HEAD_TYPES)}"
            )
        if (
            self.confidence_head_with_markov
            and self.enable_confidence_head
            and self.markov_rank == 0
        ):
            raise ValueError("confidence_head_with_markov=True needs markov_rank > 0")
        if self.sts_temperatures is not None and (
            len(self.sts_temperatures) != self.block_size or min(self.sts_temperatures) <= 0
        ):
            raise ValueError(
                f"{STS_FIELD}={list(self.sts_temperatures)}: need {self.block_size} values > 0"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DSparkConfig:
        missing = [
            f
            for f in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank")
            if f not in raw
        ]
        if missing:
            raise ValueError(f"not a DSpark drafter config: missing {missing}")
        base = {k: v for k, v in raw.items() if k != "architectures"}
        base.setdefault("model_type", "qwen3")
        conf = bool(raw.get("enable_confidence_head", False))
        sts = raw.get(STS_FIELD)
        return cls(
            layers=ModelConfig.from_dict(base),
            block_size=int(raw["block_size"]),
            target_layer_ids=tuple(int(i) for i in raw["target_layer_ids"]),
            num_target_layers=int(raw.get("num_target_layers", max(raw["target_layer_ids"]) + 1)),
            mask_token_id=int(raw["mask_token_id"]),
            markov_rank=int(raw["markov_rank"]),
            markov_head_type=str(raw.get("markov_head_type", "vanilla")).lower(),
            enable_confidence_head=conf,
            confidence_head_with_markov=conf
            and bool(raw.get("confidence_head_with_markov", False)),
            num_anchors=int(raw.get("num_anchors", 512)),
            sts_temperatures=None if sts is None else tuple(float(t) for t in sts),
            raw=tuple(sorted(raw.items())),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> DSparkConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def for_target(
        cls,
        target_raw: dict[str, Any],
        *,
        block_size: int,
        num_draft_layers: int,
        target_layer_ids: Sequence[int],
        mask_token_id: int,
        markov_rank: int = 256,
        num_anchors: int = 512,
    ) -> DSparkConfig:
        """A new drafter's config from its target's config.json (DeepSpec: `build_draft_config`)."""
        raw = dict(target_raw)
        raw.update(
            architectures=[ARCHITECTURE],
            num_target_layers=int(target_raw["num_hidden_layers"]),
            num_hidden_layers=num_draft_layers,
            block_size=block_size,
            tie_word_embeddings=False,
            layer_types=["full_attention"] * num_draft_layers,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            num_anchors=num_anchors,
            enable_confidence_head=True,
            confidence_head_with_markov=markov_rank > 0,
            markov_rank=markov_rank,
            markov_head_type="vanilla",
        )
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        raw = dict(self.raw)
        raw.pop(STS_FIELD, None)
        if self.sts_temperatures is not None:
            raw[STS_FIELD] = list(self.sts_temperatures)
        return raw


class MarkovHead(nn.Module):
    """DeepSpec's `VanillaMarkov`: bias(prev) = W2(W1[prev]), W1 an embedding of rank r."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def prev_embeddings(self, prev_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., r]
        return self.markov_w1(prev_ids.long())

    def bias(self, prev_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., vocab]
        return self.markov_w2(self.prev_embeddings(prev_ids))


class ConfidenceHead(nn.Module):
    """DeepSpec's `AcceptRatePredictor`: one linear unit; returns the logit z_k."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., in] -> [...]
        return self.proj(features).squeeze(-1)


class DSparkDrafter(nn.Module):
    """Backbone, Markov head and confidence head; state lives with the caller (the proposer)."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = config
        lc = config.layers
        d, m = lc.hidden_size, len(config.target_layer_ids)
        self.embed_tokens = nn.Embedding(lc.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(lc) for _ in range(lc.num_hidden_layers))
        self.norm = RMSNorm(d, lc.rms_norm_eps)
        self.fc = nn.Linear(m * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, lc.rms_norm_eps)
        self.lm_head = nn.Linear(d, lc.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(lc)
        r = config.markov_rank
        self.markov_head = MarkovHead(lc.vocab_size, r) if r > 0 else None
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(
                d + (r if config.confidence_head_with_markov else 0)
            )
        # A plain attribute, not a buffer: kept float32 whatever the weights' dtype.
        self.sts_temperatures = self._sts_tensor(config)

    @staticmethod
    def _sts_tensor(config: DSparkConfig) -> torch.Tensor:  # [block_size] float32
        temps = config.sts_temperatures or (1.0,) * config.block_size
        return torch.tensor(temps, dtype=torch.float32)

    def set_sts_temperatures(self, temps: Sequence[float] | None) -> None:
        self.config = replace(self.config, sts_temperatures=None if temps is None else tuple(temps))
        self.sts_temperatures = self._sts_tensor(self.config).to(self.fc.weight.device)

    def freeze_embeddings(self) -> None:
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    # --- context ----------------------------------------------------------------------------
    def context_rows(self, target_hidden: torch.Tensor) -> torch.Tensor:  # [..., m*d] -> [..., d]
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(self, rows: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Keys/values of context rows [..., n, d] at `positions` [..., n], per draft layer."""
        cos, sin = self.rotary.cos_sin(positions, rows.dtype)
        return [_project_kv(layer.self_attn, rows, cos, sin) for layer in self.layers]

    # --- block ------------------------------------------------------------------------------
    def block_inputs(self, anchors: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """[anchor, MASK×(depth−1)] per anchor [...] -> [..., depth]; depth γ by default."""
        depth = depth or self.config.block_size
        ids = anchors.new_full((*anchors.shape, depth), self.config.mask_token_id)
        ids[..., 0] = anchors
        return ids

    def run_blocks(
        self,
        input_ids: torch.Tensor,  # [B, Q] block inputs (one or more blocks per row)
        positions: torch.Tensor,  # [B, Q]
        ctx_kv: ContextKV,  # per layer keys, values [B, kv_heads, C + Q, hd] (`with_block_room`)
        mask: torch.Tensor,  # [B, 1 or heads, Q, C + Q] bool, True where attention is allowed
    ) -> torch.Tensor:  # [B, Q, d] final-normed hidden h
        """One non-causal pass of the draft layers; context keys come before the block's own.

        Each layer's buffers hold the context in their first C rows and leave the last Q free:
        the block's own keys and values are written there, and attention reads the buffers as
        they are. Joining context and block per layer (a cat of the whole context, then a
        strided view) took as long as gathering the context itself (64 requests, 300 context
        rows: 1.0–9.4 ms a layer for the cat, 3.8 against 4.7 ms for attention over the
        contiguous buffer, on a shared CPU)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        lc = self.config.layers
        scale, gqa = lc.head_dim**-0.5, lc.num_key_value_heads != lc.num_attention_heads
        width = input_ids.shape[1]
        for layer, (keys, values) in zip(self.layers, ctx_kv, strict=True):

            def attend(
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                keys: torch.Tensor = keys,
                values: torch.Tensor = values,
            ) -> torch.Tensor:
                keys[:, :, -width:] = k.transpose(1, 2)
                values[:, :, -width:] = v.transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
                )
                return out.transpose(1, 2)

            x = layer(x, cos, sin, attend)
        return self.norm(x)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., vocab] U
        return self.lm_head(h)

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor | float:  # [...] -> [..., vocab]
        return 0.0 if self.markov_head is None else self.markov_head.bias(prev_ids)

    def confidence_logits(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """z_k [...] from h [..., d] and x_{k−1} [...]; None without a confidence head."""
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            assert self.markov_head is not None
            h = torch.cat([h, self.markov_head.prev_embeddings(prev_ids).to(h.dtype)], dim=-1)
        return self.confidence_head(h).float()

    def calibrated(self, z: torch.Tensor) -> torch.Tensor:
        """c_k = σ(z_k / T_k) for logits z [..., n], n <= γ (position k on the last axis)."""
        return torch.sigmoid(z.float() / self.sts_temperatures[: z.shape[-1]])


def _project_kv(
    attn: Attention, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # DeepSpec feeds the normed context straight into k_proj/v_proj (no input_layernorm), then
    # k_norm and RoPE as for the block's own keys.
    lead = rows.shape[:-1]
    k = attn.k_proj(rows).view(*lead, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(rows).view(*lead, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        k = attn.k_norm(k)
    return apply_rotary(k, cos, sin), v
