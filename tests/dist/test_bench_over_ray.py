"""`dspark bench-policies --draft-actors N`: every arm runs over the Ray pools it is given."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.bench import run_policy_bench
from dspark.coordinator.ray_workers import build_ray_workers, shutdown
from dspark.demo import demo_path


def test_policy_bench_runs_its_arms_over_the_given_workers(ray_instance, tmp_path: Path) -> None:
    target, pool = build_ray_workers(demo_path("target"), "dspark", tp=1, num_draft_actors=1,
                                     num_blocks=512)
    try:
        results = run_policy_bench(concurrencies=(2,), temperatures=(0.0,), max_tokens=8,
                                   out_dir=tmp_path, repeats=1, arms=("off", "fixed k=3"),
                                   workers=(target, pool))
        cell = results["T=0"]["2"]
        assert cell["off"]["x_off"] == 1.0 and cell["fixed k=3"]["x_off"] > 0
        # Verified over the target group, drafted by the draft actor: the arms ran there.
        assert target.timing["verify_calls"] > 0
        assert sum(int(b["calls"]) for b in pool.busy()) > 0
        # Shared workers: one whole run after another (in turns, the arms' requests' names
        # would collide in the workers).
        saved = json.loads((tmp_path / "bench_policies.json").read_text())
        assert saved["schedule"] == "whole runs in turn"
    finally:
        shutdown((target, pool))
