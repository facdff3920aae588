import pytest
import torch

from dspark.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "SamplingParams.temperature=-0.1: must be 0 (greedy) or a finite"),
        (
            {"temperature": 1e-9},
            "SamplingParams.temperature=1e-09: must be 0 (greedy) or a finite number >= 1e-06",
        ),
        ({"temperature": float("nan")}, "SamplingParams.temperature=nan"),
        ({"top_p": 0.0}, "SamplingParams.top_p=0.0: must be in (0, 1]"),
        ({"top_p": 1.5}, "SamplingParams.top_p=1.5: must be in (0, 1]"),
        ({"top_k": -1}, "SamplingParams.top_k=-1: must be an integer >= 0"),
        ({"max_tokens": 0}, "SamplingParams.max_tokens=0: must be an integer >= 1"),
        ({"max_tokens": -5}, "SamplingParams.max_tokens=-5"),
        ({"stop_token_ids": [3, -1]}, "SamplingParams.stop_token_ids=(3, -1)"),
        ({"stop": ["ok", ""]}, "SamplingParams.stop=('ok', ''): must be non-empty strings"),
        ({"seed": -3}, "SamplingParams.seed=-3"),
    ],
)
def test_invalid_values_name_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_lists_become_tuples_and_greedy_flag() -> None:
    p = SamplingParams(temperature=0, stop=["\n\n"], stop_token_ids=[5])
    assert p.stop == ("\n\n",) and p.stop_token_ids == (5,)
    assert p.greedy and not SamplingParams(temperature=0.7).greedy
    hash(p)  # frozen and hashable: safe to share between requests


def test_smallest_temperature_is_accepted_and_samples_a_real_distribution() -> None:
    from dspark.kernels.sampling import warp_probs
    from dspark.sampling_params import MIN_TEMPERATURE

    SamplingParams(temperature=MIN_TEMPERATURE)
    logits = torch.randn(3, 4096) * 20  # the tempered logits reach ~1e8 in float64
    probs = warp_probs(logits, torch.full((3,), MIN_TEMPERATURE, dtype=torch.float64),
                       torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.float64))
    assert torch.isfinite(probs).all() and torch.allclose(
        probs.sum(-1), torch.ones(3, dtype=torch.float64)
    )
