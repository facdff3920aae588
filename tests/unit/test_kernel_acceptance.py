"""The acceptance kernels against `accept_ref`: compiled on CUDA, else in triton's interpreter.

The kernels decide acceptance with the reference's float64 rule and sample y by the same inverse
CDF of the same `u_sample` (only the order of the float64 sums differs, which matters at CDF
steps with probability ~1e-15), so every output is compared exactly (`torch.equal`): accept
counts, drafts, -1 placeholders and y. The distribution of y is then the reference's, which
tests/unit/test_acceptance.py checks by χ².
"""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.acceptance import AcceptanceOutput, accept, accept_ref, accept_triton
from dspark.kernels.dispatch import HAS_TRITON
from dspark.kernels.sampling import warp_probs

# tests/conftest.py asks for triton's interpreter (no CUDA) before anything imports triton.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (Linux x86-64)")

F64 = torch.float64


def _run(*args: torch.Tensor | None, **kwargs: int) -> AcceptanceOutput:
    """`accept_triton` on DEVICE, outputs back on the CPU."""
    moved = [None if a is None else a.to(DEVICE) for a in args]
    out = accept_triton(*moved, **kwargs)
    return AcceptanceOutput(out.num_accepted.cpu(), out.output_tokens.cpu())


def _cu(num_drafts: list[int]) -> torch.Tensor:  # [num_reqs + 1]
    return torch.tensor([0] + [n + 1 for n in num_drafts]).cumsum(0)


def _case(
    seed: int, num_drafts: list[int], max_draft: int, vocab: int, q_kind: str
) -> tuple[torch.Tensor, ...]:
    """Random p (peaked), q of `q_kind` (random / equal-to-p / one-hot / none), drafts x ~ q."""
    g = torch.Generator().manual_seed(seed)
    num_reqs, cu = len(num_drafts), _cu(num_drafts)
    p = torch.softmax(3 * torch.randn(int(cu[-1]), vocab, generator=g, dtype=F64), dim=-1)
    q = torch.softmax(3 * torch.randn(num_reqs, max_draft, vocab, generator=g, dtype=F64), -1)
    if q_kind == "p":  # q_j = p_{j-1}: every ratio is exactly 1
        for r, n in enumerate(num_drafts):
            q[r, :n] = p[cu[r] : cu[r] + n]
    ids = torch.empty(num_reqs, max_draft, dtype=torch.long)
    if max_draft > 0:
        ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(num_reqs, max_draft)
    if q_kind in ("one-hot", "none"):
        q = torch.nn.functional.one_hot(ids, vocab).to(F64)
    for r, n in enumerate(num_drafts):
        ids[r, n:] = -1
    u_acc = torch.rand(num_reqs, max_draft, generator=g, dtype=F64)
    u_s = torch.rand(num_reqs, generator=g, dtype=F64)
    return p, cu, ids, None if q_kind == "none" else q, u_acc, u_s


def _assert_equal(out: AcceptanceOutput, ref: AcceptanceOutput) -> None:
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert torch.equal(out.output_tokens, ref.output_tokens)


CASES = {  # name: (num_drafts, max_draft, vocab, q_kind)
    "varlen": ([2, 0, 3, 1], 3, 50, "random"),
    "all_zero_drafts": ([0, 0, 0], 2, 40, "random"),
    "no_draft_columns": ([0, 0], 0, 33, "none"),
    "all_max": ([4, 4, 4], 4, 37, "random"),
    "one_request": ([3], 3, 64, "random"),
    "p_equals_q": ([3, 1, 2], 3, 20, "p"),
    "one_hot_q": ([2, 3, 0, 1], 3, 30, "one-hot"),
    "deterministic_drafts": ([2, 3, 0, 1], 3, 30, "none"),
}


LAYOUTS = [(1, 2048), (3, 16)]  # (num_splits, block_v): one chunk, or chunks over 3 splits


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("num_splits", "block_v"), LAYOUTS, ids=["1split", "3splits_16"])
def test_outputs_equal_reference(name: str, num_splits: int, block_v: int) -> None:
    num_drafts, max_draft, vocab, q_kind = CASES[name]
    args = _case(list(CASES).index(name) * 10 + num_splits, num_drafts, max_draft, vocab, q_kind)
    out = _run(*args, num_splits=num_splits, block_v=block_v)
    _assert_equal(out, accept_ref(*args))
    if name == "p_equals_q":
        assert torch.equal(out.num_accepted, torch.tensor(num_drafts))


def test_a_larger_batch_equals_reference() -> None:
    """64 requests, ℓ in 0..6, vocab 300 in 64-token chunks over 4 splits."""
    g = torch.Generator().manual_seed(89)
    num_drafts = torch.randint(0, 7, (64,), generator=g).tolist()
    args = _case(89, num_drafts, 6, 300, "random")
    _assert_equal(_run(*args, num_splits=4, block_v=64), accept_ref(*args))


def test_one_hot_q_tensor_decides_like_no_q() -> None:
    args = _case(90, [3, 2, 3, 0, 1], 3, 25, "one-hot")
    _assert_equal(_run(*args), _run(*args[:3], None, *args[4:]))


