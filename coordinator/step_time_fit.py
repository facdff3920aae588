"""Online correction of the profiled step time:
measured ≈ verify_scale · profiled verify + verify_fixed + (R − 1) · verify_per_sequence
         + verify_after_round · [a drafting round ran before the pass, in its step]
         + first_scale · profiled first position + further_scale · profiled further positions
         + R · per_request
(`first_scale` = `further_scale` = `draft_scale` until rounds of several depths tell them apart).

The profile is taken once; measured steps then differ from it in two ways, and the engine
times each part of a step, so each is read off that part's calls:
- scales of the verify calls (fitted with a cost per sequence, below) and, apart, of the
  drafting calls (Σ measured seconds / Σ profiled seconds). A shared machine (or a GPU at
  another clock) runs faster or slower than when it was profiled, and not alike for both:
  the profile's drafting rounds and verify passes cannot match every live batch (contexts,
  catch-up lengths). A common scale never changes the budget (the argmax of tokens / time is
  the same), but read as an additive error it would, and a drafting round dearer or cheaper
  than profiled changes what speculation costs;
- per_request = Σ (seconds − worker seconds) / Σ R: the step's other work (the engine's
  bookkeeping, planning, commit and rollback), about linear in the batch size R, learned apart
  for steps with a drafting round (`round_per_request`: confidences, allocation, more tokens to
  commit; measured 0.4–0.9 ms a step against 0.1–0.2 without one). It is a cost of every step,
  so it makes speculation (fewer, longer steps) worth more, and the part only speculating steps
  pay makes it worth less.

The verify profile times one request's passes of B tokens (`profiler.profile_workers`): its
slope is what a further token costs. A live pass of R requests reads R contexts and runs R
sequences' bookkeeping whatever its size: a cost per sequence, not per token (measured at 16
in flight, contexts of ~600 rows: 12.0 ms for passes of 11 requests' one token each, 21.7 ms
for 11 requests' 78 tokens, against 5.0 and 13.2 ms profiled in requests of 8 tokens: ~0.6 ms
a sequence beyond that profile). A scale alone read that as a 2.4x dearer token and priced
speculation out where fixed k = 7 ran at 1.23x plain decoding. So the verify part is fitted
as s · profiled + c + v · (R − 1) + d · [drafts] (least squares, c, v, d >= 0; `_verify_fit`):
the scale is pulled toward a prior (the single-request batches' scale, else 1) by a small
ridge, which also decides between the parts where the passes do not tell them apart (one pass
size throughout). The profile was once taken in requests of 8 tokens, so each 8 tokens added a
sequence to it, and the ridge held the scale near 1 against the live slope: a further verified
token was priced 0.17 ms at 16 in flight (T = 0) and cost 0.12 between passes of 88 and 122
tokens, so deep plans looked ~40% dearer than they were. One request's profile has the live
slope (0.183 ms a token against 0.182 for 16 requests, demo target, one thread).

Only decode passes enter the verify fit: a pass that also prefills a prompt relates to the
profile (of decode passes) by another ratio (measured 0.49 for ~200-token prompts against 0.76
for decode passes on the same run), and weighing as much as a dozen decode steps it pulled the
scale down: a step's base looked cheaper, drafting dearer beside it, and a lone request idled
where speculation paid. Their drafting rounds do enter the drafting fit, although a round
beside a prompt runs slower (measured 1.4x the profile at 8–15 in flight, against 1.15x for
rounds between decode passes), which prices decode steps' rounds too dear where a budget
speculates mostly beside prompts: at 64 in flight nearly every step admits a request, those
rounds are all there is to learn from, and the profile alone (a round of 64 requests profiled
at 113 ms, live well under it) kept the budget idle (1.02x `off` where it had run at 1.27x).

Sums are exponentially weighted (FORGET^age), so the fit follows a machine whose speed drifts.
One step counts for at most MAX_RATIO times its prediction (for drafting, its profile): a
single outlier (an actor's first call, a collector pause) cannot set a scale beyond that. No
prior pulls the drafting scale toward 1, and the verify scale's (RIDGE) weighs a twentieth of
the passes: a profile that is far off (a drafting round profiled at 100x its live cost) must be
left behind within a few steps, or the budget never speculates and never learns otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FORGET = 0.98  # weight kept by each older step: the fit follows ~50 recent steps
MAX_RATIO = 4.0  # a step's measured part counts for at most this many times its prediction
RIDGE = 0.05  # weight of the verify scale's prior, as a share of the passes' own weight
# Weight of "a round's first position and its further ones scale alike", as a share of the
# further positions' own weight (`StepTimeFit._drafting_split`): weak, so rounds of a few
# depths pull the two apart within tens of steps.
DEPTH_RIDGE = 0.02


@dataclass(frozen=True)
class Fit:
    verify_scale: float = 1.0
    verify_per_sequence: float = 0.0  # seconds a pass takes per sequence beyond its first
    draft_scale: float = 1.0
    per_request: float = 0.0  # seconds per request per step (of a step without a round)
    resume_scale: float = 1.0  # `draft_scale` of a round after a step without one (cold)
    round_per_request: float | None = None  # `per_request` of a step with a round (None: same)
    # `draft_scale` split between a round's first position (the block pass, the call's fixed
    # cost) and its further ones (`StepTimeFit._drafting_split`); None: `draft_scale` for both.
    first_scale: float | None = None
    further_scale: float | None = None
    verify_fixed: float = 0.0  # seconds a pass takes beyond its profile whatever its size
    # and beyond that after a drafting round in its step (the drafter evicted the target's
    # weights; acceptance's own work when it verifies drafts)
    verify_after_round: float = 0.0

    def apply(self, verify: Any, drafting: Any, num_reqs: int, cold: float = 0.0,
              further: Any = 0.0, after_round: Any = None) -> Any:
        """Estimated seconds of a step whose profiled parts are `verify` and `drafting` (floats,
        or arrays of many candidate steps), `further` of `drafting` for the positions beyond
        the round's first. `cold`: the share of a cold round's premium over a steady one
        (`resume_scale` − `draft_scale`) this step is charged, 1.0 for all of it; the drafter
        ran no round in the step before. `after_round`: whether a drafting round ran before
        the pass (bools, or an array of them; default: whether the step drafts)."""
        other, first_scale, further_scale = self._round_terms(num_reqs, cold)
        has_round = drafting > 0
        after_round = has_round if after_round is None else after_round
        return (self.verify_time(verify, num_reqs, after_round) + num_reqs * self.per_request
                + other * has_round + first_scale * (drafting - further) + further_scale * further)

    def candidate_times(self, verify: Any, depths: Any, first: float, each: float,
                        num_reqs: int, cold: float = 0.0) -> Any:
        """`apply` of candidate steps ([n] profiled verify seconds, [n] round depths, 0 for no
        round) of one batch, whose rounds' profile is `first` for the first position and `each`
        for every further one, with the per-round terms summed in plain floats first: the
        budget evaluates every candidate every step, where each numpy call costs ~5 µs (the
        forward passes before it evict the caches), more than the arithmetic. numpy arrays in,
        an array out; lists (a small batch's or a probe's plans) in, a list out, the same sums."""
        other, first_scale, further_scale = self._round_terms(num_reqs, cold)
        per_round = self.verify_after_round + other + first_scale * first
        base = (self.verify_fixed + max(num_reqs - 1, 0) * self.verify_per_sequence
                + num_reqs * self.per_request)
        further = further_scale * each
        if not isinstance(depths, np.ndarray):
            return [self.verify_scale * v + base + per_round * (d > 0) + further * max(d - 1, 0)
                    for v, d in zip(verify, depths, strict=True)]
        times = self.verify_scale * verify + base
        times += per_round * (depths > 0)
        times += further * np.maximum(depths - 1, 0)
        return times

    def _round_terms(self, num_reqs: int, cold: float) -> tuple[float, float, float]:
        """(other work a round adds to the step, the scale of its first position's profiled
        seconds, of its further positions'), the `cold` share of a cold round's premium
        included in both scales."""
        if self.first_scale is None or self.further_scale is None:
            first_scale = further_scale = self.draft_scale
        else:
            first_scale, further_scale = self.first_scale, self.further_scale
        premium = cold * (self.resume_scale - self.draft_scale)
        other = (0.0 if self.round_per_request is None
                 else num_reqs * (self.round_per_request - self.per_request))
        return other, first_scale + premium, further_scale + premium

    def verify_time(self, verify: Any, num_reqs: int, after_round: Any = False) -> Any:
        """Estimated seconds of a verify pass profiled at `verify`, of `num_reqs` sequences,
        that verifies drafts or not."""
        return (self.verify_scale * verify + self.verify_fixed
                + max(num_reqs - 1, 0) * self.verify_per_sequence
                + self.verify_after_round * after_round)


class StepTimeFit:
    """Running weighted sums of one kind of step's profiled and measured times."""

    def __init__(self) -> None:
        # [profiled drafting, measured drafting,
        #  other of steps without a round, their R, other of steps with one, their R]
        self._sums = [0.0] * 6
        self._resume = [0.0, 0.0]  # [profiled, measured] drafting of rounds after idle steps
        # Decode passes' weighted moments for verify ≈ s · x + c + v · r + d · h (x profiled,
        # y measured, r = R − 1 sequences beyond one, h = 1 when it verified drafts),
        # z = (x, 1, r, h): Σ z zᵀ and Σ z y
        # (plain floats: this runs every step, where numpy's per-call cost exceeds the work)
        self._verify_zz = [[0.0] * 4 for _ in range(4)]
        self._verify_zy = [0.0] * 4
        # Steady rounds' weighted moments for drafting ≈ s_f · f + s_e · e (f the profiled
        # first position, e the further ones, y measured): [Σ f², Σ f·e, Σ e², Σ f·y, Σ e·y]
        self._depth = [0.0] * 5
        # [tokens committed, seconds of decoding] of every step (`add_tokens`)
        self._throughput = [0.0, 0.0]
        self._rounds = 0.0  # the weight of steady drafting rounds (`round_weight`)
        self._prior_scale = 1.0  # the verify scale's prior (`add`)
        self._prior_fixed = 0.0  # the prior of a pass's fixed cost (`add`)
        self._fit = Fit()
        self._stale = False  # sums changed since `_fit` was solved for

    @property
    def fit(self) -> Fit:
        """The fit of the steps added so far, solved again only when read after a change:
        steps are added every step, read only where the budget plans (an idle step whose
        plan holds reads nothing)."""
        if self._stale:
            self._fit, self._stale = self._refit(), False
        return self._fit

    @property
    def knows_verify(self) -> bool:
        """Whether a decode pass entered the verify fit."""
        return self._verify_zz[0][0] > 0

    @property
    def idle_weight(self) -> float:
        """The weight (in steps, decayed like every sum) of decode passes without drafts in
        the verify fit: what it knows of a step that does not speculate. Where it is ~0 the
        price of K = 0 is an extrapolation from passes with drafts (`BudgetedPolicy`'s
        exploration)."""
        return self._verify_zz[1][1] - self._verify_zz[3][3]

    @property
    def round_weight(self) -> float:
        """The weight (in steps, decayed like every sum) of steady drafting rounds: what the
        drafting scales and a round's other costs were last learned from. Where it is ~0 they
        are what they read when the budget stopped speculating (`BudgetedPolicy`'s
        exploration of rounds)."""
        return self._rounds

    @property
    def knows_drafting(self) -> bool:
        """Whether a drafting round entered the drafting scale (a steady one, or one that beat
        its profile while catching up); else `draft_scale` is the profile's guess."""
        return self._sums[0] > 0

    def add(self, verify: float, drafting: float, num_reqs: int, seconds: float,
            verify_seconds: float, draft_seconds: float, steady: bool = True,
            prefill: bool = False, prior_scale: float = 1.0, further: float = 0.0,
            prior_fixed: float = 0.0, after_round: bool = False) -> None:
        """One step: `verify`, `drafting` its profiled parts; `seconds` its measured end-to-end
        time, `verify_seconds` and `draft_seconds` the parts spent in those calls. A round that
        is not `steady` (it first caught up on rows it missed, often cold too) only bounds a
        steady round's time from above: it enters the drafting scale when it ran faster than
        profiled (a steady round would have been faster still; an idle drafter has no other
        way to learn that its profile is too dear), and otherwise stays out. Counted at its
        profile, as before, it held the scale near 1 where steady rounds ran at 0.52 of the
        profile (1 in flight, T = 1), so a mostly idle budget never found out that speculating
        steadily paid. `prefill`: the pass also took in prompt tokens, and stays out
        of the verify fit (see the module's docstring); so does the pass after a round that
        caught up, whose excess belongs to resuming (`add_resume`). `prior_scale`,
        `prior_fixed`: the priors of the verify scale and of a pass's fixed cost. `further`:
        the part of `drafting` profiled for positions beyond the first. `after_round`: a
        drafting round ran before the pass in its step."""
        other = max(0.0, seconds - verify_seconds - draft_seconds)
        with_round = drafting > 0
        self._rounds = FORGET * self._rounds + float(with_round and steady)
        if not steady and draft_seconds >= drafting:
            drafting = draft_seconds = further = 0.0
        if prefill or not steady:
            verify = verify_seconds = 0.0
        others = float(max(num_reqs - 1, 0)) if verify > 0 else 0.0  # sequences beyond one
        # The bound reads the fit as last solved (one step old at most): a cap, not an estimate.
        bound = MAX_RATIO * max(verify, self._fit.verify_time(verify, num_reqs, after_round))
        verify_seconds = min(verify_seconds, bound)
        idle = (0.0, 0.0) if with_round else (other, float(num_reqs))
        busy = (other, float(num_reqs)) if with_round else (0.0, 0.0)
        draft_seconds = min(draft_seconds, MAX_RATIO * drafting)
        new = (drafting, draft_seconds, *idle, *busy)
        self._sums = [FORGET * old + x for old, x in zip(self._sums, new, strict=True)]
        if steady:  # a round that caught up first bounds a steady one's total, not its split
            first = drafting - further
            moments = (first * first, first * further, further * further, first * draft_seconds,
                       further * draft_seconds)
            self._depth = [FORGET * old + x for old, x in zip(self._depth, moments, strict=True)]
        z = (verify, 1.0, others, float(after_round)) if verify > 0 else (0.0,) * 4
        self._verify_zz = [[FORGET * m + zi * zj for m, zj in zip(row, z, strict=True)]
                           for row, zi in zip(self._verify_zz, z, strict=True)]
        self._verify_zy = [
            FORGET * m + zi * verify_seconds for m, zi in zip(self._verify_zy, z, strict=True)
        ]
        self._prior_scale, self._prior_fixed = prior_scale, prior_fixed
        self._stale = True

    def _drafting_split(self) -> tuple[float | None, float | None]:
        """(s_f, s_e) of drafting ≈ s_f · first + s_e · further: least squares over the
        steady rounds, pulled toward s_f = s_e by DEPTH_RIDGE; (None, None) where rounds of
        one depth throughout cannot tell them apart, or where a scale comes out <= 0.

        The drafting scale alone (measured over profiled seconds of whole rounds) prices a
        round's first position and its further ones alike, and a deep round's positions
        cost more live than profiled (DSpark at 4 in flight, sampling, one thread: ~1.2 ms a
        further position live against ~0.66 ms at the fitted scale, while the first was
        priced right): deep plans looked cheap beside shallow ones."""
        ff, fe, ee, fy, ey = self._depth
        if ff <= 0 or ee <= 0:
            return None, None
        ridge = DEPTH_RIDGE * ee  # the penalty ridge · (s_f − s_e)²
        a = [[ff + ridge, fe - ridge], [fe - ridge, ee + ridge]]
        if a[0][0] * a[1][1] - a[0][1] ** 2 <= 1e-12 * a[0][0] * a[1][1]:
            return None, None
        s_f, s_e = _solve(a, [fy, ey])
        return (s_f, s_e) if s_f > 0 and s_e > 0 else (None, None)

    def _verify_fit(self) -> tuple[float, float, float, float]:
        """(s, c, v, d) of verify ≈ s · profiled + c + v · (R − 1) + d · [after a round]:
        least squares over the decode passes, s pulled toward its prior, c, v, d >= 0 (a
        negative one would be another's share; it is dropped and the rest fitted again).

        c is a pass's fixed cost beyond the profile's (on a CPU: the target's weights read
        again after the drafter ran; the profile's passes ran back to back), d what a pass
        after a drafting round adds (the drafter evicted the target's weights; acceptance's
        work: warping p, reading q). A pass is marked by the round, not by whether it
        verified drafts: a probe's or Algorithm 1's round is paid before the budget is
        known, and with d learned apart (passes without a round measured) a pass that
        verified nothing after it was priced as one without a round (Algorithm 1 then
        stopped at K = 0 at 64 in flight: 0.8x `off`). Without c a lone request's
        passes, all of one token while speculation does not pay, read their excess as a scale
        (1.6 at 1 thread), the prior of every batch size's: a speculating pass's further tokens
        were priced 1.6x, and speculation at 4–12 in flight looked 10–20% dearer than measured
        (idle passes within 2–6%). Without d the step from no drafts to a few read as a steep
        slope (1 in flight, T = 1: 0.47 ms a token between passes of 1 and ~5 tokens, 0.26
        beyond), which priced deep plans too dear."""
        zz, zy = self._verify_zz, self._verify_zy
        if zz[0][0] <= 0:
            return 1.0, 0.0, 0.0, 0.0
        # The ridge on s weighs the passes' spread in size (their variance in x about the mean,
        # what tells a scale from a fixed cost), plus a little of Σ x² that settles s where
        # every pass had one size. c is pulled toward its prior (a lone request's fixed cost)
        # and d toward 0 by ridges 100x and 10x weaker in the units of a prediction: where the
        # passes cannot tell them apart, s keeps its prior first, then d, then c, and v takes
        # the rest (one batch size throughout makes c and v·(R − 1) one column, passes that
        # all verify drafts c and d).
        spread = max(0.0, zz[0][0] - zz[0][1] ** 2 / zz[1][1])
        ridge = (RIDGE * spread + 1e-3 * zz[0][0], 1e-5 * zz[1][1], 0.0, 1e-4 * zz[1][1])
        prior = (self._prior_scale, self._prior_fixed, 0.0, 0.0)
        a = [[zz[i][j] + (ridge[i] if i == j else 0.0) for j in range(4)] for i in range(4)]
        b = [zy[i] + ridge[i] * prior[i] for i in range(4)]
        free = [i for i in (1, 2, 3) if zz[i][i] > 0]
        while True:
            idx = [0, *free]
            coef = dict(zip(idx, _solve([[a[i][j] for j in idx] for i in idx],
                                        [b[i] for i in idx]), strict=True))
            negative = [i for i in free if coef[i] < 0]
            if not negative:
                return coef[0], coef.get(1, 0.0), coef.get(2, 0.0), coef.get(3, 0.0)
            free = [i for i in free if i not in negative]

    def add_tokens(self, tokens: int, decode_seconds: float) -> None:
        """A step of this kind committed `tokens` and spent `decode_seconds` decoding: its time
        less what a prompt in its pass added (`StepPricer.observe_time`)."""
        self._throughput = [FORGET * old + x for old, x in
                            zip(self._throughput, (tokens, decode_seconds), strict=True)]

    @property
    def throughput(self) -> float | None:
        """Tokens per second of decoding lately, over every step with what prompts in its pass
        added left out (None before a step was timed): what a step's time is worth in tokens
        elsewhere, the budget's price of time (`best_plan`).

        The work is fixed (each prompt is taken in once, whatever the budget does), so time a
        plan spends buys the decode tokens it would otherwise take a later step to commit: the
        price is the rate of decoding, not of the run. Priced at every step's rate, prompts'
        passes included, time looked cheap where most steps carry a prompt (16 in flight,
        T = 0: 0.28 tokens a ms against 0.71 in decode steps), and the budget verified 88
        drafts a step, as deep as fixed k = 7, for 0.67 tokens a ms where fixed k = 3 made
        0.71. Priced at the rate of decode steps alone, it read a few rare steps where nearly
        every one carries a prompt (64 in flight), and swung as their share crossed a
        threshold. Paired against every step's rate (where decode steps took under half the
        time): 1.04x (16 in flight, T = 0, 12 rounds), 1.05x (64, T = 0, 8), 1.09x (64, T = 1,
        8 of 8 rounds better)."""
        tokens, seconds = self._throughput
        return tokens / seconds if seconds > 0 else None

    def add_resume(self, drafting: float, draft_seconds: float) -> None:
        """A drafting round after a step without one: `drafting` its profiled time (catch-up
        rows left out), `draft_seconds` what it took, with what the verify pass after it took
        beyond a steady step's. On a CPU such a round runs cold (the drafter's weights left the
        caches while the target ran alone), measured at ~1.5x a steady one, and its catch-up
        evicts the target's weights in turn (16 in flight, T = 1: 0.62 ms a further token in
        the pass after it, against 0.18 in steady passes): a switching cost that resuming
        speculation must repay. Those passes stay out of the verify fit: taken for steady
        ones, the few that a mostly idle budget ran set the verify scale to 1.7 and priced
        steady speculation 24% too dear."""
        if drafting <= 0:
            return
        new = (drafting, min(max(0.0, draft_seconds), MAX_RATIO * drafting))
        self._resume = [FORGET * old + x for old, x in zip(self._resume, new, strict=True)]
        self._stale = True

    def _refit(self) -> Fit:
        pd, md, idle_other, idle_reqs, busy_other, busy_reqs = self._sums
        rp, rm = self._resume
        busy = busy_other / busy_reqs if busy_reqs > 0 else None
        # One kind of step not measured yet: the other's rate serves both; and steps without
        # a round last measured long ago (their weight decayed below one request's) give way
        # to it too: a ratio of decayed sums keeps its value forever, and the other work of a
        # few idle steps at start-up priced K = 0 for good after the machine had sped up 100x.
        fresh = idle_reqs >= 1.0 or busy is None
        idle = idle_other / idle_reqs if idle_reqs > 0 and fresh else None
        per_request = idle if idle is not None else (busy or 0.0)
        scale, fixed, per_sequence, drafts = self._verify_fit()
        return Fit(scale, per_sequence, md / pd if pd > 0 else 1.0, per_request,
                   rm / rp if rp > 0 else 1.0, busy, *self._drafting_split(), fixed, drafts)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a · x = b for a small positive-definite a (Gaussian elimination, plain floats:
    solved once a step, in loops over the few columns that change, ~2x faster than whole-row
    list comprehensions)."""
    n = len(b)
    m = [row + [rhs] for row, rhs in zip(a, b, strict=True)]
    for k in range(n):
        pivot = m[k]
        for i in range(k + 1, n):
            row = m[i]
            f = row[k] / pivot[k]
            for j in range(k, n + 1):
                row[j] -= f * pivot[j]
    x = [0.0] * n
    for k in reversed(range(n)):
        row, done = m[k], 0.0
        for j in range(k + 1, n):
            done += row[j] * x[j]
        x[k] = (row[n] - done) / row[k]
    return x
