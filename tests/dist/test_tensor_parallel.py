"""Tensor parallelism (gloo, two Ray actors) against the single-process model."""

from __future__ import annotations

import pytest
import torch

from dspark.demo import demo_path
from dspark.models.checkpoint import load_model
from dspark.models.config import ModelConfig
from dspark.models.tokenizer import Tokenizer
from dspark.target_worker.actor import target_actor_name
from dspark.target_worker.tensor_parallel import TPConfigError, local_config

# fp32 on CPU: TP changes only the summation order of the row-parallel matmuls (two partial
# sums, all-reduced), so logits of magnitude ~10 agree to ~1e-5.
ATOL, RTOL = 1e-4, 1e-4


def test_tp2_logits_equal_single_process_model(target_tp2, heldout_prompts) -> None:
    path = demo_path("target")
    tok = Tokenizer(path)
    # Three prompts of different lengths in one varlen pass over the head-sharded paged cache.
    prompts = [tok.encode(p)[:n] for p, n in zip(heldout_prompts[:3], (37, 90, 5), strict=True)]
    got = target_tp2.prefill_logits(prompts)
    model = load_model(path)
    assert model.config.vocab_size == got[0].shape[-1]
    with torch.inference_mode():
        for ids, logits in zip(prompts, got, strict=True):
            h, _ = model.forward_dense(torch.tensor([ids]))
            want = model.compute_logits(h)[0]
            torch.testing.assert_close(logits, want, atol=ATOL, rtol=RTOL)
            assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_ranks_are_named_actors_in_the_dspark_namespace(target_tp2) -> None:
    import ray

    assert target_tp2.tp == 2 and target_tp2.device == "cpu"
    for rank, actor in enumerate(target_tp2.actors):
        named = ray.get_actor(target_actor_name(rank), namespace="dspark")
        assert named._actor_id == actor._actor_id


def test_local_instance_is_on_loopback(ray_instance) -> None:
    import ray

    ctx = ray.get_runtime_context()
    assert ctx.gcs_address.startswith("127.0.0.1:"), ctx.gcs_address
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes() if n["Alive"])


@pytest.mark.parametrize("field,tp", [("num_key_value_heads", 4), ("num_attention_heads", 8)])
def test_indivisible_heads_are_refused_with_the_field_named(field: str, tp: int) -> None:
    config = ModelConfig.from_dir(demo_path("target"))  # 4 heads, 2 KV heads
    with pytest.raises(TPConfigError, match=field):
        local_config(config, tp)
    sharded = local_config(config, 2)
    assert (sharded.num_attention_heads, sharded.num_key_value_heads) == (2, 1)
    assert sharded.intermediate_size * 2 == config.intermediate_size
