"""Offline verification of DSpark blocks against the target, on held-out token windows.

For each sampled anchor position a in a window: the drafter sees the target's hidden rows of
positions < a and drafts x_1..x_γ from [anchor, MASK×(γ−1)] (Markov head left to right,
greedy or sampled from q at `temperature`); the target then runs once over
[window[..a], x_1..x_{γ−1}] and gives p_0..p_{γ−1}. Exactly the engine's verification of a full
block: greedy accepts x_j iff it is argmax p_{j−1}; sampling accepts with min(1, p/q), from a
seeded generator. `accepted[:, j]` is the realised prefix acceptance (x_1..x_{j+1} all accepted),
so τ = 1 + mean Σ_j accepted (the bonus/correction token counted).

Used by drafter training (held-out τ) and by STS calibration (confidences vs realised acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.draft_worker.dspark_model import DSparkDrafter, with_block_room
from dspark.kernels.sampling import sample_from_probs, warp_probs
from dspark.models.decoder import DecoderLM


@dataclass(frozen=True)
class BlockEval:
    """Per block (rows) and position (columns, draft j = column + 1)."""

    accepted: torch.Tensor  # [num_blocks, γ] bool, realised prefix acceptance
    z: torch.Tensor | None  # [num_blocks, γ] float32 raw confidence logits
    c_star: torch.Tensor  # [num_blocks, γ] float64 Σ_v min(p, q): analytic conditional acceptance

    @property
    def tau(self) -> float:
        """Mean tokens per verify pass of the full block: accepted drafts + 1."""
        return 1.0 + float(self.accepted.sum(1).double().mean())

    def conditional_acceptance(self) -> list[float]:
        """P(x_j accepted | x_1..x_{j−1} accepted), per position."""
        acc = self.accepted.double()
        reached = torch.cat([torch.ones_like(acc[:, :1]), acc[:, :-1]], dim=1).sum(0)
        return (acc.sum(0) / reached.clamp(min=1)).tolist()


def sample_windows(
    stream: torch.Tensor, count: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    """`count` windows of `seq_len` tokens from a token stream. [count, seq_len] int64"""
    starts = torch.randint(0, len(stream) - seq_len, (count,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()]).long()


def sample_anchors(
    batch: int, num: int, seq_len: int, gamma: int, gen: torch.Generator, low: int = 1
) -> torch.Tensor:
    """[batch, num] distinct anchor positions in [low, seq_len − γ − 1]: at least `low` context
    rows before each anchor and the γ tokens after it inside the window."""
    span = seq_len - gamma - 1 - low
    assert span >= num, (seq_len, gamma, num)
    keys = torch.rand(batch, span, generator=gen)
    return keys.argsort(dim=1)[:, :num] + low


def block_hidden(
    drafter: DSparkDrafter, target_hidden: torch.Tensor, window: torch.Tensor, anchors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backbone pass for many anchors per window: (h [B, N, γ, d], anchor tokens [B, N]).

    target_hidden: [B, S, m·d] raw target layer outputs of the window; window: [B, S] tokens;
    anchors: [B, N]. Block n of row b sees the context rows at positions < anchors[b, n].
    """
    bsz, seq = window.shape
    num, gamma = anchors.shape[1], drafter.config.block_size
    rows = drafter.context_rows(target_hidden)
    ctx_pos = torch.arange(seq, device=window.device).expand(bsz, seq)
    ctx_kv = [
        tuple(
            with_block_room(t[:, None].expand(bsz, num, *t.shape[1:]).flatten(0, 1), gamma)
            for t in kv
        )
        for kv in drafter.context_kv(rows, ctx_pos)
    ]
    anchor_tokens = window.gather(1, anchors)
    ids = drafter.block_inputs(anchor_tokens).reshape(bsz * num, gamma)
    positions = (anchors[..., None] + torch.arange(gamma, device=window.device)).reshape(
        bsz * num, gamma
    )
    ctx_ok = torch.arange(seq, device=window.device) < anchors.reshape(-1, 1)  # [B·N, S]
    mask = torch.cat(
        [ctx_ok[:, None, :].expand(-1, gamma, -1), ctx_ok.new_ones(bsz * num, gamma, gamma)], dim=-1
    )[:, None]
    h = drafter.run_blocks(ids, positions, ctx_kv, mask)  # type: ignore[arg-type]
    return h.reshape(bsz, num, gamma, -1), anchor_tokens


