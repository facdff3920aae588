"""Speculative acceptance: hand cases, greedy equivalence, and the emitted distribution (χ²)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.kernels.acceptance import AcceptanceOutput, accept, accept_greedy, accept_ref
from dspark.kernels.sampling import sample_from_probs, warp_probs

F64 = torch.float64
ALPHA = 1e-3  # significance level of every χ² test in this file


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _cu(num_drafts: list[int]) -> torch.Tensor:  # [num_reqs + 1]
    return torch.tensor([0] + np.cumsum([n + 1 for n in num_drafts]).tolist(), dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Hand cases


def test_all_accepted_then_bonus_from_p_ell() -> None:
    p = _t([[0, 1, 0, 0], [0, 0, 1, 0], [0.25, 0.25, 0.25, 0.25]])  # p_0, p_1, p_2
    out = accept_ref(p, _cu([2]), torch.tensor([[1, 2]]), None, _t([[0.99, 0.99]]), _t([0.6]))
    assert out.num_accepted.tolist() == [2]
    assert out.output_tokens.tolist() == [[1, 2, 2]]  # bonus: cdf 0.25, 0.5, 0.75 first > 0.6


def test_ratio_acceptance_is_strict() -> None:
    p0, p1 = [0.1, 0.3, 0.3, 0.3], [0.0, 0.0, 0.0, 1.0]
    q1 = [0.1, 0.6, 0.2, 0.1]  # x_1 = 1: ratio p_0(1)/q_1(1) = 0.5
    p = _t([p0, p1] * 2)
    q = _t([[q1], [q1]])
    out = accept_ref(p, _cu([1, 1]), torch.tensor([[1], [1]]), q, _t([[0.49], [0.5]]), _t([0, 0]))
    assert out.num_accepted.tolist() == [1, 0]
    assert out.output_tokens[0].tolist() == [1, 3]  # bonus from p_1
    # Rejected: residual max(0, p_0 - q_1) = (0, 0, 0.1, 0.2); u = 0 gives its first token.
    assert out.output_tokens[1].tolist() == [2, -1]


@pytest.mark.parametrize(("u_sample", "y"), [(0.39, 2), (0.41, 3)])
def test_first_rejected_samples_residual(u_sample: float, y: int) -> None:
    p = _t([[0.1, 0.2, 0.3, 0.4], [1, 0, 0, 0], [1, 0, 0, 0]])
    q = _t([[[0.4, 0.4, 0.1, 0.1], [1, 0, 0, 0]]])
    # x_1 = 0: ratio 0.1 / 0.4 = 0.25 < u = 0.3, rejected. Residual (0, 0, 0.2, 0.3) -> (0.4, 0.6).
    out = accept_ref(p, _cu([2]), torch.tensor([[0, 0]]), q, _t([[0.3, 0.0]]), _t([u_sample]))
    assert out.num_accepted.tolist() == [0]
    assert out.output_tokens.tolist() == [[y, -1, -1]]


def test_deterministic_draft_rejected_token_is_zeroed() -> None:
    p = _t([[0.5, 0.5, 0.0], [0, 0, 1]])
    # x_1 = 1 with q one-hot: accept iff u < p_0(1) = 0.5. Rejected, y ~ p_0 without token 1.
    out = accept_ref(p, _cu([1]), torch.tensor([[1]]), None, _t([[0.5]]), _t([1 - 2**-53]))
    assert out.num_accepted.tolist() == [0]
    assert out.output_tokens.tolist() == [[0, -1]]


def test_zero_drafts_sample_from_p0() -> None:
    p = _t([[0.2, 0.3, 0.5]])
    for max_draft in (0, 2):
        ids = torch.full((1, max_draft), -1)
        u_acc = torch.zeros(1, max_draft, dtype=F64)
        out = accept_ref(p, _cu([0]), ids, None, u_acc, _t([0.45]))
        assert out.num_accepted.tolist() == [0]
        assert out.output_tokens.tolist() == [[1] + [-1] * max_draft]


def test_varlen_batch_with_padding() -> None:
    """ℓ = (0, 3, 1) in one call; -1 padding past ℓ_r is ignored and re-emitted as -1."""
    one_hot = torch.eye(5, dtype=F64)
    p = torch.stack(
        [
            _t([[0.0, 0.0, 0.0, 0.5, 0.5]])[0],  # r0: p_0
            one_hot[1], one_hot[2], one_hot[0], one_hot[4],  # r1: p_0..p_3; x_3 = 3 is wrong
            one_hot[2], _t([[0.2, 0.2, 0.2, 0.2, 0.2]])[0],  # r2: p_0, p_1 (bonus)
        ]
    )  # fmt: skip
    ids = torch.tensor([[-1, -1, -1], [1, 2, 3], [2, -1, -1]])
    u_acc = torch.full((3, 3), 0.5, dtype=F64)
    out = accept_ref(p, _cu([0, 3, 1]), ids, None, u_acc, _t([0.0, 0.5, 0.7]))
    assert out.num_accepted.tolist() == [0, 2, 1]
    # r1: x_3 = 3 rejected; residual = p_2 = e_0 minus token 3 -> y = 0.
    assert out.output_tokens.tolist() == [[3, -1, -1, -1], [1, 2, 0, -1], [2, 3, -1, -1]]


def test_zero_draft_probability_counts_as_ratio_one_if_target_positive() -> None:
    p = _t([[0.5, 0.5, 0.0], [0, 0, 1], [0.5, 0.5, 0.0], [0, 0, 1]])
    q = _t([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]])
    # r0: q_1(1) = 0, p_0(1) = 0.5 -> accept. r1: x_1 = 2, q_1(2) = 0, p_0(2) = 0 -> reject.
    ids = torch.tensor([[1], [2]])
    out = accept_ref(p, _cu([1, 1]), ids, q, _t([[1 - 2**-53], [0.0]]), _t([0.0, 0.0]))
    assert out.num_accepted.tolist() == [1, 0]
    assert out.output_tokens.tolist() == [[1, 2], [0, -1]]


def test_zero_residual_mass_falls_back_to_p_a() -> None:
    # p_0 sits one ulp under q_1 everywhere: the ratio is 1 - 2**-53, so u = 1 - 2**-53 rejects,
    # and max(0, p_0 - q_1) is all zero. y must then come from p_0.
    half_minus = 0.5 - 2**-54
    p = _t([[half_minus, half_minus, 0.0], [0, 0, 1]])
    q = _t([[[0.5, 0.5, 0.0]]])
    for u_sample, y in [(0.25, 0), (0.75, 1)]:
        out = accept_ref(p, _cu([1]), torch.tensor([[0]]), q, _t([[1 - 2**-53]]), _t([u_sample]))
        assert out.num_accepted.tolist() == [0]
        assert out.output_tokens.tolist() == [[y, -1]]


def test_dispatch_matches_reference() -> None:
    g = torch.Generator().manual_seed(5)
    num_drafts, vocab = [2, 0, 3, 1], 6
    p = torch.softmax(torch.randn(sum(num_drafts) + 4, vocab, generator=g, dtype=F64), dim=-1)
    q = torch.softmax(torch.randn(4, 3, vocab, generator=g, dtype=F64), dim=-1)
    ids = torch.randint(0, vocab, (4, 3), generator=g)
    u_acc, u_s = torch.rand(4, 3, generator=g, dtype=F64), torch.rand(4, generator=g, dtype=F64)
    args = (p, _cu(num_drafts), ids, q, u_acc, u_s)
    ref, got = accept_ref(*args), accept(*args)
    assert torch.equal(ref.num_accepted, got.num_accepted)
    assert torch.equal(ref.output_tokens, got.output_tokens)


# ---------------------------------------------------------------------------------------------
# Greedy: warp_probs at temperature 0 + accept == the explicit argmax rule (DESIGN.md §4)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_equals_explicit_argmax_rule(with_draft_probs: bool) -> None:
    g = torch.Generator().manual_seed(6)
    num_reqs, max_draft, vocab = 64, 4, 7
    num_drafts = torch.randint(0, max_draft + 1, (num_reqs,), generator=g).tolist()
    cu = _cu(num_drafts)
    logits = torch.randn(int(cu[-1]), vocab, generator=g)
    argmax = logits.argmax(dim=-1)
    ids = torch.full((num_reqs, max_draft), -1)
    for r, n in enumerate(num_drafts):
        for j in range(n):  # x_{j+1}: the target's argmax 70% of the time, else a random token
            hit = torch.rand((), generator=g) < 0.7
            rand_tok = torch.randint(0, vocab, (), generator=g)
            ids[r, j] = argmax[cu[r] + j] if hit else rand_tok
    rows = logits.shape[0]
    p = warp_probs(logits, torch.zeros(rows), torch.full((rows,), 3), torch.full((rows,), 0.5))
    q = None
    if with_draft_probs:  # a sampled drafter at a nonzero temperature, with arbitrary q
        q = torch.softmax(torch.randn(num_reqs, max_draft, vocab, generator=g, dtype=F64), -1)
    u_acc = torch.rand(num_reqs, max_draft, generator=g, dtype=F64)
    out = accept_ref(p, cu, ids, q, u_acc, torch.rand(num_reqs, generator=g, dtype=F64))

    for r, n in enumerate(num_drafts):
        a = 0
        while a < n and ids[r, a] == argmax[cu[r] + a]:
            a += 1
        expected = ids[r, :a].tolist() + [int(argmax[cu[r] + a])]
        assert out.num_accepted[r] == a
        assert out.output_tokens[r].tolist() == expected + [-1] * (max_draft - a)
    assert 0 < out.num_accepted.sum() < sum(num_drafts)  # both branches were exercised


@pytest.mark.parametrize("max_draft", [0, 1, 5])
def test_accept_greedy_equals_reference_on_one_hot_rows(max_draft: int) -> None:
    """`accept_greedy` from argmaxes == `accept_ref` on `warp_probs`' one-hot rows, over random
    varlen batches with ties in the logits (argmax: the first), ℓ = 0 rows and padding."""
    g = torch.Generator().manual_seed(11 + max_draft)
    for _ in range(20):
        num_reqs, vocab = int(torch.randint(1, 9, (), generator=g)), 6
        num_drafts = torch.randint(0, max_draft + 1, (num_reqs,), generator=g).tolist()
        cu = _cu(num_drafts)
        logits = torch.randint(0, 3, (int(cu[-1]), vocab), generator=g).float()  # many ties
        argmax = logits.argmax(dim=-1)
        ids = torch.full((num_reqs, max_draft), -1)
        for r, n in enumerate(num_drafts):
            for j in range(n):  # the argmax or a random token, so both outcomes occur
                hit = bool(torch.rand((), generator=g) < 0.6)
                ids[r, j] = argmax[cu[r] + j] if hit else torch.randint(0, vocab, (), generator=g)
        rows = logits.shape[0]
        p = warp_probs(logits, torch.zeros(rows), torch.zeros(rows, dtype=torch.long),
                       torch.ones(rows))
        ref = accept_ref(p, cu, ids, None, torch.rand(num_reqs, max_draft, generator=g, dtype=F64),
                         torch.rand(num_reqs, generator=g, dtype=F64))
        out = accept_greedy(argmax, cu, ids)
        assert torch.equal(out.num_accepted, ref.num_accepted)
        assert torch.equal(out.output_tokens, ref.output_tokens)


# ---------------------------------------------------------------------------------------------
# Distribution: the multi-token step emits exactly the target's distribution.
#
# Toy target and draft are Markov chains over a small vocabulary: p(next | prev) = P[prev],
# q(next | prev) = Q[prev]. N requests start from the same anchor a0 with ℓ = 2 drafts
# x_1 ~ Q[a0], x_2 ~ Q[x_1]; the target rows are P[a0], P[x_1], P[x_2]. The first two emitted
# tokens (t1, t2) must be distributed as P[a0, t1] · P[t1, t2]. Conditioning on how many tokens a
# step emitted would bias the pair, so a request that emitted one token gets its t2 from a
# continuation step (ℓ = 0 from anchor t1: a plain target sample).

N = 40_000
A0 = 1
Acceptor = Callable[..., AcceptanceOutput]


def _random_chain(
    g: torch.Generator, vocab: int, power: float = 3.0
) -> torch.Tensor:  # [vocab, vocab] row-stochastic
    # power > 1 makes rows uneven, so that p and q differ a lot.
    w = torch.rand(vocab, vocab, generator=g, dtype=F64) ** power
    return w / w.sum(dim=1, keepdim=True)


def _merged_chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """χ² goodness of fit after pooling the cells with expected count < 5 (smallest first)."""
    if observed[expected == 0].sum() > 0:
        return 0.0  # an impossible outcome happened
    observed, expected = observed[expected > 0], expected[expected > 0]
    order = np.argsort(expected)
    observed, expected = observed[order], expected[order]
    cut = 0
    while cut < len(expected) and expected[:cut].sum() < 5 and expected[cut] < 5:
        cut += 1
    if 0 < expected[:cut].sum() < 5:
        cut += 1  # pool the next-smallest cell too
    if cut > 0:
        observed = np.concatenate([[observed[:cut].sum()], observed[cut:]])
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    expected = expected * observed.sum() / expected.sum()
    return float(chisquare(observed, expected).pvalue)


def _run_step(
    acceptor: Acceptor,
    P: torch.Tensor,  # [vocab, vocab] target chain
    Q: torch.Tensor | None,  # [vocab, vocab] draft chain; None: deterministic drafts
    fixed_draft: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # t1 [N], t2 [N], num_accepted [N]
    g = torch.Generator().manual_seed(seed)
    vocab = P.shape[0]
    a0 = torch.full((N,), A0)
    if Q is None:
        x1 = x2 = torch.full((N,), fixed_draft)
        draft_probs = None
    else:
        x1 = sample_from_probs(Q[a0], torch.rand(N, generator=g, dtype=F64))
        x2 = sample_from_probs(Q[x1], torch.rand(N, generator=g, dtype=F64))
        draft_probs = torch.stack([Q[a0], Q[x1]], dim=1)
    target = torch.stack([P[a0], P[x1], P[x2]], dim=1).reshape(3 * N, vocab)
    cu = torch.arange(N + 1) * 3
    ids = torch.stack([x1, x2], dim=1)
    u_acc = torch.rand(N, 2, generator=g, dtype=F64)
    out = acceptor(target, cu, ids, draft_probs, u_acc, torch.rand(N, generator=g, dtype=F64))
    t1 = out.output_tokens[:, 0]
    cont = accept_ref(
        P[t1], torch.arange(N + 1), torch.empty(N, 0, dtype=torch.long), None,
        torch.empty(N, 0, dtype=F64), torch.rand(N, generator=g, dtype=F64),
    )  # fmt: skip
    t2 = torch.where(out.num_accepted >= 1, out.output_tokens[:, 1], cont.output_tokens[:, 0])
    return t1, t2, out.num_accepted


def _pair_pvalue(P: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> float:
    vocab = P.shape[0]
    observed = torch.bincount(t1 * vocab + t2, minlength=vocab * vocab).numpy()
    expected = (N * P[A0][:, None] * P).reshape(-1).numpy()
    return _merged_chisquare_pvalue(observed, expected)


def _first_token_pvalue(P: torch.Tensor, t1: torch.Tensor) -> float:
    observed = torch.bincount(t1, minlength=P.shape[0]).numpy()
    return _merged_chisquare_pvalue(observed, (N * P[A0]).numpy())


def _assert_target_distribution(P: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> None:
    assert _first_token_pvalue(P, t1) > ALPHA
    assert _pair_pvalue(P, t1, t2) > ALPHA


def test_distribution_random_p_and_q() -> None:
    """N = 40,000 steps, ℓ = 2, V = 6; (t1, t2) ~ P[a0, t1] P[t1, t2] by χ² at α = 1e-3."""
    g = torch.Generator().manual_seed(10)
    P, Q = _random_chain(g, 6), _random_chain(g, 6)
    t1, t2, num_accepted = _run_step(accept_ref, P, Q, 0, seed=11)
    _assert_target_distribution(P, t1, t2)
    assert (num_accepted == 0).any() and (num_accepted == 1).any() and (num_accepted == 2).any()


def test_distribution_p_equals_q_accepts_everything() -> None:
    """p == q: every draft is accepted (ratio exactly 1 > u); χ² at α = 1e-3."""
    P = _random_chain(torch.Generator().manual_seed(12), 5)
    t1, t2, num_accepted = _run_step(accept_ref, P, P.clone(), 0, seed=13)
    assert (num_accepted == 2).all()
    _assert_target_distribution(P, t1, t2)


def test_distribution_disjoint_supports_rejects_everything() -> None:
    """p on tokens 0..2, q on 3..5: every draft is rejected, y ~ residual = p; χ² at α = 1e-3."""
    g = torch.Generator().manual_seed(14)
    P, Q = torch.zeros(6, 6, dtype=F64), torch.zeros(6, 6, dtype=F64)
    P[:, :3], Q[:, 3:] = _random_chain(g, 6)[:, :3], _random_chain(g, 6)[:, 3:]
    P, Q = P / P.sum(1, keepdim=True), Q / Q.sum(1, keepdim=True)
    t1, t2, num_accepted = _run_step(accept_ref, P, Q, 0, seed=15)
    assert (num_accepted == 0).all()
    _assert_target_distribution(P, t1, t2)


def test_distribution_deterministic_drafts() -> None:
    """q one-hot (draft_probs=None), x_1 = x_2 = one fixed token; χ² at α = 1e-3."""
    P = _random_chain(torch.Generator().manual_seed(16), 6, power=1.0)
    fixed = int(torch.argmax(P[A0] * P.diagonal()))  # the fixed token most likely to pass twice
    t1, t2, num_accepted = _run_step(accept_ref, P, None, fixed, seed=17)
    assert (num_accepted == 0).any() and (num_accepted == 2).any()
    _assert_target_distribution(P, t1, t2)


def test_distribution_with_temperature_and_top_k_on_both() -> None:
    """p and q warped by warp_probs (T = 0.7, top-k 4, top-p 0.9), V = 8; χ² at α = 1e-3."""
    g = torch.Generator().manual_seed(18)
    vocab = 8

    def warped() -> torch.Tensor:  # [vocab, vocab]
        logits = 2 * torch.randn(vocab, vocab, generator=g)
        ones = torch.ones(vocab, dtype=F64)
        return warp_probs(logits, 0.7 * ones, torch.full((vocab,), 4), 0.9 * ones)

    P, Q = warped(), warped()
    assert ((P > 0).sum(dim=1) <= 4).all() and ((P > 0) != (Q > 0)).any()
    t1, t2, _ = _run_step(accept_ref, P, Q, 0, seed=19)
    _assert_target_distribution(P, t1, t2)


def _wrong_accept(
    target_probs: torch.Tensor,  # [num_rows, vocab]
    cu_num_rows: torch.Tensor,  # [num_reqs + 1]
    draft_token_ids: torch.Tensor,  # [num_reqs, max_draft]
    draft_probs: torch.Tensor | None,  # [num_reqs, max_draft, vocab]
    u_accept: torch.Tensor,  # [num_reqs, max_draft]
    u_sample: torch.Tensor,  # [num_reqs]
) -> AcceptanceOutput:
    """A classic bug: after a rejection, resample y from p_A instead of the residual."""
    out = accept_ref(target_probs, cu_num_rows, draft_token_ids, draft_probs, u_accept, u_sample)
    a = out.num_accepted
    y = sample_from_probs(target_probs[cu_num_rows[:-1] + a], u_sample)
    tokens = out.output_tokens.clone()
    tokens[torch.arange(a.shape[0]), a] = y
    return AcceptanceOutput(num_accepted=a, output_tokens=tokens)


def test_negative_control_wrong_residual_fails_chi_square() -> None:
    """The χ² test has power: the p_A-resampling bug gives p-value < α = 1e-3 on random p/q."""
    g = torch.Generator().manual_seed(10)
    P, Q = _random_chain(g, 6), _random_chain(g, 6)
    t1, t2, _ = _run_step(_wrong_accept, P, Q, 0, seed=11)
    assert _pair_pvalue(P, t1, t2) < ALPHA
