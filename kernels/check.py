"""GPU check of every kernel: correctness against its reference, then timing against ceilings.

    python -m dspark.kernels.check

On CUDA it (1) runs each Triton kernel and its torch reference on random, irregular inputs and
compares them (attention against the float64 reference at a stated tolerance per dtype; integer
outputs, sampled tokens included, exactly), (2) measures the device's copy
bandwidth (a 1 GiB device-to-device copy) and bf16 matmul rate, and (3) times kernel and
reference at the issue's goal shapes: median of many runs with CUDA events, warm-up excluded,
L2 flushed and the host launch hidden behind a GPU sleep before each run. It prints one table
with achieved bandwidth against the measured copy bandwidth. Without CUDA it says so and exits 0.

Goals (issue 5, H200): verify attention >= 50% of copy bandwidth at 64 requests x 8 query tokens
x 4k context; acceptance <= 50 µs at 64 requests x 8 positions x 151,936 vocabulary.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dspark.kernels.acceptance import accept_ref, accept_triton
from dspark.kernels.dispatch import HAS_TRITON, interpreting
from dspark.kernels.paged_attention import (
    AttentionMetadata,
    kv_write_ref,
    kv_write_triton,
    paged_attention_ref,
    paged_attention_triton,
)

F64 = torch.float64
TOLERANCES = {  # dtype: (atol, rtol) against the float64 reference, as in the unit tests
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(frozen=True)
class Shapes:
    """Sizes of the timed problems: the issue's goal shapes, or tiny ones for `--smoke`."""

    reqs: int  # requests in the batch
    q_len: int  # verify tokens per request (1 + ℓ)
    ctx: int  # keys per request
    vocab: int
    dtypes: tuple[torch.dtype, ...]  # attention dtypes checked; the last one is timed
    copy_bytes: int  # the copy that measures bandwidth
    matmul_n: int  # the square matmul that measures the matrix rate
    runs: int  # timed runs per kernel (the reference gets a fifth)
    sweep: tuple[tuple[int, ...], ...] = ((32, 64, 128), (4, 8), (2, 3))  # BLOCK_N, warps, stages


ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GOAL = Shapes(64, 8, 4096, 151_936, ALL_DTYPES, copy_bytes=1 << 30, matmul_n=8192, runs=50)
# Every code path on the CPU, in triton's interpreter (no bfloat16 there), in about a minute.
SMOKE = Shapes(2, 3, 70, 3000, ALL_DTYPES[:2], 1 << 22, 128, runs=1, sweep=((128,), (4,), (2,)))


@dataclass(frozen=True)
class Row:
    """One line of the timing table."""

    op: str
    shape: str
    impl: str
    micros: float
    bytes_moved: float
    flops: float = 0.0
    goal: str = ""


# ---------------------------------------------------------------------------------------------
# Inputs


def attention_batch(
    q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: torch.device, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:  # fmt: skip
    """Random q and caches; each request's pages are scattered over shuffled physical blocks."""
    g = torch.Generator(device=device).manual_seed(seed)
    num_reqs = len(q_lens)
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 1
    physical = torch.randperm(num_blocks, generator=g, device=device)
    tables = torch.full((num_reqs, max(pages)), -1, dtype=torch.long, device=device)
    start = 0
    for r, n in enumerate(pages):
        tables[r, :n] = physical[start : start + n]
        start += n
    q_len_t = torch.tensor(q_lens, device=device)
    seq_t = torch.tensor(seq_lens, device=device)
    token_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), q_len_t)
    cu = torch.zeros(num_reqs + 1, dtype=torch.long, device=device)
    cu[1:] = q_len_t.cumsum(0)
    local = torch.arange(len(token_req), device=device) - cu[token_req]
    positions = seq_t[token_req] - q_len_t[token_req] + local  # the last q_len positions
    slots = tables[token_req, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        positions=positions, cu_seqlens_q=cu, seq_lens=seq_t, block_tables=tables,
        slot_mapping=slots, block_size=block_size, max_q=max(q_lens), max_ctx=max(seq_lens),
    )  # fmt: skip
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    q = torch.randn(len(token_req), heads, head_dim, generator=g, device=device).to(dtype)
    return q, k_cache, v_cache, meta


