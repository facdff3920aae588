"""Tensor parallelism for the target model over a torch.distributed process group.

Megatron-style sharding of the Llama/Qwen3 decoder (`dspark.models.decoder`), one shard per rank:

- column-parallel q/k/v/gate/up: each rank holds a slice of the output features (whole attention
  heads, a slice of the MLP width); outputs stay sharded, no communication;
- row-parallel o/down: each rank holds the matching slice of the input features; the partial
  products are summed by an all-reduce, the bias (replicated) is added once, after it;
- vocabulary-parallel embedding: each rank holds a contiguous slice of the rows; a token outside
  the slice reads zeros, and an all-reduce gives every rank the full embedding (exactly: one
  rank contributes the row, the others add 0);
- vocabulary-parallel LM head: local logits over the rank's slice, all-gathered into the full
  vocabulary;
- head-sharded attention and paged KV cache: rank r owns query heads [r·h/tp, (r+1)·h/tp) and
  KV heads [r·kvh/tp, (r+1)·kvh/tp). Contiguous slices keep grouped-query attention's mapping
  (query head j reads KV head j // (h/kvh)) inside the rank, so attention needs no collective.

The decoder is not forked: `load_tp_model` builds the ordinary `DecoderLM` from a rank-local
config (h/tp heads, kvh/tp KV heads, intermediate/tp), swaps in the parallel modules above, and
loads each rank's slices of the full Hugging Face checkpoint. RMSNorms, RoPE and Qwen3's q/k
norms act per token or per head and are replicated.

`TPTargetRunner` is the `TargetRunner` over such a model. Rank 0 decides acceptance
(`kernels.acceptance.accept`, exactly as the single-process runner) and broadcasts it; the other
ranks never draw a random number and never decide (DESIGN.md §4, invariant 6).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dspark.messages import NewRequest, VerifyPlan, VerifyResult
from dspark.models.checkpoint import read_state_dict
from dspark.models.config import ModelConfig
from dspark.models.decoder import DecoderLayer, DecoderLM
from dspark.models.kv_cache import PagedKVCache
from dspark.sampling_params import SamplingParams
from dspark.target_worker.runner import TargetRunner


class TPConfigError(ValueError):
    """The model cannot be split over the requested number of ranks."""


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group; `group=None` is the default process group."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_0(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            dist.broadcast(x, src=src, group=self.group)
        return x


# --- parallel modules ---------------------------------------------------------------------------
class ColumnParallelLinear(nn.Linear):
    """y_r = x W_r^T + b_r for this rank's rows W_r of W: the output stays sharded (no collective).

    A plain `nn.Linear` over the rank's slice; the class names the role and the slicing rule.
    """


class RowParallelLinear(nn.Linear):
    """y = Σ_r x_r W_r^T + b: this rank's input slice times its columns W_r, all-reduced.

    The bias is replicated and added after the reduction, so it is counted once.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding; lookups outside read 0, then all-reduce."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.shard = _vocab_shard(vocab_size, tp.world_size)
        self.start = tp.rank * self.shard
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.shard, hidden))  # [shard, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[..., None], 0.0)
        return self.tp.all_reduce(x)


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary slice, all-gathered; padding columns are dropped."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(_vocab_shard(vocab_size, tp.world_size), hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.tp.all_gather_last(F.linear(h, self.weight))[..., : self.vocab_size]


def _vocab_shard(vocab_size: int, world_size: int) -> int:
    # The last rank's slice is padded with zero rows when the vocabulary does not divide.
    return -(-vocab_size // world_size)


# --- building a rank's model --------------------------------------------------------------------
def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: heads, KV heads and MLP width divided by `world_size`.

    Raises TPConfigError when a count does not divide (whole heads per rank; KV heads are not
    replicated).
    """
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, value in counts.items():
        if world_size < 1 or value % world_size:
            raise TPConfigError(
                f"tensor parallelism tp={world_size}: {name}={value} is not divisible by tp; "
                f"choose tp among the divisors of {name}"
            )
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        tie_word_embeddings=False,  # the head is a separate module; it may share the weight
    )


def shard_state_dict(
    state: dict[str, torch.Tensor], config: ModelConfig, tp: TPGroup
) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor of a full checkpoint (HF names kept)."""
    r, n = tp.rank, tp.world_size
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        kind = _shard_kind(name)
        if kind == "vocab":
            shard = _vocab_shard(config.vocab_size, n)
            rows = w[r * shard : (r + 1) * shard]
            pad = shard - rows.shape[0]
            out[name] = F.pad(rows, (0, 0, 0, pad)) if pad else rows
        elif kind == "column":  # rows of the weight (and the bias): output features
            out[name] = w.chunk(n, dim=0)[r]
        elif kind == "row" and name.endswith(".weight"):  # columns: input features
            out[name] = w.chunk(n, dim=1)[r]
        else:  # norms, row-parallel biases
            out[name] = w
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _shard_kind(name: str) -> str:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "vocab"
    if any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return "column"
    if any(f".{p}." in name for p in ("o_proj", "down_proj")):
        return "row"
    return "replicated"


def build_tp_model(config: ModelConfig, tp: TPGroup) -> DecoderLM:
    """An empty (meta) `DecoderLM` of this rank's shard with the parallel modules swapped in."""
    cfg = local_config(config, tp.world_size)
    d, hd = cfg.hidden_size, cfg.head_dim
    with torch.device("meta"):
        model = DecoderLM(cfg)
        model.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, d, tp)  # type: ignore[assignment]
        model.lm_head = VocabParallelLMHead(config.vocab_size, d, tp)  # type: ignore[assignment]
        for layer in model.model.layers:
            attn, mlp = cast(DecoderLayer, layer).self_attn, cast(DecoderLayer, layer).mlp
            for proj, n_out in (("q_proj", cfg.num_attention_heads * hd),
                                ("k_proj", cfg.num_key_value_heads * hd),
                                ("v_proj", cfg.num_key_value_heads * hd)):
                setattr(attn, proj, ColumnParallelLinear(d, n_out, bias=cfg.attention_bias))
            attn.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, d, cfg.attention_bias, tp)
            mlp.gate_proj = ColumnParallelLinear(d, cfg.intermediate_size, bias=cfg.mlp_bias)
            mlp.up_proj = ColumnParallelLinear(d, cfg.intermediate_size, bias=cfg.mlp_bias)
            mlp.down_proj = RowParallelLinear(cfg.intermediate_size, d, cfg.mlp_bias, tp)
    return model


