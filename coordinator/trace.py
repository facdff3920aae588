"""Step traces: what every step planned, what the target accepted and how long it took.

A trace is the engine's own record of a run, the input of the fleet simulator
(`dspark.coordinator.sim`): acceptance replay, request lengths and measured step times.

File format (JSON lines, UTF-8): the first line is a header object, every further line one step.

    {"format": "dspark-trace", "version": 1, "meta": {...}}
    {"step": 7, "t": 0.1532, "dt": 0.0121, "K": 12,
     "ids": ["req-0", "req-1"],   # requests in the batch, in batch order
     "in": [1, 31],               # verify input tokens: uncached committed (anchor or prompt) + ℓ
     "new": [0, 1],               # 1 on the request's first step (its prompt is the prefill)
     "d": [4, 4],                 # γ_r drafted
     "l": [3, 4],                 # ℓ_r planned for verification
     "a": [1, 4],                 # A_r accepted
     "c": [2, 5],                 # tokens committed (A_r + 1, fewer after an EOS/length cut)
     "f": [0, 1],                 # 1 when the request finished in this step
     "conf": [[0.91, 0.8], ...]}  # conditional confidences the policy saw (null: none)

`t` is the step's start in seconds since the first recorded step, `dt` its wall-clock duration
(drafting, scheduling, verify, commit), `K` the budget. Confidences are rounded to 4 digits.

`steps_by_budget` splits a trace's time by what its steps did (`dspark trace-summary`):
steps that took in a prompt, and decode steps by their budget K, each with its tokens a ms;
`steps_by_phase` by the state of the batch (first passes, prefill, full decode, draining);
`dspark bench-policies --trace-dir` records one trace per arm and cell.

Example:
    >>> import io, json
    >>> rec = TraceRecorder(meta={"proposer": "ngram"})
    >>> step = StepTrace(1, 0.0, 0.01, 2, ("r",), (3,), (1,), (2,), (2,), (1,), (2,), (0,), None)
    >>> rec.steps.append(step)
    >>> buf = io.StringIO(); rec.write(buf); _ = buf.seek(0)
    >>> read_trace(buf).steps[0].accepted
    (1,)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dspark.messages import Drafts, StepState

FORMAT = "dspark-trace"
VERSION = 1


@dataclass(frozen=True)
class StepTrace:
    """One step of one engine. Per-request tuples are in batch order (`req_ids`)."""

    step: int
    t: float  # start, seconds since the trace's first step
    seconds: float  # wall-clock duration of the whole step
    budget: int  # K
    req_ids: tuple[str, ...]
    num_input: tuple[int, ...]  # [num_reqs] verify input tokens (uncached committed + ℓ)
    new: tuple[int, ...]  # [num_reqs] 1 on a request's first step
    drafted: tuple[int, ...]  # [num_reqs] γ_r
    planned: tuple[int, ...]  # [num_reqs] ℓ_r
    accepted: tuple[int, ...]  # [num_reqs] A_r
    committed: tuple[int, ...]  # [num_reqs] tokens appended
    finished: tuple[int, ...]  # [num_reqs] 1 when the request finished here
    confidences: tuple[tuple[float, ...], ...] | None  # [num_reqs, max_draft] conditional c

    @property
    def num_tokens(self) -> int:
        """B, the verify pass's size."""
        return sum(self.num_input)

    def as_json(self) -> dict[str, object]:
        return {"step": self.step, "t": round(self.t, 6), "dt": round(self.seconds, 6),
                "K": self.budget, "ids": list(self.req_ids), "in": list(self.num_input),
                "new": list(self.new), "d": list(self.drafted), "l": list(self.planned),
                "a": list(self.accepted), "c": list(self.committed), "f": list(self.finished),
                "conf": None if self.confidences is None else [list(r) for r in self.confidences]}

    @staticmethod
    def from_json(raw: dict) -> StepTrace:
        conf = raw.get("conf")
        return StepTrace(
            step=int(raw["step"]), t=float(raw["t"]), seconds=float(raw["dt"]),
            budget=int(raw["K"]), req_ids=tuple(raw["ids"]), num_input=tuple(raw["in"]),
            accepted=tuple(raw["a"]), drafted=tuple(raw["d"]), planned=tuple(raw["l"]),
            new=tuple(raw["new"]), committed=tuple(raw["c"]), finished=tuple(raw["f"]),
            confidences=None if conf is None else tuple(tuple(r) for r in conf),
        )


@dataclass(frozen=True)
class RequestTrace:
    """One request's life in a trace: its prompt, and per step (γ, ℓ, A, committed, confidences)."""

    req_id: str
    prompt_len: int
    drafted: tuple[int, ...]
    planned: tuple[int, ...]
    accepted: tuple[int, ...]
    committed: tuple[int, ...]
    confidences: tuple[tuple[float, ...] | None, ...]

    @property
    def output_len(self) -> int:
        return sum(self.committed)


