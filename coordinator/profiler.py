"""Profile the cost model on the real models (start-up or `dspark profile`).

Two profiles: `profile_workers` times the verbs the engine really calls (the target runner's
`verify`, forward and acceptance, and the proposer's `propose` rounds, greedy and sampling) and
is what the engine uses; `profile` times bare model forwards (verify and one draft position),
a cheaper approximation for tools that have models but no workers.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dspark.coordinator.cost_model import (
    CostModel,
    cache_key,
    hardware_key,
    interleaved_medians,
    median_time,
    monotone,
    smooth_profile,
)
from dspark.messages import DraftQuery, NewRequest, VerifyPlan
from dspark.models.decoder import DecoderLM
from dspark.models.kv_cache import PagedKVCache
from dspark.sampling_params import SamplingParams

VERIFY_STRIDE = 8  # past B = 16, verify sizes are timed this far apart and interpolated
DENSE_VERIFY = 16  # verify sizes up to this are timed one by one and smoothed (`smooth_profile`)
DENSE_DRAFT = 8  # likewise the drafting rounds' batch sizes


@torch.inference_mode()
def time_forward(model: DecoderLM, q_lens: list[int], context: int, repeats: int) -> float:
    """Median seconds of one varlen forward: request i brings q_lens[i] tokens after `context`."""
    cfg = model.config
    block = 16
    per_req = math.ceil((context + max(q_lens)) / block)
    param = next(model.parameters())
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         num_blocks=per_req * len(q_lens), block_size=block,
                         dtype=param.dtype, device=param.device)
    ids = [f"p{i}" for i in range(len(q_lens))]
    for r, n in zip(ids, q_lens, strict=False):
        cache.reserve(r, context + n)
    tokens = torch.randint(0, cfg.vocab_size, (sum(q_lens),), device=param.device)
    last = torch.tensor(q_lens).cumsum(0) - 1

    def run() -> None:
        # Metadata is rebuilt every call, as the engine does every step.
        meta = cache.metadata(ids, [context] * len(ids), q_lens)
        rows = torch.cat(
            [torch.arange(e - n, e + 1) for e, n in zip(last.tolist(), q_lens, strict=False)]
        )
        model.forward_paged(tokens, meta, cache, rows.to(param.device))

    return median_time(run, repeats)


def profile(target: DecoderLM, drafter: DecoderLM | None, b_max: int = 128, n_max: int = 64,
            context: int = 256, repeats: int = 5, key: str = "") -> CostModel:
    verify = []
    for b in tqdm(range(1, b_max + 1), desc="profile verify", unit="B"):
        verify.append(time_forward(target, [b], context, repeats))  # one request (see below)
    draft = []
    if drafter is not None:
        for n in tqdm(range(1, n_max + 1), desc="profile draft", unit="reqs"):
            draft.append(time_forward(drafter, [1] * n, context, repeats))
    hardware = hardware_key(str(next(target.parameters()).device))
    meta = {"hardware": hardware, "context": str(context), "repeats": str(repeats),
            "torch": torch.__version__}
    return CostModel(key or hardware, monotone(verify), monotone(draft), meta)


# Part of the cache key: a new method, or verbs made faster (v16: drafting rounds timed at the
# profiled context, `_Contexts`; v17: the dense sizes' middle knot only where the timings need
# it, `cost_model._kink_is_needed`), never reads old files.
PROFILE_VERSION = "workers-v17"
CATCH_UP = 2  # committed tokens a profiled drafting round feeds first (A + 1 of a typical step)
# Committed tokens a scratch request may gain over the profiled context before it is prefilled
# afresh (`_Contexts`): the rounds are timed at `context` to `context` + CONTEXT_SLACK tokens
CONTEXT_SLACK = 32
DRAFT_SPAN = 4  # positions of the long profiled round; per position = (t(4) - t(1)) / 3


def profile_workers(target: Any, proposer: Any | None, b_max: int = 128, n_max: int = 64,
                    context: int = 256, repeats: int = 5, key: str = "", block: int = 7,
                    device: str | None = None) -> CostModel:
    """Time the engine's own verbs on scratch requests (released afterwards).

    verify[B-1]: `target.verify` of one request's B tokens (an anchor and B − 1 drafts) after
    `context` cached tokens, acceptance included; verify_sampled: the same at temperature 1,
    drafts with their q. One request, so that the table's slope is what a further token costs:
    a live pass of R requests pays for R sequences whatever K is, and the step-time fit learns
    that part (`StepTimeFit`, c + v·(R − 1)). In requests of 8 tokens, each 8 tokens added a
    sequence: a further token was profiled at 0.237 ms where a pass of 16 requests paid 0.182
    between 16 and 128 tokens (one request: 0.183; demo target, one thread, 256 cached).
    Drafting rounds over n requests are timed after CATCH_UP new committed tokens (with their
    target hidden rows for a drafter that reads them), greedy and at temperature 1: with 1 and
    S positions, draft_first = t(1) and draft = (t(S) - t(1)) / (S - 1), where S is
    DRAFT_SPAN for a proposer that drafts one position per forward (`sequential_drafts`) and
    `block` for a parallel drafter (DSpark's one block pass: a further position still costs its
    Markov-head step and its q row, much less than a forward). catch_up: seconds per row of a
    lone request's first round over a whole `context`-token prompt, beyond a steady round's.
    Verify and draft sizes are timed on grids (`verify_grid`, `draft_grid`) in interleaved rounds
    (`interleaved_medians`) and interpolated; every table is made monotone.
    """
    vocab = target.config.vocab_size
    rng = torch.Generator().manual_seed(0)

    def prompt() -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (context,), generator=rng).tolist())

    verify = _profile_verify(target, prompt, b_max, context, repeats)
    tables = {"verify_sampled": _profile_verify(target, prompt, b_max, context, repeats, True)}
    catch_up = 0.0
    if proposer is not None:
        width = target.config.hidden_size * len(getattr(proposer, "hidden_layers", ()))
        for sampled in (False, True):
            first, each = _profile_rounds(proposer, prompt, n_max, repeats, sampled, width, block)
            suffix = "_sampled" if sampled else ""
            tables["draft_first" + suffix], tables["draft" + suffix] = first, each
        catch_up = _profile_catch_up(proposer, prompt, repeats, width, tables["draft_first"][0])
    hardware = hardware_key(device)
    meta = {"hardware": hardware, "context": str(context), "repeats": str(repeats),
            "torch": torch.__version__, "method": PROFILE_VERSION}
    return CostModel(key or hardware, verify, meta=meta, catch_up=catch_up, **tables)


def _profile_verify(target: Any, prompt: Any, b_max: int, context: int, repeats: int,
                    sampled: bool = False) -> tuple[float, ...]:
    tag = "sampled" if sampled else "greedy"
    req, text = f"__profile-verify-{tag}", prompt()
    params = SamplingParams(temperature=1.0 if sampled else 0.0)
    vocab = target.config.vocab_size
    try:
        target.add_request(NewRequest(req, text, params, seed=0))
        target.verify(_plan([req], [0], [text], [0]))  # prefill
        target.rollback({req: context - 1})  # the last prompt token is the anchor
        grid = verify_grid(b_max)
        runs = []
        for b in grid:
            inputs = text[-1:] + tuple(range(1, b))
            plan = _plan([req], [context - 1], [inputs], [b - 1], vocab if sampled else 0)

            def run(plan: VerifyPlan = plan) -> None:
                target.verify(plan)
                target.rollback({req: context - 1})

            runs.append(run)
        times = interleaved_medians(runs, repeats, desc=f"profile verify ({tag})")
    finally:
        target.release(req)
    return monotone(_interpolate(grid, smooth_profile(grid, times, DENSE_VERIFY)))


def _plan(ids: list[str], starts: list[int], inputs: list[tuple[int, ...]], num_draft: list[int],
          vocab: int = 0) -> VerifyPlan:
    """A verify plan whose drafts are the inputs' last tokens; with `vocab`, drafted from a
    uniform q (a sampled batch reads each draft's q), else deterministic (q one-hot)."""
    width = max(num_draft, default=0)
    drafts = torch.full((len(ids), width), -1, dtype=torch.long)  # [num_reqs, max_draft]
    for i, (toks, n) in enumerate(zip(inputs, num_draft, strict=False)):
        if n:
            drafts[i, :n] = torch.tensor(toks[-n:])
    probs = None
    if vocab and width:
        probs = torch.full((len(ids), width, vocab), 1.0 / vocab, dtype=torch.float64)
    return VerifyPlan(tuple(ids), tuple(starts), tuple(inputs), tuple(num_draft), drafts, probs,
                      sum(num_draft))


def verify_grid(b_max: int) -> list[int]:
    """Verify sizes that are timed: every B up to 16, then every multiple of VERIFY_STRIDE (the
    sizes a CUDA-graph engine captures, where its step time changes), and b_max."""
    sizes = list(range(1, min(16, b_max) + 1))
    sizes += list(range(16 + VERIFY_STRIDE, b_max, VERIFY_STRIDE))
    return sizes + ([b_max] if b_max > sizes[-1] else [])


def draft_grid(n_max: int) -> list[int]:
    """Batch sizes a drafting round is timed at: 1..8, then about 1.5x apart, and n_max."""
    sizes, n = list(range(1, min(8, n_max) + 1)), 8
    while n < n_max:
        n = min(n_max, max(n + 1, round(n * 1.5)))
        sizes.append(n)
    return sizes


def _profile_rounds(proposer: Any, prompt: Any, n_max: int, repeats: int, sampled: bool,
                    hidden_width: int, block: int
                    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    params = SamplingParams(temperature=1.0 if sampled else 0.0)
    tag = "sampled" if sampled else "greedy"
    ids = [f"__profile-draft-{tag}-{i}" for i in range(n_max)]
    grid = draft_grid(n_max)
    span = DRAFT_SPAN if getattr(proposer, "sequential_drafts", False) else max(2, block)
    rows = _hidden_rows(hidden_width)
    contexts = _Contexts(proposer, ids, params, prompt, rows)
    try:
        contexts.fill(ids)
        runs = [_round(proposer, ids[:n], k, rows, contexts) for n in grid for k in (1, span)]
        times = interleaved_medians(runs, repeats, desc=f"profile draft ({tag})")
        first = times[0::2]
        each = [
            max(0.0, (tn - t1) / (span - 1))
            for t1, tn in zip(times[0::2], times[1::2], strict=False)
        ]
    finally:
        contexts.release()
    first, each = smooth_profile(grid, first, DENSE_DRAFT), smooth_profile(grid, each, DENSE_DRAFT)
    return monotone(_interpolate(grid, first)), monotone(_interpolate(grid, each))


def _profile_catch_up(proposer: Any, prompt: Any, repeats: int, hidden_width: int,
                      steady_round: float) -> float:
    """Seconds per committed row a round takes in beyond a steady round's (CATCH_UP rows,
    `steady_round` seconds): the median over `repeats` fresh requests (after one warm-up) of
    the first round, which takes in the whole prompt, less the steady round, per extra row."""
    rows = _hidden_rows(hidden_width)
    prompts = [prompt() for _ in range(repeats + 1)]
    ids = [f"__profile-catch-up-{i}" for i in range(len(prompts))]
    times = []
    try:
        for i, (r, p) in enumerate(zip(ids, prompts, strict=False)):
            proposer.add_request(NewRequest(r, (), SamplingParams(temperature=0.0), seed=i))
            start = time.perf_counter()
            proposer.propose([DraftQuery(r, p, 1, rows(len(p) - 1))])
            if i:
                times.append(time.perf_counter() - start)
    finally:
        for r in ids:
            proposer.release(r)
    extra = max(1, len(prompts[0]) - 1 - CATCH_UP)
    return max(0.0, (statistics.median(times) - steady_round) / extra)


def _hidden_rows(width: int) -> Callable[[int], torch.Tensor | None]:
    """Random target hidden rows [n, width] for a drafter that reads them (None otherwise)."""
    def rows(n: int) -> torch.Tensor | None:
        return torch.randn(n, width) if width else None
    return rows


class _Contexts:
    """The drafting profile's scratch requests: each starts with a `prompt()` of committed
    tokens (with their target rows, for a drafter that reads them) and gains CATCH_UP a round.
    Before a run would take one past CONTEXT_SLACK gained tokens, that request is released and
    prefilled afresh (untimed), so every round is timed at the profile's context. Left to grow,
    the first requests (in every size's rounds) reached ~900 tokens at n_max = 64, and a round
    pays for its longest context: 64 requests of the demo draft model drafted one position in
    22 ms at 556 tokens against 14 ms at 256 (DSpark: 33 against 24), and the profile priced a
    64-request DSpark round at 2.7x its cost at the stated context."""

    def __init__(self, proposer: Any, ids: list[str], params: SamplingParams,
                 prompt: Callable[[], tuple[int, ...]],
                 rows: Callable[[int], torch.Tensor | None]) -> None:
        self.proposer, self.params, self.prompt, self.rows = proposer, params, prompt, rows
        self.seeds = {r: i for i, r in enumerate(ids)}
        self.gained: dict[str, int] = {}  # request -> committed tokens since its prefill

    def fill(self, ids: list[str]) -> None:
        """Prefill `ids` afresh: every prompt position but the anchor has its target rows."""
        prompts = []
        for r in ids:
            if r in self.gained:
                self.proposer.release(r)
            self.proposer.add_request(NewRequest(r, (), self.params, seed=self.seeds[r]))
            prompts.append(self.prompt())
        self.proposer.propose(
            [DraftQuery(r, p, 1, self.rows(len(p) - 1)) for r, p in zip(ids, prompts, strict=True)]
        )
        for r in ids:
            self.proposer.commit(r, 0)
            self.gained[r] = 0

    def make_room(self, ids: list[str], rounds: int) -> None:
        """Prefill afresh those of `ids` that `rounds` more rounds would take past the slack."""
        full = [r for r in ids if self.gained[r] + rounds * CATCH_UP > CONTEXT_SLACK]
        if full:
            self.fill(full)

    def grew(self, ids: list[str]) -> None:
        for r in ids:
            self.gained[r] += CATCH_UP

    def release(self) -> None:
        """Release every scratch request (a no-op for one never added)."""
        for r in self.seeds:
            self.proposer.release(r)
        self.gained.clear()


def _round(proposer: Any, ids: list[str], positions: int,
           rows: Callable[[int], torch.Tensor | None],
           contexts: _Contexts | None = None) -> Callable[[], float]:
    """A steady drafting round over `ids`: one untimed round, then the timed one. The rounds
    of the profile run in a shuffled order of sizes up to n_max, so a round's own first call
    runs cold (the larger rounds before it evicted the drafter from the caches): at 1 in
    flight on a CPU that measured 1.7x the steady rounds of a request that drafts every step.
    The budget prices steady rounds with the profile and learns a cold round's premium online
    (`Fit.resume_scale`). `contexts`: keeps the requests' context bounded (`_Contexts`)."""
    def one() -> float:
        queries = [DraftQuery(r, tuple(range(CATCH_UP)), positions, rows(CATCH_UP)) for r in ids]
        start = time.perf_counter()
        proposer.propose(queries)
        seconds = time.perf_counter() - start
        for r in ids:
            proposer.commit(r, 0)
        if contexts is not None:
            contexts.grew(ids)
        return seconds

    def run() -> float:
        if contexts is not None:
            contexts.make_room(ids, 2)
        one()
        return one()

    return run


def _interpolate(grid: list[int], values: list[float]) -> list[float]:
    """Values at 1..grid[-1], linear between the measured sizes."""
    out = []
    for n in range(1, grid[-1] + 1):
        hi = next(i for i, g in enumerate(grid) if g >= n)
        if grid[hi] == n or hi == 0:
            out.append(values[hi])
            continue
        lo = hi - 1
        w = (n - grid[lo]) / (grid[hi] - grid[lo])
        out.append(values[lo] + w * (values[hi] - values[lo]))
    return out


def load_or_profile(target_dir: str | Path, drafter_dir: str | Path | None, target: Any,
                    proposer: Any | None, cache_dir: str | Path, layout: str = "local",
                    device: str | None = None, **kwargs: int) -> CostModel:
    """The persisted worker profile for these models, this hardware and this worker `layout`
    (in-process or a Ray TP degree), measured once if missing.

    `target` is the target worker, `proposer` the proposer whose drafting rounds are timed (None:
    no drafting cost is modelled). The key names the proposer kind, its checkpoint (if any), the
    layout and the profile method; `device` (the workers', None: this machine's) names the
    hardware."""
    dirs = [target_dir] + ([drafter_dir] if drafter_dir is not None else [])
    kind = getattr(proposer, "name", "none") if proposer is not None else "none"
    key = f"{cache_key(dirs, device)}-{kind}-{layout}-{PROFILE_VERSION}"
    path = Path(cache_dir) / f"{key}.json"
    if path.exists():
        return CostModel.load(path)
    model = profile_workers(target, proposer, key=key, device=device, **kwargs)
    model.save(path)
    return model


def plot(cost: CostModel, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(range(1, len(cost.verify) + 1), [t * 1e3 for t in cost.verify])
    axes[0].set_xlabel("verify tokens B")
    axes[0].set_ylabel("ms per pass")
    axes[0].set_title("target verify step")
    for name, style in (("draft_first", "-"), ("draft", "--"), ("draft_first_sampled", "-"),
                        ("draft_sampled", "--")):
        table = getattr(cost, name)
        if table:
            axes[1].plot(range(1, len(table) + 1), [t * 1e3 for t in table], style,
                         label=name.replace("_", " "))
    if cost.draft:
        axes[1].legend(fontsize=7)
    axes[1].set_xlabel("requests")
    axes[1].set_ylabel("ms")
    axes[1].set_title("drafting round: first position, each further one")
    fig.suptitle(cost.key, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)