def acceptance_batch(
    num_drafts: list[int], max_draft: int, vocab: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, ...]:
    """Peaked p; q = p's logits plus noise, so acceptance is neither certain nor rare; x ~ q."""
    g = torch.Generator(device=device).manual_seed(seed)
    num_reqs = len(num_drafts)
    cu = torch.zeros(num_reqs + 1, dtype=torch.long, device=device)
    cu[1:] = (torch.tensor(num_drafts, device=device) + 1).cumsum(0)
    logits = 3 * torch.randn(int(cu[-1]), vocab, generator=g, device=device, dtype=F64)
    p = torch.softmax(logits, dim=-1)
    rows = torch.clamp(cu[:-1, None] + torch.arange(max_draft, device=device), max=len(p) - 1)
    noise = torch.randn(num_reqs, max_draft, vocab, generator=g, device=device, dtype=F64)
    q = torch.softmax(logits[rows] + noise, dim=-1)
    ids = torch.multinomial(q.view(-1, vocab).float(), 1, generator=g).view(num_reqs, max_draft)
    ids[torch.arange(max_draft, device=device) >= cu.diff()[:, None] - 1] = -1
    u_acc = torch.rand(num_reqs, max_draft, generator=g, device=device, dtype=F64)
    u_s = torch.rand(num_reqs, generator=g, device=device, dtype=F64)
    return p, cu, ids, q, u_acc, u_s


# ---------------------------------------------------------------------------------------------
# Correctness


def check_attention(device: torch.device, shapes: Shapes) -> None:
    n, ctx = shapes.q_len, shapes.ctx
    cases = [  # q_lens, seq_lens, heads, kv_heads, head_dim, block_size
        ([1, 4, 9, 3], [1, 64, 139, 20], 8, 2, 64, 16),
        ([n] * 5 + [1], [ctx, 17, 64, 65, 300, 1], 32, 8, 128, 16),
        ([70, 2], [70, 7], 4, 1, 64, 16),
        ([n] * shapes.reqs, [ctx] * shapes.reqs, 32, 8, 128, 16),  # the timed shape
    ]
    for dtype in shapes.dtypes:
        for i, case in enumerate(cases):
            q, kc, vc, meta = attention_batch(*case, dtype, device, seed=i)
            got = paged_attention_triton(q, kc, vc, meta, case[4] ** -0.5)
            want = paged_attention_ref(q.double(), kc.double(), vc.double(), meta, case[4] ** -0.5)
            atol, rtol = TOLERANCES[dtype]
            torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def check_kv_write(device: torch.device, shapes: Shapes) -> None:
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator(device=device).manual_seed(1)
        k_cache = torch.randn(64, 16, 8, 128, generator=g, device=device).to(dtype)
        v_cache = torch.randn(64, 16, 8, 128, generator=g, device=device).to(dtype)
        slots = torch.randperm(64 * 16, generator=g, device=device)[:517]
        k = torch.randn(517, 8, 128, generator=g, device=device).to(dtype)
        v = torch.randn(517, 8, 128, generator=g, device=device).to(dtype)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        kv_write_ref(k, v, want_k, want_v, slots)
        kv_write_triton(k, v, k_cache, v_cache, slots)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def check_acceptance(device: torch.device, shapes: Shapes) -> None:
    """Timed-size batches with ℓ in 0..max: every output equal to the reference's (y included)."""
    g = torch.Generator().manual_seed(2)
    ell = shapes.q_len
    for seed in range(3):
        num_drafts = torch.randint(0, ell + 1, (shapes.reqs,), generator=g).tolist()
        args = acceptance_batch(num_drafts, ell, shapes.vocab, device, seed=3 + seed)
        for draft_probs in (args[3], None):
            case = (*args[:3], draft_probs, *args[4:])
            got, want = accept_triton(*case), accept_ref(*case)
            assert torch.equal(got.num_accepted, want.num_accepted), "accept counts differ"
            differ = (got.output_tokens != want.output_tokens).any(dim=1).sum()
            assert int(differ) == 0, f"{int(differ)} of {shapes.reqs} requests emit other tokens"


