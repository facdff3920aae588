"""The policy benchmark's workload: spread output lengths (`dspark.bench.output_lengths`)."""

from __future__ import annotations

from dspark.bench import output_lengths


def test_output_lengths_are_seeded_spread_around_the_mean() -> None:
    lengths = output_lengths(256, 32)
    assert lengths == output_lengths(256, 32)  # every arm of a cell serves the same requests
    assert lengths != output_lengths(256, 32, seed=1)
    assert min(lengths) == 16 and max(lengths) == 48  # mean/2 .. 3·mean/2, both ends reached
    assert abs(sum(lengths) / len(lengths) - 32) < 2  # the mean asked for
    assert output_lengths(3, 1) == [1, 1, 1]  # never below one token