@dataclass(frozen=True)
class Trace:
    meta: dict[str, object]
    steps: tuple[StepTrace, ...]

    def requests(self) -> list[RequestTrace]:
        """Per-request views, in order of first appearance."""
        acc: dict[str, dict[str, list]] = {}
        prompts: dict[str, int] = {}
        for s in self.steps:
            for i, r in enumerate(s.req_ids):
                if r not in acc:
                    acc[r] = {"d": [], "l": [], "a": [], "c": [], "conf": []}
                    prompts[r] = s.num_input[i] - s.planned[i] if s.new[i] else 1
                row = acc[r]
                row["d"].append(s.drafted[i])
                row["l"].append(s.planned[i])
                row["a"].append(s.accepted[i])
                row["c"].append(s.committed[i])
                row["conf"].append(None if s.confidences is None else s.confidences[i])
        return [RequestTrace(r, prompts[r], tuple(v["d"]), tuple(v["l"]), tuple(v["a"]),
                             tuple(v["c"]), tuple(v["conf"])) for r, v in acc.items()]

    def tokens_per_second(self) -> float:
        """Committed tokens over the summed step time (the engine's busy time)."""
        busy = sum(s.seconds for s in self.steps)
        return sum(sum(s.committed) for s in self.steps) / busy if busy else 0.0


@dataclass(frozen=True)
class BudgetRow:
    """The steps of one kind in a trace: those that took in a prompt, or the decode steps of one
    budget K (`steps_by_budget`); or those of one phase of the run (`steps_by_phase`)."""

    kind: str  # "prefill", or "K=<k>"; a phase of the run (`steps_by_phase`)
    steps: int
    seconds: float  # their summed wall-clock time
    tokens: int  # tokens they committed
    drafts: int = 0  # drafts they verified (Σ ℓ)

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps

    @property
    def tokens_per_ms(self) -> float:
        return self.tokens / (1000 * self.seconds) if self.seconds > 0 else float("nan")


def steps_by_budget(trace: Trace) -> list[BudgetRow]:
    """The trace's steps split by what they did: "prefill" (a request's first step, its prompt
    in the pass), then decode steps by their budget K, ascending. Where a policy trails another
    this says whether it idles (K = 0) or speculates at a lower rate, and what each kind of step
    costs. A probe counts under the K it verified.

    >>> steps = [StepTrace(i, 0.0, dt, k, ("r",), (1,), (new,), (k,), (k,), (k,), (k + 1,), (0,),
    ...                    None) for i, (dt, k, new) in enumerate([(0.02, 0, 1), (0.01, 3, 0),
    ...                                                           (0.005, 0, 0), (0.01, 3, 0)])]
    >>> [(r.kind, r.steps, r.tokens, round(r.tokens_per_ms, 2)) for r in steps_by_budget(
    ...     Trace({}, tuple(steps)))]
    [('prefill', 1, 1, 0.05), ('K=0', 1, 1, 0.2), ('K=3', 2, 8, 0.4)]
    """
    groups: dict[int | None, list[StepTrace]] = {}  # None: steps that took in a prompt
    for s in trace.steps:
        groups.setdefault(None if any(s.new) else s.budget, []).append(s)
    order = sorted(groups, key=lambda k: -1 if k is None else k)
    return [_row("prefill" if k is None else f"K={k}", groups[k]) for k in order]


def _row(kind: str, steps: list[StepTrace]) -> BudgetRow:
    return BudgetRow(kind, len(steps), sum(s.seconds for s in steps),
                     sum(sum(s.committed) for s in steps), sum(sum(s.planned) for s in steps))


PHASES = ("first pass", "prefill", "decode, full", "decode, draining")


def steps_by_phase(trace: Trace) -> list[BudgetRow]:
    """The trace's steps split by the state of the batch, in PHASES order (phases without steps
    left out): "first pass" (every request in the pass is new: a batch's prompts together),
    "prefill" (prompts beside running requests), "decode, full" (no prompt, the batch as wide
    as the trace's widest), "decode, draining" (no prompt, fewer). Arms that serve the same
    requests do the same first passes, whose time is then noise to a comparison; where one
    trails, this says in which phase (traced at 64 in flight, T = 0: `confidence`'s full decode
    steps made 1.23 tokens a ms where `off`'s and fixed k = 3's made 1.40, and its steps beside
    prompts 0.72 against fixed k = 3's 0.81, while every arm spent ~25% of the run on first
    passes). Compare phases' seconds and tokens, not only their rates: which steps fall in a
    phase depends on the arm (fixed k = 3 ran 38 steps beside prompts there, `off` 79, for the
    same prompts), and its drafts there cost about what they did in full decode steps.

    >>> def step(width, new, dt, drafts):
    ...     return StepTrace(0, 0.0, dt, drafts, ("r",) * width, (1,) * width, new, (0,) * width,
    ...                      (drafts,) + (0,) * (width - 1), (0,) * width, (1,) * width,
    ...                      (0,) * width, None)
    >>> rows = steps_by_phase(Trace({}, (step(2, (1, 1), 0.05, 0), step(2, (0, 0), 0.01, 3),
    ...                                   step(1, (0,), 0.005, 0))))
    >>> [(r.kind, r.steps, r.tokens, r.drafts) for r in rows]
    [('first pass', 1, 2, 0), ('decode, full', 1, 2, 3), ('decode, draining', 1, 1, 0)]
    """
    widest = max((len(s.req_ids) for s in trace.steps), default=0)
    groups: dict[str, list[StepTrace]] = {}
    for s in trace.steps:
        new = sum(s.new)
        phase = (PHASES[0] if new == len(s.new) else PHASES[1] if new
                 else PHASES[2] if len(s.req_ids) == widest else PHASES[3])
        groups.setdefault(phase, []).append(s)
    return [_row(p, groups[p]) for p in PHASES if p in groups]