# ---------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Median device time of `fn` from CUDA events; L2 flushed and launch hidden before each run.

    On the CPU (`--smoke`) it falls back to wall-clock time, only to exercise the code.
    """

    def __init__(self, device: torch.device, runs: int) -> None:
        self.cuda = device.type == "cuda"
        self.runs = runs
        self.flush = torch.empty((256 << 20) if self.cuda else 1, dtype=torch.uint8, device=device)
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn: Callable[[], object], runs: int | None = None) -> float:
        runs = max(1, runs or self.runs)
        for _ in range(min(5, runs)):  # warm-up: compilation, autotuning, allocator
            fn()
        self._sync()
        times = []
        for _ in range(runs):
            self.flush.zero_()
            if self.cuda:
                _sleep(200_000)  # the GPU waits while the host enqueues: no launch gap timed
                self.start.record()
                fn()
                self.end.record()
                self.end.synchronize()
                times.append(self.start.elapsed_time(self.end) * 1e3)  # µs
            else:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _sleep(cycles: int) -> None:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def copy_bandwidth(timer: Timer, device: torch.device, shapes: Shapes) -> float:  # bytes / s
    src = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    micros = timer(lambda: dst.copy_(src), runs=20)
    return 2 * src.numel() / (micros * 1e-6)


def matmul_rate(timer: Timer, device: torch.device, shapes: Shapes) -> float:  # flop / s
    n = shapes.matmul_n
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    micros = timer(lambda: a @ b, runs=20)
    return 2 * n**3 / (micros * 1e-6)


def time_attention(timer: Timer, device: torch.device, shapes: Shapes, head_dim: int) -> list[Row]:
    heads, kv_heads, q_len, ctx, reqs = 32, 8, shapes.q_len, shapes.ctx, shapes.reqs
    dtype = shapes.dtypes[-1]  # bfloat16 on CUDA
    q, kc, vc, meta = attention_batch([q_len] * reqs, [ctx] * reqs, heads, kv_heads, head_dim,
                                      16, dtype, device, seed=5)  # fmt: skip
    scale = head_dim**-0.5
    size = q.element_size()
    moved = (2 * reqs * ctx * kv_heads * head_dim + 2 * q.numel()) * size  # K, V once; q, out
    flops = 4 * reqs * q_len * heads * ctx * head_dim  # QK and PV (the causal tail is negligible)
    shape = f"{reqs}x{q_len}q x {ctx} ctx, h{heads}/kv{kv_heads}, d{head_dim}, {_name(dtype)}"
    kernel = timer(lambda: paged_attention_triton(q, kc, vc, meta, scale))
    ref = timer(lambda: paged_attention_ref(q, kc, vc, meta, scale), runs=timer.runs // 5)
    goal = ">= 50% copy BW"
    return [
        Row("verify attention", shape, "triton", kernel, moved, flops, goal),
        Row("verify attention", shape, "torch ref", ref, moved, flops),
    ]


def sweep_attention(timer: Timer, device: torch.device, shapes: Shapes) -> list[str]:
    n, ctx, reqs, dtype = shapes.q_len, shapes.ctx, shapes.reqs, shapes.dtypes[-1]
    q, kc, vc, meta = attention_batch([n] * reqs, [ctx] * reqs, 32, 8, 128, 16, dtype, device, 6)
    lines = []
    for block_n, num_warps, num_stages in itertools.product(*shapes.sweep):
        config = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
        try:
            run = functools.partial(paged_attention_triton, q, kc, vc, meta, 128**-0.5, **config)
            result = f"{timer(run, runs=timer.runs // 2):9.1f} µs"
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            result = f"failed: {type(e).__name__}: {e}"[:120]
        lines.append(f"  BLOCK_N={block_n:<4} warps={num_warps} stages={num_stages}  {result}")
    return lines


def time_acceptance(timer: Timer, device: torch.device, shapes: Shapes) -> list[Row]:
    reqs, ell, vocab = shapes.reqs, shapes.q_len, shapes.vocab
    p, cu, ids, q, u_acc, u_s = acceptance_batch([ell] * reqs, ell, vocab, device, seed=7)
    rows = []
    for name, draft_probs in (("q given", q), ("q one-hot", None)):
        args = (p, cu, ids, draft_probs, u_acc, u_s)
        out = accept_triton(*args)
        rejected = int((out.num_accepted < ell).sum())
        # p_A for every request and q_{A+1} after a rejection (float64 rows), then one chunk
        # of 2048 tokens of each again.
        rows_read = reqs + (rejected if draft_probs is not None else 0)
        moved = (vocab + 2048) * 8 * rows_read
        shape = f"{reqs}x{ell} drafts x {vocab} vocab, f64, {name}"
        kernel = timer(lambda args=args: accept_triton(*args))
        ref = timer(lambda args=args: accept_ref(*args), runs=timer.runs // 5)
        rows.append(Row("acceptance", shape, "triton", kernel, moved, goal="<= 50 µs"))
        rows.append(Row("acceptance", shape, "torch ref", ref, moved))
    return rows


def time_kv_write(timer: Timer, device: torch.device, shapes: Shapes) -> list[Row]:
    tokens, kv_heads, head_dim, dtype = shapes.reqs * shapes.q_len, 8, 128, shapes.dtypes[-1]
    num_blocks = shapes.reqs * -(-shapes.ctx // 16)
    k_cache = torch.zeros(num_blocks, 16, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    g = torch.Generator(device=device).manual_seed(8)
    slots = torch.randperm(k_cache.shape[0] * 16, generator=g, device=device)[:tokens]
    k = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    moved = 2 * 2 * k.numel() * k.element_size()  # k and v, read and written
    shape = f"{tokens} tokens, kv{kv_heads}, d{head_dim}, {_name(dtype)}"
    kernel = timer(lambda: kv_write_triton(k, v, k_cache, v_cache, slots))
    ref = timer(lambda: kv_write_ref(k, v, k_cache, v_cache, slots))
    return [
        Row("kv write", shape, "triton", kernel, moved),
        Row("kv write", shape, "torch ref", ref, moved),
    ]


# ---------------------------------------------------------------------------------------------


_WIDTHS = (17, 9, 10, 8, 7, 8, 6, 7, 0)  # table columns; the first two left-aligned


def _format(cells: tuple[str, ...]) -> str:
    pairs = enumerate(zip(cells, _WIDTHS, strict=True))
    return "  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in pairs)


def print_table(rows: list[Row], copy_bw: float, mm_rate: float) -> None:
    ref_time = {(r.op, r.shape): r.micros for r in rows if r.impl == "torch ref"}
    head = _format(("op", "impl", "µs", "GB/s", "% copy", "TFLOP/s", "% mm", "vs ref", "goal"))
    print(head)
    print("-" * len(head))
    shape = None
    for r in rows:
        if r.shape != shape:
            print(f"  {r.shape}")
            shape = r.shape
        seconds = r.micros * 1e-6
        bw = r.bytes_moved / seconds
        tflops = f"{r.flops / seconds / 1e12:.1f}" if r.flops else "-"
        mm = f"{100 * r.flops / seconds / mm_rate:.1f}" if r.flops else "-"
        verdict = ""
        if r.goal.startswith(">="):
            verdict = " MET" if bw >= 0.5 * copy_bw else " NOT MET"
        elif r.goal.startswith("<="):
            verdict = " MET" if r.micros <= 50 else " NOT MET"
        speedup = ref_time.get((r.op, r.shape), r.micros) / r.micros
        print(_format((
            r.op, r.impl, f"{r.micros:.1f}", f"{bw / 1e9:.0f}", f"{100 * bw / copy_bw:.1f}", tflops,
            mm, f"{speedup:.1f}x", r.goal + verdict,
        )))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.kernels.check", description=__doc__)
    parser.add_argument(
        "--smoke", action="store_true",
        help="tiny shapes; without CUDA, on the CPU in triton's interpreter (TRITON_INTERPRET=1)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(
            "dspark.kernels.check: no CUDA device, nothing to check. (The unit tests run the "
            "kernels in triton's CPU interpreter: pytest tests/unit/test_kernel_*.py)"
        )
        return 0
    if not HAS_TRITON:
        print("dspark.kernels.check: triton is not installed")
        return 1
    if not cuda and not interpreting():
        print("dspark.kernels.check --smoke without CUDA needs TRITON_INTERPRET=1")
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    shapes = SMOKE if args.smoke else GOAL
    if not cuda:
        shapes = replace(shapes, dtypes=tuple(d for d in shapes.dtypes if d != torch.bfloat16))
    triton = importlib.import_module("triton")
    name = torch.cuda.get_device_name(device) if cuda else "CPU (triton interpreter)"
    print(f"{name}; torch {torch.__version__}, triton {triton.__version__}")
    failed = 0
    print("correctness (kernel against reference):")
    for what, check in (
        (f"paged attention ({', '.join(map(_name, shapes.dtypes))} vs float64)", check_attention),
        ("kv write (exact)", check_kv_write),
        ("acceptance (every output token exact)", check_acceptance),
    ):
        try:
            check(device, shapes)
            print(f"  PASS  {what}")
        except Exception:  # noqa: BLE001 - report every check, then fail at the end
            failed += 1
            print(f"  FAIL  {what}\n{traceback.format_exc()}")
    print("  n/a   budget allocation: torch only, no kernel (dspark.kernels.budget says why)")

    timer = Timer(device, shapes.runs)
    copy_bw, mm_rate = copy_bandwidth(timer, device, shapes), matmul_rate(timer, device, shapes)
    print(f"\nceilings: copy bandwidth {copy_bw / 1e9:.0f} GB/s ({shapes.copy_bytes >> 20} MiB "
          f"device-to-device copy, read + write), matmul {mm_rate / 1e12:.1f} TFLOP/s "
          f"({shapes.matmul_n}^3)\n")  # fmt: skip
    rows: list[Row] = []
    for what, timing in (
        ("attention d128", lambda: time_attention(timer, device, shapes, 128)),
        ("attention d64", lambda: time_attention(timer, device, shapes, 64)),
        ("acceptance", lambda: time_acceptance(timer, device, shapes)),
        ("kv write", lambda: time_kv_write(timer, device, shapes)),
    ):
        try:
            rows += timing()
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"timing {what} FAILED\n{traceback.format_exc()}")
    print_table(rows, copy_bw, mm_rate)
    print("\nattention configs at the d128 shape (default: BLOCK_N=64, 4 warps, 2 stages):")
    try:
        print("\n".join(sweep_attention(timer, device, shapes)))
    except Exception:  # noqa: BLE001
        failed += 1
        print(traceback.format_exc())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