def test_layout_and_batch_do_not_change_outputs() -> None:
    """Same tokens with any split count or chunk size, and for a request batched alone."""
    args = _case(91, [1, 2, 0, 2], 2, 100, "random")
    outs = [_run(*args, num_splits=s, block_v=b) for s, b in [(1, 128), (2, 16), (4, 32)]]
    _assert_equal(outs[0], outs[1])
    _assert_equal(outs[0], outs[2])
    p, cu, ids, q, u_acc, u_s = args
    alone = _run(p[cu[1] : cu[2]], torch.tensor([0, 3]), ids[1:2], q[1:2].contiguous(),
                 u_acc[1:2], u_s[1:2])  # fmt: skip
    assert torch.equal(alone.output_tokens[0], outs[0].output_tokens[1])


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


HALF_MINUS = 0.5 - 2**-54  # one ulp under 0.5
EDGES = {  # name: (p, num_drafts, ids, q or None, u_accept, u_sample, expected output_tokens)
    # Bonus from p_2 = uniform: CDF 0.25, 0.5, 0.75, 1; u = 0.5 sits on a step: token 2.
    "bonus_on_a_cdf_step": (
        [[0, 1, 0, 0], [0, 0, 1, 0], [0.25] * 4], [2], [[1, 2]], None, [[0.99, 0.99]], [0.5],
        [[1, 2, 2]],
    ),
    # Rejected one-hot draft; u_sample = 1 - 2^-53 rounds to the end of the CDF: the last
    # positive token, never the zeroed draft or a zero-mass tail.
    "end_of_cdf_takes_last_positive": (
        [[0.5, 0.5, 0.0, 0.0], [0, 0, 1, 0]], [1], [[1]], None, [[0.5]], [1 - 2**-53], [[0, -1]],
    ),
    # p_0 one ulp under q_1 everywhere: rejected, residual all zero, y from p_0 (0.75: token 1).
    "zero_residual_falls_back_to_p": (
        [[HALF_MINUS, HALF_MINUS, 0, 0], [0, 0, 0, 1]], [1], [[0]], [[[0.5, 0.5, 0, 0]]],
        [[1 - 2**-53]], [0.75], [[1, -1]],
    ),
    # q_1(x) = 0 < p_0(x): ratio taken as 1, accepted; then the bonus.
    "zero_draft_probability_accepts": (
        [[0.5, 0.5, 0, 0], [0, 0, 1, 0]], [1], [[1]], [[[1.0, 0, 0, 0]]], [[1 - 2**-53]], [0.0],
        [[1, 2]],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EDGES))
def test_edge_cases(name: str) -> None:
    p, num_drafts, ids, q, u_acc, u_s, expected = EDGES[name]
    args = (_t(p), _cu(num_drafts), torch.tensor(ids), None if q is None else _t(q),
            _t(u_acc), _t([u_s])[0])  # fmt: skip
    out = _run(*args, block_v=16)
    assert out.output_tokens.tolist() == expected
    _assert_equal(out, accept_ref(*args))


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_equals_reference_exactly(with_draft_probs: bool) -> None:
    """Greedy p (temperature 0): drafts accepted iff they are the argmax, y is the argmax."""
    g = torch.Generator().manual_seed(92)
    num_drafts, vocab = [3, 0, 1, 3, 2], 40
    cu = _cu(num_drafts)
    logits = torch.randn(int(cu[-1]), vocab, generator=g)
    rows = logits.shape[0]
    p = warp_probs(logits, torch.zeros(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows))
    argmax = logits.argmax(-1)
    ids = torch.full((5, 3), -1)
    for r, n in enumerate(num_drafts):  # the target's argmax 70% of the time, else random
        for j in range(n):
            hit = bool(torch.rand((), generator=g) < 0.7)
            ids[r, j] = argmax[cu[r] + j] if hit else torch.randint(0, vocab, (), generator=g)
    q = torch.softmax(torch.randn(5, 3, vocab, generator=g, dtype=F64), -1)
    u_acc, u_s = torch.rand(5, 3, generator=g, dtype=F64), torch.rand(5, generator=g, dtype=F64)
    args = (p, cu, ids, q if with_draft_probs else None, u_acc, u_s)
    _assert_equal(_run(*args, num_splits=2, block_v=16), accept_ref(*args))


def test_dispatch_runs_the_kernel_when_forced() -> None:
    args = [a.to(DEVICE) for a in _case(93, [2, 1], 2, 30, "random")]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DSPARK_KERNELS", "triton")
        forced = accept(*args)
    assert torch.equal(forced.output_tokens.cpu(), _run(*args).output_tokens)


def test_launcher_asserts_dtypes() -> None:
    p, cu, ids, q, u_acc, u_s = _case(94, [1], 1, 8, "random")
    with pytest.raises(AssertionError):
        _run(p.float(), cu, ids, q, u_acc, u_s)
    with pytest.raises(AssertionError):
        _run(p, cu, ids, q, u_acc.float(), u_s)
    with pytest.raises(AssertionError):
        _run(p, cu, ids.int(), q, u_acc, u_s)
