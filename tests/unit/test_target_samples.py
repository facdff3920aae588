"""Training text sampled from the target: exactly what serving the target alone would sample,
and mixed into a drafter's training windows in the configured share."""

from __future__ import annotations

import torch

from dspark.coordinator.engine import Engine
from dspark.demo import demo_path
from dspark.sampling_params import SamplingParams
from dspark.training.drafter_training import DrafterTrainConfig, training_windows
from dspark.training.target_samples import sample_continuations


def test_continuations_equal_the_engines_sampled_output_for_the_same_seeds() -> None:
    prompts = torch.randint(5, 4000, (5, 7), generator=torch.Generator().manual_seed(3))
    out = sample_continuations(demo_path("target"), prompts, 12, temperature=1.0, seed=40, batch=2)
    assert torch.equal(out[:, :7], prompts)
    engine = Engine(proposer="none", policy="off")
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=40 + i)
              for i in range(5)]
    results = engine.generate([p.tolist() for p in prompts], params)
    assert [list(r.token_ids) for r in results] == out[:, 7:].tolist()


def test_training_windows_take_the_configured_share_from_the_pool() -> None:
    stream = torch.arange(10_000, 20_000)  # corpus tokens are >= 10000, pool tokens < 100
    pool = torch.randint(0, 100, (6, 40))
    cfg = DrafterTrainConfig(batch_size=8, seq_len=40, num_anchors=4, sampled_fraction=0.25)
    window = training_windows(stream, pool, cfg, torch.Generator().manual_seed(0))
    assert window.shape == (8, 40)
    from_pool = [any(torch.equal(row, p) for p in pool) for row in window]
    assert from_pool == [True, True] + [False] * 6
    assert bool((window[2:] >= 10_000).all())
    corpus_only = training_windows(stream, None, cfg, torch.Generator().manual_seed(0))
    assert bool((corpus_only >= 10_000).all())
