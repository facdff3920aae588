"""Step traces: recorded from a real engine run, written, read back unchanged."""

from __future__ import annotations

import io

import pytest

from dspark.coordinator.engine import Engine
from dspark.coordinator.trace import TraceRecorder, read_trace
from dspark.sampling_params import SamplingParams

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "import os\nimport sys\nimport "]


@pytest.fixture(scope="module")
def recorded() -> tuple[TraceRecorder, list]:
    rec = TraceRecorder(meta={"proposer": "ngram", "policy": "fixed", "k": 3})
    engine = Engine(proposer="ngram", policy="fixed", k=3, trace=rec)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return rec, outs


def test_trace_matches_what_the_engine_committed(recorded) -> None:
    rec, outs = recorded
    trace = rec.trace()
    assert len(trace.steps) == engine_steps(outs)
    by_id = {r.req_id: r for r in trace.requests()}
    for out in outs:
        req = by_id[out.req_id]
        assert req.output_len == len(out.token_ids)
        assert req.prompt_len == len(out.prompt_ids)
        assert len(req.planned) == out.stats["target_passes"]
        assert all(a <= ell <= 3 for a, ell in zip(req.accepted, req.planned, strict=True))
    for s in trace.steps:
        # B = Σ (uncached committed + ℓ): a prompt on the first step, the anchor afterwards.
        assert s.num_tokens == sum(s.num_input) >= len(s.req_ids) + sum(s.planned)
        assert s.seconds > 0 and s.budget >= sum(s.planned)
        assert s.confidences is not None and len(s.confidences) == len(s.req_ids)


def test_trace_round_trip_through_a_file(recorded, tmp_path) -> None:
    rec, _ = recorded
    path = rec.save(tmp_path / "run.trace.jsonl")
    back = read_trace(path)
    assert back.meta == rec.meta
    assert len(back.steps) == len(rec.steps)
    for a, b in zip(back.steps, rec.steps, strict=True):
        assert (a.req_ids, a.num_input, a.new, a.planned, a.accepted, a.committed, a.finished) == (
            b.req_ids, b.num_input, b.new, b.planned, b.accepted, b.committed, b.finished)
        assert a.seconds == pytest.approx(b.seconds, abs=1e-6)
        assert a.confidences == b.confidences


def engine_steps(outs: list) -> int:
    # Both requests run together from the first step: the longer one sets the step count.
    return max(int(o.stats["target_passes"]) for o in outs)


def test_streaming_recorder_leaves_a_readable_file(tmp_path) -> None:
    path = tmp_path / "live.jsonl"
    rec = TraceRecorder(path=path, meta={"run": "live"})
    Engine(proposer="ngram", policy="fixed", k=2, trace=rec).generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    rec.close()
    back = read_trace(path)
    assert back.meta == {"run": "live"} and len(back.steps) == len(rec.steps) > 0
    assert sum(sum(s.committed) for s in back.steps) == 5


def test_reader_rejects_other_files() -> None:
    with pytest.raises(ValueError, match="dspark-trace"):
        read_trace(io.StringIO('{"format": "something-else"}\n'))
    with pytest.raises(ValueError, match="empty"):
        read_trace(io.StringIO(""))


def test_steps_by_budget_splits_time_by_kind_of_step() -> None:
    from dspark.coordinator.trace import StepTrace, Trace, steps_by_budget

    def step(i: int, dt: float, k: int, new: int, committed: int, drafted: int = 0) -> StepTrace:
        return StepTrace(i, 0.0, dt, k, ("r",), (1,), (new,), (drafted,), (k,), (k,),
                         (committed,), (0,), None)

    trace = Trace({}, (step(0, 0.030, 0, 1, 1), step(1, 0.012, 3, 0, 4, 3),
                       step(2, 0.006, 0, 0, 1), step(3, 0.016, 0, 0, 1, 7),  # a probe's round
                       step(4, 0.010, 3, 0, 2, 3), step(5, 0.014, 12, 0, 6, 7)))
    rows = steps_by_budget(trace)
    assert [(r.kind, r.steps, r.tokens) for r in rows] == [
        ("prefill", 1, 1), ("K=0", 2, 2), ("K=3", 2, 6), ("K=12", 1, 6)]  # K in numeric order
    k3 = rows[2]
    assert k3.seconds == pytest.approx(0.022)
    assert k3.ms_per_step == pytest.approx(11.0)
    assert k3.tokens_per_step == 3.0
    assert k3.tokens_per_ms == pytest.approx(6 / 22)
    assert sum(r.steps for r in rows) == len(trace.steps)


def test_steps_by_phase_splits_time_by_the_state_of_the_batch() -> None:
    from dspark.coordinator.trace import StepTrace, Trace, steps_by_phase

    def step(new: tuple[int, ...], dt: float, planned: tuple[int, ...], committed: int
             ) -> StepTrace:
        n = len(new)
        return StepTrace(0, 0.0, dt, sum(planned), tuple(f"r{i}" for i in range(n)), (1,) * n,
                         new, planned, planned, planned, (committed,) + (0,) * (n - 1), (0,) * n,
                         None)

    trace = Trace({}, (
        step((1, 1, 1), 0.300, (0, 0, 0), 3),  # the batch's prompts together
        step((0, 0, 0), 0.020, (3, 2, 0), 6),  # full
        step((0, 0, 1), 0.100, (3, 0, 0), 4),  # a prompt beside running requests
        step((0, 0), 0.010, (1, 1), 3),  # draining
        step((0, 0, 0), 0.030, (0, 0, 0), 3),  # full again
        step((0,), 0.005, (0,), 1),  # draining
    ))
    rows = {r.kind: r for r in steps_by_phase(trace)}
    assert list(rows) == ["first pass", "prefill", "decode, full", "decode, draining"]
    assert [(r.steps, r.tokens, r.drafts) for r in rows.values()] == [
        (1, 3, 0), (1, 4, 3), (2, 9, 5), (2, 4, 2)]
    assert rows["decode, full"].seconds == pytest.approx(0.050)
    assert rows["decode, draining"].tokens_per_ms == pytest.approx(4 / 15)
    assert steps_by_phase(Trace({}, ())) == []


def test_trace_summary_prints_each_kind_of_step_and_refuses_bad_files(recorded, tmp_path,
                                                                      capsys) -> None:
    from dspark.cli import main as cli_main
    from dspark.coordinator.trace import steps_by_budget, steps_by_phase

    rec, _ = recorded
    path = rec.save(tmp_path / "run.jsonl")
    assert cli_main(["trace-summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "proposer=ngram" in out
    for row in steps_by_budget(rec.trace()):
        assert f"{row.kind:<9}{row.steps:>7}" in out
    for row in steps_by_phase(rec.trace()):
        assert f"{row.kind:<17}{row.steps:>7}" in out
    (tmp_path / "other.jsonl").write_text('{"format": "other"}\n')
    for bad, message in ((tmp_path / "missing.jsonl", "No such file"),
                         (tmp_path / "other.jsonl", "not a dspark-trace")):
        assert cli_main(["trace-summary", str(bad)]) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and message in err