def load_tp_model(
    path: str | Path, tp: TPGroup, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DecoderLM:
    """Load the full HF checkpoint and keep this rank's shards (strict: every tensor present).

    `model.config` is the rank-local config; the full one is `ModelConfig.from_dir(path)`.
    """
    config = ModelConfig.from_dir(path)
    model = build_tp_model(config, tp)
    state = shard_state_dict(read_state_dict(path), config, tp)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # As `load_model`: the rotary buffer is rebuilt after the cast so inv_freq stays float32.
    rotary_cls = type(model.rotary)
    del model.rotary
    model = model.to(device=device, dtype=dtype).eval()
    model.rotary = rotary_cls(model.config).to(device)
    return model


# --- the runner ---------------------------------------------------------------------------------
class TPTargetRunner(TargetRunner):
    """`TargetRunner` over one rank's shard; every rank runs every verb with the same plan.

    `config` is the full model's (what the coordinator sees); the KV cache holds this rank's
    kvh/tp heads. Acceptance: rank 0 runs the parent's `_accept` (the request generators live
    there, and only there) and broadcasts [A_r, output tokens]; every rank returns that broadcast
    decision, and folds it into `decision_digest` so callers can check that the ranks agree.
    """

    def __init__(
        self,
        path: str | Path,
        tp: TPGroup,
        num_blocks: int = 2048,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        hidden_layers: tuple[int, ...] = (),
    ) -> None:
        # The parent's __init__ would load the whole model on every rank: set its fields here.
        self.tp = tp
        self.model = load_tp_model(path, tp, dtype=dtype, device=device)
        self.hidden_layers = hidden_layers
        self.config = ModelConfig.from_dir(path)
        self.device = device
        local = self.model.config
        self.cache = PagedKVCache(
            local.num_hidden_layers, local.num_key_value_heads, local.head_dim,
            num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device,
        )
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._digest = hashlib.sha256()
        self._decisions = 0

    def add_request(self, new: NewRequest) -> None:
        if self.tp.rank == 0:
            super().add_request(new)
        else:  # no generator: a rank other than 0 has nothing to draw random numbers from
            self._params[new.req_id] = new.params

    def _accept(self, plan: VerifyPlan, logits: torch.Tensor) -> VerifyResult:
        num_reqs, max_draft = len(plan.req_ids), plan.draft_token_ids.shape[1]
        # [num_reqs, 1 + max_draft + 1]: A_r, then x_1..x_A, y, -1 after.
        decision = torch.full((num_reqs, max_draft + 2), -1, dtype=torch.long)
        if self.tp.rank == 0:
            result = super()._accept(plan, logits)
            pairs = zip(result.num_accepted, result.output_tokens, strict=True)
            for i, (a, toks) in enumerate(pairs):
                decision[i, 0] = a
                decision[i, 1 : 2 + a] = torch.tensor(toks, dtype=torch.long)
        on_wire = decision.to(self._collective_device())
        decision = self.tp.broadcast_from_0(on_wire).cpu()
        self._digest.update(decision.numpy().tobytes())
        self._decisions += 1
        accepted = decision[:, 0].tolist()  # the step's one sync point on every rank
        rows = decision[:, 1:].tolist()
        return VerifyResult(
            req_ids=plan.req_ids,
            num_accepted=tuple(accepted),
            output_tokens=tuple(tuple(t[: a + 1]) for t, a in zip(rows, accepted, strict=True)),
        )

    def _collective_device(self) -> torch.device:
        # NCCL moves CUDA tensors only; gloo moves CPU tensors.
        backend = dist.get_backend(self.tp.group) if self.tp.world_size > 1 else "gloo"
        return torch.device(self.device) if backend == "nccl" else torch.device("cpu")

    def decision_digest(self) -> tuple[int, str]:
        """(number of decisions taken, sha256 over all of them): equal on every rank."""
        return self._decisions, self._digest.hexdigest()