def format_budget_rows(trace: Trace) -> str:
    """`steps_by_budget`, then `steps_by_phase` (with drafts verified a step), as tables: what
    `dspark trace-summary` prints."""
    rows = steps_by_budget(trace)
    seconds, tokens = sum(r.seconds for r in rows), sum(r.tokens for r in rows)
    lines = [f"{len(trace.steps)} steps, {tokens} tokens, "
             f"{tokens / (1000 * seconds) if seconds else 0.0:.3f} tokens a ms",
             f"{'steps':<9}{'count':>7}{'time':>8}{'ms/step':>9}{'tok/step':>10}{'tok/ms':>8}"]
    lines += [_line(r, 9, seconds) for r in rows]
    lines.append(f"{'phase':<17}{'count':>7}{'time':>8}{'ms/step':>9}{'tok/step':>10}"
                 f"{'tok/ms':>8}{'drafts/step':>12}")
    lines += [_line(r, 17, seconds) + f"{r.drafts / r.steps:>12.1f}"
              for r in steps_by_phase(trace)]
    return "\n".join(lines)


def _line(r: BudgetRow, width: int, seconds: float) -> str:
    """A table row: kind, count, share of the trace's `seconds`, ms/step, tok/step, tok/ms."""
    return (f"{r.kind:<{width}}{r.steps:>7}{r.seconds / seconds:>8.1%}{r.ms_per_step:>9.2f}"
            f"{r.tokens_per_step:>10.2f}{r.tokens_per_ms:>8.3f}")


@dataclass
class TraceRecorder:
    """Collects `StepTrace`s from an engine (`Engine(trace=TraceRecorder())`).

    With `path`, every step is also appended to that file as it happens (header first), so a
    crashed run still leaves its steps behind.
    """

    path: str | Path | None = None
    meta: dict[str, object] = field(default_factory=dict)
    steps: list[StepTrace] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set, repr=False)
    _t0: float | None = field(default=None, repr=False)
    _file: IO[str] | None = field(default=None, repr=False)

    def record(self, state: StepState, drafts: Drafts, planned: list[int], start: float) -> None:
        """Called by the engine once per step, after commit; `start` is the step's perf_counter."""
        end = time.perf_counter()
        if self._t0 is None:
            self._t0 = start
        conf = None
        if drafts.confidences is not None:
            conf = tuple(tuple(round(float(x), 4) for x in row)
                         for row in drafts.confidences.tolist())
        num_input, new = [], []
        for s, ell in zip(state.requests, planned, strict=True):
            before = s.target_length + 1 - len(s.committed)  # committed tokens before the step
            is_new = s.req_id not in self._seen
            self._seen.add(s.req_id)
            new.append(int(is_new))
            num_input.append((before if is_new else 1) + ell)
        step = StepTrace(
            step=state.step, t=start - self._t0, seconds=end - start, budget=state.budget,
            req_ids=tuple(s.req_id for s in state.requests), num_input=tuple(num_input),
            accepted=tuple(s.num_accepted for s in state.requests),
            drafted=tuple(s.num_drafted for s in state.requests), planned=tuple(planned),
            new=tuple(new), committed=tuple(len(s.committed) for s in state.requests),
            finished=tuple(int(s.finish_reason is not None) for s in state.requests),
            confidences=conf,
        )
        self.steps.append(step)
        if self.path is not None:
            if self._file is None:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
                self._file.write(json.dumps(_header(self.meta)) + "\n")
            self._file.write(json.dumps(step.as_json()) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def trace(self) -> Trace:
        return Trace(dict(self.meta), tuple(self.steps))

    def write(self, out: IO[str]) -> None:
        """Write the whole trace (header and steps) to an open text stream."""
        out.write(json.dumps(_header(self.meta)) + "\n")
        for s in self.steps:
            out.write(json.dumps(s.as_json()) + "\n")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            self.write(f)
        return path


def _header(meta: dict[str, object]) -> dict[str, object]:
    return {"format": FORMAT, "version": VERSION, "meta": meta}


def read_trace(source: str | Path | IO[str]) -> Trace:
    """Load a trace file (or open stream); raises ValueError on a file of another format."""
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as f:
            return _parse(f)
    return _parse(source)


def _parse(lines: Iterable[str]) -> Trace:
    it = iter(lines)
    try:
        header = json.loads(next(it))
    except StopIteration:
        raise ValueError("trace is empty: expected a header line") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"not a {FORMAT} v{VERSION} file: header {str(header)[:80]}")
    steps = tuple(StepTrace.from_json(json.loads(line)) for line in it if line.strip())
    return Trace(dict(header.get("meta", {})), steps)
