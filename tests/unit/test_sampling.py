"""warp_probs (temperature, top-k, top-p, greedy) and sample_from_probs (inverse CDF)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dspark.kernels.sampling import sample_from_probs, warp_probs

F64 = torch.float64


def _warp(
    logits: torch.Tensor,  # [num_rows, vocab]
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
) -> torch.Tensor:  # [num_rows, vocab] float64
    return warp_probs(
        logits,
        torch.tensor(temperature, dtype=F64),
        torch.tensor(top_k, dtype=torch.long),
        torch.tensor(top_p, dtype=F64),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_temperature_scaling_matches_softmax(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0)).to(dtype)
    temps = [0.5, 1.0, 2.0, 0.7]
    probs = _warp(logits, temps, [0] * 4, [1.0] * 4)
    expected = torch.softmax(logits.to(F64) / torch.tensor(temps, dtype=F64)[:, None], dim=-1)
    assert probs.dtype == F64
    torch.testing.assert_close(probs, expected, atol=1e-12, rtol=1e-12)


def test_top_k_keeps_exactly_k_largest() -> None:
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5, 0.9, 3.0]])
    probs = _warp(logits, [1.0], [3], [1.0])
    assert torch.equal(probs[0] > 0, torch.tensor([False, True, False, True, False, True]))
    kept = torch.tensor([1, 3, 5])
    torch.testing.assert_close(probs[0, kept], torch.softmax(logits[0, kept].to(F64), dim=-1))


def test_top_k_ties_keep_lower_token_ids() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = _warp(logits, [1.0], [2], [1.0])
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0], dtype=F64))


@pytest.mark.parametrize("k", [0, 6, 7, 100])
def test_top_k_off_when_zero_or_at_least_vocab(k: int) -> None:
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(1))
    probs = _warp(logits, [1.0], [k], [1.0])
    torch.testing.assert_close(probs, torch.softmax(logits.to(F64), dim=-1))


# p = (0.5, 0.3, 0.15, 0.05): cumulative 0.5, 0.8, 0.95, 1.0.
_NUCLEUS_LOGITS = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=F64).log()


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, [1.0, 0.0, 0.0, 0.0]),  # the top token alone reaches 0.4
        (0.75, [0.625, 0.375, 0.0, 0.0]),  # 0.5 < 0.75 <= 0.8: two tokens
        (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # 0.8 < 0.85 <= 0.95: three
        (1e-9, [1.0, 0.0, 0.0, 0.0]),  # always keep at least the top token
        (1.0, [0.5, 0.3, 0.15, 0.05]),  # off
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, expected: list[float]) -> None:
    probs = _warp(_NUCLEUS_LOGITS, [1.0], [0], [top_p])
    torch.testing.assert_close(probs[0], torch.tensor(expected, dtype=F64))


def test_top_p_one_keeps_tail_lost_to_rounding() -> None:
    # The top token's mass rounds to 1.0, so "mass before < 1" alone would drop the tail.
    logits = torch.tensor([[60.0, 0.0, 0.0]])
    probs = _warp(logits, [1.0], [0], [1.0])
    assert (probs > 0).all()
    torch.testing.assert_close(probs, torch.softmax(logits.to(F64), dim=-1), atol=0, rtol=0)


def test_top_p_applies_to_renormalised_top_k() -> None:
    # Top-2 renormalises to (0.625, 0.375); 0.625 >= 0.6, so top-p keeps only the top token.
    # Without top-k, 0.5 < 0.6 and top-p would keep two.
    probs = _warp(_NUCLEUS_LOGITS.repeat(2, 1), [1.0, 1.0], [2, 0], [0.6, 0.6])
    torch.testing.assert_close(probs[0], torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=F64))


def test_temperature_zero_is_one_hot_argmax_first_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 2.0, 4.9]])
    probs = _warp(logits, [0.0, 0.0], [3, 1], [0.5, 1.0])
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=F64)
    assert torch.equal(probs, expected)


def test_rows_are_independent() -> None:
    logits = torch.randn(5, 9, generator=torch.Generator().manual_seed(2))
    temps, ks, ps = [0.8, 0.0, 1.3, 1.0, 0.5], [0, 4, 2, 9, 5], [0.9, 1.0, 1.0, 0.3, 0.7]
    batched = _warp(logits, temps, ks, ps)
    for i in range(5):
        alone = _warp(logits[i : i + 1], [temps[i]], [ks[i]], [ps[i]])
        torch.testing.assert_close(batched[i : i + 1], alone, atol=0, rtol=0)
    # The rows really differ in what they kept: greedy, top-2, and the rest.
    support = (batched > 0).sum(dim=1)
    assert support[1] == 1 and support[2] <= 2 and support[0] > 2
    torch.testing.assert_close(batched.sum(dim=1), torch.ones(5, dtype=F64))


def test_sample_never_returns_zero_probability_token() -> None:
    probs = torch.tensor(
        [
            [0.2, 0.3, 0.5, 0.0, 0.0],  # zero tail
            [0.0, 0.0, 1e-300, 0.0, 0.0],  # a single tiny positive token
            [0.0, 0.5, 0.5, 0.0, 0.0],  # zero head: u = 0 must not pick token 0
            [0.1, 0.2, 0.3, 0.4 * (1 + 1e-15), 0.0],  # not exactly normalised
        ],
        dtype=F64,
    )
    for u in [0.0, 0.5, 1 - 2**-53, 1.0]:  # 1.0 is out of contract; the end guard still holds
        tokens = sample_from_probs(probs, torch.full((4,), u, dtype=F64))
        assert tokens.dtype == torch.int64
        assert (probs[torch.arange(4), tokens] > 0).all(), (u, tokens)
    top = sample_from_probs(probs, torch.full((4,), 1 - 2**-53, dtype=F64))
    assert top.tolist() == [2, 2, 2, 3]
    assert sample_from_probs(probs, torch.zeros(4, dtype=F64)).tolist() == [0, 2, 1, 0]


def test_sample_random_rows_with_zeros_and_extreme_uniforms() -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(2000, 7, generator=g, dtype=F64)
    probs *= torch.rand(2000, 7, generator=g) < 0.5
    probs[probs.sum(dim=1) == 0, 0] = 1.0
    u = torch.rand(2000, generator=g, dtype=F64)
    u[::3] = 1 - 2**-53
    tokens = sample_from_probs(probs, u)
    assert (probs[torch.arange(2000), tokens] > 0).all()


def test_sample_chi_square_goodness_of_fit() -> None:
    """20,000 draws from a 6-token distribution; χ² goodness of fit at level α = 1e-3."""
    p = torch.tensor([0.05, 0.1, 0.3, 0.2, 0.15, 0.2], dtype=F64)
    n = 20_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=F64)
    tokens = sample_from_probs(p.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=6).numpy()
    assert chisquare(counts, n * p.numpy()).pvalue > 1e-3
    # The test has power: the same draws are far from a slightly different distribution.
    q = torch.tensor([0.06, 0.1, 0.29, 0.2, 0.15, 0.2], dtype=F64)
    assert chisquare(counts, n * q.numpy()).pvalue < 1e-3
