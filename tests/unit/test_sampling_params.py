import pytest

from dspark.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "SamplingParams.temperature=-0.1: must be a finite number >= 0"),
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
