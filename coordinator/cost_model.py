"""Step-cost model: how long a verify pass of B tokens and a drafting round take.

Profiled at start-up (or by `dspark profile`): medians of interleaved rounds over a grid of
verify sizes B up to B_max and draft batch sizes n up to n_max, interpolated and made monotone
(a larger batch never costs less), persisted as JSON keyed by model and hardware, and reloaded.

The scheduler asks `step_time(B, num_reqs, draft_positions, sampled)`: the verify time of B tokens
plus the drafting round (an autoregressive draft model: one forward per position; DSpark: one
block pass, then a Markov-head step and a q row per position): its first position
(`draft_first`: the catch-up over the committed tokens the drafter lacks and the call's fixed
cost) and each further position (`draft`). Each table is measured greedy and sampling
(`*_sampled`): at temperature > 0 a round warps and draws per position, and a verify pass
warps p and reads each draft's q. A profile of the real worker verbs
(`coordinator.profiler.profile_workers`) fills every table; a forward-only profile fills
`verify` and `draft` and leaves the others empty (they then default to those two).
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark.models.device import resolve_device


@dataclass(frozen=True)
class CostModel:
    """Measured step times in seconds. `verify[b - 1]` is a pass of b tokens."""

    key: str
    verify: tuple[float, ...]  # [B_max] seconds for a verify pass of 1..B_max tokens
    draft: tuple[float, ...] = ()  # [n_max] seconds for one draft position over 1..n_max requests
    meta: dict[str, str] = field(default_factory=dict)
    draft_first: tuple[float, ...] = ()  # [n_max] seconds of a round's first position
    draft_sampled: tuple[float, ...] = ()  # [n_max] `draft` at temperature 1
    draft_first_sampled: tuple[float, ...] = ()  # [n_max] `draft_first` at temperature 1
    # [B_max] `verify` when the batch samples: p is warped and each draft's q(x) read
    verify_sampled: tuple[float, ...] = ()
    # Seconds per committed row a drafting round takes in beyond a steady round's: what a
    # request that did not draft in the previous step (new, idle, probed) first catches up on.
    catch_up: float = 0.0

    def __post_init__(self) -> None:
        if not self.verify:
            raise ValueError("CostModel.verify: needs at least one measurement")

    def verify_time(self, num_tokens: int, sampled: bool = False) -> float:
        """Time of a verify pass of `num_tokens`; linear extrapolation past the profiled range."""
        return _lookup(self.verify_sampled if sampled and self.verify_sampled else self.verify,
                       num_tokens)

    def draft_costs(self, num_reqs: int, sampled: bool = False) -> tuple[float, float]:
        """(first position, each further position) of a drafting round over `num_reqs`."""
        per = self.draft_sampled if sampled and self.draft_sampled else self.draft
        first = (
            self.draft_first_sampled if sampled and self.draft_first_sampled else self.draft_first
        )
        if not per or num_reqs <= 0:
            return 0.0, 0.0
        each = _lookup(per, num_reqs)
        return (_lookup(first, num_reqs) if first else each), each

    def catch_up_time(self, rows: float) -> float:
        """Seconds a drafting round spends taking in `rows` committed rows it missed."""
        return self.catch_up * rows

    def draft_time(self, num_reqs: int, positions: int, sampled: bool = False) -> float:
        """Time of a drafting round of `positions` sequential positions over `num_reqs`."""
        if positions <= 0:
            return 0.0
        first, each = self.draft_costs(num_reqs, sampled)
        return first + (positions - 1) * each

    def step_time(self, num_tokens: int, num_reqs: int = 0, draft_positions: int = 0,
                  sampled: bool = False) -> float:
        return (self.verify_time(num_tokens, sampled)
                + self.draft_time(num_reqs, draft_positions, sampled))

    def verify_times(self, num_tokens: int, count: int, sampled: bool = False) -> np.ndarray:
        """[count] seconds of verify passes of `num_tokens` + i tokens, i = 0..count−1: the
        budget's candidate passes of one batch. numpy,
        not torch: the budget calls this every step, where each torch op's dispatch (~5 µs)
        costs more than its arithmetic; within the profiled range it is a slice of the table."""
        sampled = sampled and bool(self.verify_sampled)
        table = self._verify_sampled_array if sampled else self._verify_array
        if num_tokens >= 1 and num_tokens + count - 1 <= table.shape[0]:
            return table[num_tokens - 1:num_tokens - 1 + count]
        return _lookup_many(table, num_tokens + np.arange(count))

    @functools.cached_property
    def _verify_array(self) -> np.ndarray:  # [B_max] float64, built once (frozen tables)
        return np.asarray(self.verify, dtype=np.float64)

    @functools.cached_property
    def _verify_sampled_array(self) -> np.ndarray:  # [B_max] float64
        return np.asarray(self.verify_sampled, dtype=np.float64)

    # --- persistence -----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        raw: dict[str, object] = {"key": self.key, "meta": self.meta, "catch_up": self.catch_up}
        raw.update({name: list(getattr(self, name)) for name in _TABLES})
        path.write_text(json.dumps(raw, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        raw = json.loads(Path(path).read_text())
        tables = {name: tuple(raw.get(name, ())) for name in _TABLES}
        return cls(raw["key"], meta=raw.get("meta", {}), catch_up=float(raw.get("catch_up", 0.0)),
                   **tables)

    @classmethod
    def linear(cls, fixed: float, per_token: float, b_max: int = 512, draft_fixed: float = 0.0,
               n_max: int = 256) -> CostModel:
        """A parametric model: fixed + per_token·B (tests and simulations)."""
        verify = tuple(fixed + per_token * b for b in range(1, b_max + 1))
        draft = tuple(draft_fixed for _ in range(n_max)) if draft_fixed else ()
        return cls("linear", verify, draft)


_TABLES = ("verify", "draft", "draft_first", "draft_sampled", "draft_first_sampled",
           "verify_sampled")


def _lookup(table: tuple[float, ...], n: int) -> float:
    if n <= 0:
        return 0.0
    if n <= len(table):
        return table[n - 1]
    slope = (table[-1] - table[0]) / max(1, len(table) - 1)
    return table[-1] + slope * (n - len(table))


def _lookup_many(table: np.ndarray, n: np.ndarray) -> np.ndarray:
    """`_lookup` over an array of sizes (the same extrapolation past the table)."""
    size = table.shape[0]
    slope = (table[-1] - table[0]) / max(1, size - 1)
    inside = table[np.clip(n, 1, size) - 1]
    beyond = table[-1] + slope * (n - size)
    return np.where(n <= 0, 0.0, np.where(n <= size, inside, beyond))


def smooth_profile(grid: list[int], values: list[float], dense_up_to: int) -> list[float]:
    """`values` measured at sizes `grid` (every size up to `dense_up_to`, sparser beyond),
    replaced by a least-squares piecewise-linear fit through knots at 1, `dense_up_to` / 2,
    `dense_up_to`, then at each doubling of it and at the largest size; the knot at
    `dense_up_to` / 2 only where the timings need it (`_kink_is_needed`).

    Timed one by one, neighbouring sizes differ by more noise (±5–10% of a step on a shared
    CPU) than by their true cost (one more token or request), and the monotone fit then pools
    them into flat runs: a run of sizes "for free", which the budget's argmax seeks out
    (measured: verify of 4 and 5 tokens profiled alike, then 1.1 ms apart live, and K = 4
    chosen over K = 3 at a loss). The sparse sizes beyond were kept as timed until one low
    point did the same at 4 in flight, sampling: verify of 24 tokens profiled 0.9 ms above 16
    (0.11 ms a token) where passes cost 0.21 ms a token live both there and in the profile's
    16 -> 32, and the budget verified 3.6 more drafts a step than fixed k = 3 for 0.8 more
    tokens. A few segments fitted over many sizes keep the shape (flat, then rising on a GPU;
    about linear on a CPU) and lose the noise; this engine captures no CUDA graphs, whose
    sizes would be real steps."""
    xs = np.asarray(grid, dtype=np.float64)
    ys = np.asarray(values, dtype=np.float64)
    knots = [1, dense_up_to]
    if _kink_is_needed(xs, ys, dense_up_to):
        knots.insert(1, dense_up_to // 2)
    while knots[-1] < grid[-1]:
        knots.append(min(2 * knots[-1], grid[-1]))
    knots = sorted(set(min(k, grid[-1]) for k in knots))
    if len(knots) < 2:
        return list(values)
    fitted, _ = _knot_fit(xs, ys, knots)
    # Never below the cheapest size measured: a line through noise can dip under it at an end
    # (below zero for a per-position cost measured near 0).
    return [float(f) for f in np.maximum(fitted, min(values))]


# The dense sizes' middle knot (a change of slope) stays only where dropping it raises their
# residual sum of squares by this F ratio: about the 1% level for the 10–15 residual degrees
# of freedom of sizes 1..16 (1..8 for drafting rounds: ~2.5%).
KINK_F = 10.0


def _kink_is_needed(xs: np.ndarray, ys: np.ndarray, dense_up_to: int) -> bool:
    """Whether the sizes timed one by one (up to `dense_up_to`) need their slope to change at
    `dense_up_to` / 2: an F test of a line through them against two segments.

    Noise at sizes timed one by one sets such a change as readily as the hardware does. The
    demo target's verify profile (one thread, 5 repeats) came out at 0.30 ms a token between
    1 and 8 tokens and 0.03 between 8 and 16, where passes cost ~0.27 and ~0.16 a token timed
    again (15 repeats): at 4 in flight, plans of 9–16 tokens saw their further drafts nearly
    free, and at 1 in flight deep plans looked dear. Timed again, the second segment cut the
    residual by F = 3–5 (a line, then); a GPU's flat-then-rising pass by F in the thousands.
    The sparse knots beyond are each fitted over several sizes 8 apart, and stay."""
    half = dense_up_to // 2
    dense = xs <= dense_up_to
    if half <= 1 or dense.sum() <= 3:  # no middle knot, or no residual left to test it by:
        return half > 1                 # as before the test (a knot wherever there is room)
    x, y = xs[dense], ys[dense]
    _, rss_two = _knot_fit(x, y, [1, half, dense_up_to])
    _, rss_line = _knot_fit(x, y, [1, dense_up_to])
    rise = rss_line - rss_two
    exact = float(y @ y) * 1e-18  # a residual this small is an exact fit (noise-free timings)
    return rise > (KINK_F * rss_two / (x.size - 3) if rss_two > exact else exact)


def _knot_fit(xs: np.ndarray, ys: np.ndarray, knots: list[int]) -> tuple[np.ndarray, float]:
    """The least-squares piecewise-linear fit through `knots` at `xs`, and its residual sum of
    squares."""
    basis = np.stack([_hat(xs, knots, i) for i in range(len(knots))], axis=1)  # [n, knots]
    coef, *_ = np.linalg.lstsq(basis, ys, rcond=None)
    fitted = basis @ coef
    resid = ys - fitted
    return fitted, float(resid @ resid)


def _hat(xs: np.ndarray, knots: list[int], i: int) -> np.ndarray:
    """The piecewise-linear basis function that is 1 at knots[i] and 0 at the other knots."""
    ys = np.zeros(len(knots))
    ys[i] = 1.0
    return np.interp(xs, knots, ys)


def monotone(values: list[float]) -> tuple[float, ...]:
    """The closest non-decreasing sequence (isotonic regression, pool adjacent violators).

    A larger batch never costs less; unlike a running maximum, one noisy outlier at a small
    size only pools with its neighbours instead of raising every later entry.
    """
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out.extend([total / count] * int(count))
    return tuple(out)


def median_time(fn: Callable[[], None], repeats: int) -> float:
    return interleaved_medians([fn], repeats)[0]


def interleaved_medians(fns: list[Callable[[], float | None]], repeats: int, seed: int = 0,
                        desc: str | None = None) -> list[float]:
    """Median seconds of each of `fns` over `repeats` rounds; each round runs every fn once,
    in a fresh random order (after one warm-up round). A fn that returns seconds has timed its
    own work (a part of what it runs); otherwise the call is timed whole.

    A shared machine's speed drifts by tens of percent within a minute. Timing one size after
    another puts a slow spell on a contiguous run of sizes and bends the curve's shape, and the
    scheduler decides by the shape (a further token's cost against the step's base); rounds
    over all sizes spread a spell across them, where it only shifts the scale. `desc`: show a
    progress bar so named."""
    order = list(range(len(fns)))
    bar = tqdm(total=(repeats + 1) * len(fns), desc=desc, unit="run", disable=desc is None)
    rng = random.Random(seed)
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(repeats + 1):
        rng.shuffle(order)
        for i in order:
            start = time.perf_counter()
            timed = fns[i]()
            if rep:  # round 0 warms up
                times[i].append(time.perf_counter() - start if timed is None else timed)
            bar.update()
    bar.close()
    return [statistics.median(t) for t in times]


def hardware_key(device: str | None = None) -> str:
    """The hardware a profile was measured on: the GPU's name for a CUDA `device`, the CPU's
    architecture and torch threads for "cpu"; None: CUDA where present."""
    kind = torch.device(resolve_device(device))
    if kind.type == "cuda":
        return torch.cuda.get_device_name(kind).replace(" ", "-")
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}t"


def cache_key(model_dirs: list[str | Path], device: str | None = None) -> str:
    """Model identity (config + weight sizes) and hardware (`hardware_key`), for the persisted
    profile's name."""
    h = hashlib.sha256()
    for d in model_dirs:
        d = Path(d)
        h.update((d / "config.json").read_bytes())
        for f in sorted(d.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{hardware_key(device)}-{h.hexdigest()[:12]}"
