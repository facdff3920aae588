"""Llama / Qwen3 decoder in plain torch, with Hugging Face parameter names.

Two forwards share the weights:
- `forward_paged`: one varlen batch over a paged KV cache (serving: prefill chunks and verify
  blocks together), logits only for the requested rows, hidden states of requested layers;
- `forward_dense`: a padded [batch, seq] causal pass without a cache (training, references).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels.paged_attention import AttentionMetadata, kv_write, paged_attention
from dspark.models.config import ModelConfig
from dspark.models.kv_cache import PagedKVCache
from dspark.models.rope import RotaryEmbedding, apply_rotary

# attend(q, k, v) -> out, each [..., heads or kv_heads, head_dim]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the storage dtype, as the reference implementations do.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h, kvh, hd = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.q_proj = nn.Linear(d, h * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, kvh * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, kvh * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., d] -> q [..., heads, hd], k and v [..., kv_heads, hd], RoPE applied."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        out = attend(q, k, v)
        return self.o_proj(out.reshape(*x.shape[:-1], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, i, bias=b)
        self.up_proj = nn.Linear(d, i, bias=b)
        self.down_proj = nn.Linear(i, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The `model.` prefix of Hugging Face checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [num_logit_rows, vocab]
    hidden: torch.Tensor | None  # [num_tokens, len(hidden_layers) * hidden_size] or None


class DecoderLM(nn.Module):
    """Causal LM. `hidden_layers` ids pick raw decoder-layer outputs (-1: the embeddings)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.rotary = RotaryEmbedding(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., d] -> logits [..., vocab]."""
        if self.config.tie_word_embeddings:
            return F.linear(h, self.model.embed_tokens.weight)
        return self.lm_head(h)

    def _run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend_for_layer: Callable[[int], AttendFn],
        hidden_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        captured = {-1: x} if -1 in hidden_layers else {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attend_for_layer(i))
            if i in hidden_layers:
                captured[i] = x
        hidden = torch.cat([captured[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        return self.model.norm(x), hidden

    def forward_paged(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        cache: PagedKVCache,
        logits_indices: torch.Tensor,  # [num_logit_rows] rows of the batch that need logits
        hidden_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        scale = self.config.head_dim**-0.5

        def attend_for_layer(i: int) -> AttendFn:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                kv_write(k, v, cache.k[i], cache.v[i], meta.slot_mapping)
                return paged_attention(q, cache.k[i], cache.v[i], meta, scale)

            return attend

        h, hidden = self._run_layers(input_ids, meta.positions, attend_for_layer, hidden_layers)
        return ForwardOutput(self.compute_logits(h[logits_indices]), hidden)

    def forward_dense(
        self,
        input_ids: torch.Tensor,  # [batch, seq]
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal pass over whole sequences: (final-normed hidden [batch, seq, d], captured)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        scale = self.config.head_dim**-0.5
        gqa = self.config.num_key_value_heads != self.config.num_attention_heads

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, scale=scale, enable_gqa=gqa,
            )
            return out.transpose(1, 2)

        return self._run_layers(input_ids, positions, lambda _: attend, hidden_layers)