@torch.no_grad()
def eval_blocks(
    target: DecoderLM,
    drafter: DSparkDrafter,
    stream: torch.Tensor,
    *,
    num_windows: int = 64,
    seq_len: int = 128,
    anchors_per_window: int = 4,
    temperature: float = 0.0,
    seed: int = 1234,
    batch: int = 16,
) -> BlockEval:
    """Draft and verify `num_windows × anchors_per_window` full blocks (fixed seed: same blocks)."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for start in range(0, num_windows, batch):
        b = min(batch, num_windows - start)
        window = sample_windows(stream, b, seq_len, gen)
        anchors = sample_anchors(
            b, anchors_per_window, seq_len, drafter.config.block_size, gen, low=8
        )
        parts.append(_verify_batch(target, drafter, window, anchors, temperature, gen))
    acc, z, c = zip(*parts, strict=True)
    return BlockEval(torch.cat(acc), None if z[0] is None else torch.cat(z), torch.cat(c))


def _verify_batch(
    target: DecoderLM,
    drafter: DSparkDrafter,
    window: torch.Tensor,
    anchors: torch.Tensor,
    temperature: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    gamma = drafter.config.block_size
    _, hidden = target.forward_dense(window, hidden_layers=drafter.config.target_layer_ids)
    h, anchor_tokens = block_hidden(drafter, hidden, window, anchors)
    h, anchor_tokens, flat_anchors = h.flatten(0, 1), anchor_tokens.flatten(), anchors.flatten()
    n = h.shape[0]
    base = drafter.base_logits(h).float()  # [n, γ, V]
    temp = torch.full((n,), float(temperature), dtype=torch.float64)
    off = (torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.float64))
    drafts = torch.zeros(n, gamma, dtype=torch.long)
    q = torch.zeros(n, gamma, base.shape[-1], dtype=torch.float64)
    prev = anchor_tokens
    for j in range(gamma):
        q[:, j] = warp_probs(base[:, j] + drafter.markov_bias(prev), temp, *off)
        u = torch.rand(n, dtype=torch.float64, generator=gen)
        drafts[:, j] = sample_from_probs(q[:, j], u)
        prev = drafts[:, j]
    prev_ids = torch.cat([anchor_tokens[:, None], drafts[:, :-1]], dim=1)
    z = drafter.confidence_logits(h, prev_ids)
    # The target over [window[..a], x_1..x_{γ−1}], right-padded (causal: padding is never seen).
    rows = window.repeat_interleave(anchors.shape[1], dim=0)
    length = int(flat_anchors.max()) + gamma
    seqs = torch.zeros(n, length, dtype=torch.long)
    for i, a in enumerate(flat_anchors.tolist()):
        seqs[i, : a + 1] = rows[i, : a + 1]
        seqs[i, a + 1 : a + gamma] = drafts[i, : gamma - 1]
    final, _ = target.forward_dense(seqs)
    idx = flat_anchors[:, None] + torch.arange(gamma)  # rows giving p_0..p_{γ−1}
    logits = target.compute_logits(final[torch.arange(n)[:, None], idx]).float()
    p = warp_probs(
        logits.flatten(0, 1),
        temp.repeat_interleave(gamma),
        off[0].repeat_interleave(gamma),
        off[1].repeat_interleave(gamma),
    ).view_as(q)
    p_x = p.gather(2, drafts[..., None]).squeeze(2)
    q_x = q.gather(2, drafts[..., None]).squeeze(2)
    u = torch.rand(n, gamma, dtype=torch.float64, generator=gen)
    ok = u * q_x < p_x  # u < p/q; greedy: p, q one-hot, so x == argmax p
    accepted = ok.to(torch.int32).cumprod(dim=1).bool()
    c_star = torch.minimum(p, q).sum(-1)
    return accepted, z, c_star
