"""DSpark drafter checkpoints in DeepSpec's layout (`Qwen3DSparkModel.save_pretrained`).

A drafter directory written here by hand, with DeepSpec's parameter names and config.json fields
(the target's Qwen3 config plus block_size, target_layer_ids, mask_token_id, markov_rank, ...;
random weights, tiny shapes), must load strictly, draft, and stay lossless (greedy identity
through the engine). Our own writer must produce the same names and fields.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import write_tiny_checkpoint

from dspark.coordinator.engine import Engine
from dspark.draft_worker.dspark_checkpoint import load_drafter, new_drafter, save_drafter
from dspark.sampling_params import SamplingParams

GAMMA, RANK, LAYERS = 5, 16, 1
TARGET_LAYER_IDS = [-1, 0]  # -1: the embedding output, as DeepSpec allows


def deepspec_names(num_layers: int, attention_bias: bool = False) -> list[str]:
    """Parameter names of DeepSpec's Qwen3DSparkModel (no `model.` prefix)."""
    names = [
        "embed_tokens.weight",
        "norm.weight",
        "fc.weight",
        "hidden_norm.weight",
        "lm_head.weight",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    ]
    for i in range(num_layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [
            p + f"self_attn.{n}.weight"
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ]
        names += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        if attention_bias:
            names += [p + f"self_attn.{n}.bias" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return names


def write_deepspec_drafter(target_dir: Path, out: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """What DeepSpec's build_draft_config + save_pretrained write, built without our code."""
    target_cfg = json.loads((target_dir / "config.json").read_text())
    target_state = load_file(str(target_dir / "model.safetensors"))
    d, vocab, heads, kv_heads, hd, inter = (
        target_cfg[k]
        for k in (
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
        )
    )
    config = {
        **target_cfg,
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "num_target_layers": target_cfg["num_hidden_layers"],
        "num_hidden_layers": LAYERS,
        "block_size": GAMMA,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * LAYERS,
        "mask_token_id": 7,
        "target_layer_ids": TARGET_LAYER_IDS,
        "num_anchors": 512,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": LAYERS,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
        "use_cache": True,
    }
    config.pop("rope_parameters", None)
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (d, len(TARGET_LAYER_IDS) * d),
        "markov_head.markov_w1.weight": (vocab, RANK),
        "markov_head.markov_w2.weight": (vocab, RANK),
        "confidence_head.proj.weight": (1, d + RANK),
        "confidence_head.proj.bias": (1,),
        "q_proj": (heads * hd, d),
        "k_proj": (kv_heads * hd, d),
        "v_proj": (kv_heads * hd, d),
        "o_proj": (d, heads * hd),
        "gate_proj": (inter, d),
        "up_proj": (inter, d),
        "down_proj": (d, inter),
    }
    state = {}
    for name in deepspec_names(LAYERS):
        short = name.split(".")[-2]
        if name.endswith(("norm.weight", "layernorm.weight")):
            state[name] = 1 + 0.1 * torch.randn(
                hd if short in ("q_norm", "k_norm") else d, generator=gen
            )
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            state[name] = target_state["model.embed_tokens.weight"].clone()  # tied target: a copy
        else:
            # Small layer weights: the block's hidden stays near the anchor's embedding, so the
            # first draft often repeats the anchor, which a random target often does too.
            state[name] = 0.002 * torch.randn(shapes.get(name, shapes.get(short)), generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return state


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("dspark_ckpt")
    target = write_tiny_checkpoint(root / "target", "qwen3", layers=2, seed=1, std=0.2)
    state = write_deepspec_drafter(target, root / "drafter")
    return target, root / "drafter", state


def test_deepspec_layout_loads_strictly_with_every_tensor(pair) -> None:
    target, drafter_dir, state = pair
    model = load_drafter(drafter_dir, target)
    assert model.config.target_layer_ids == (-1, 0) and model.config.block_size == GAMMA
    assert model.config.mask_token_id == 7 and model.config.markov_rank == RANK
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor, atol=0, rtol=0, msg=name)
    # Without the target the drafter's own (DeepSpec-stored) embedding and head are used.
    alone = load_drafter(drafter_dir)
    torch.testing.assert_close(alone.lm_head.weight, model.lm_head.weight)


def test_deepspec_layout_drafts_and_stays_lossless(pair) -> None:
    target, drafter_dir, _ = pair
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 4096) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [
        o.token_ids for o in Engine(target, proposer="none", policy="off").generate(prompts, params)
    ]
    engine = Engine(
        target, proposer="dspark", drafter=drafter_dir, policy="fixed", k=GAMMA, max_num_seqs=4
    )
    assert engine.target.hidden_layers == (-1, 0)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.stats["verified_tokens"] for o in outs) > 0
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0


def test_our_writer_uses_deepspec_names_and_fields(pair, tmp_path: Path) -> None:
    target, _, _ = pair
    model = new_drafter(
        target,
        block_size=GAMMA,
        num_draft_layers=2,
        target_layer_ids=[0, 1],
        mask_token_id=3,
        markov_rank=RANK,
    )
    save_drafter(model, tmp_path / "ours", dtype=torch.float32)
    assert set(load_file(str(tmp_path / "ours" / "model.safetensors"))) == set(deepspec_names(2))
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"]
    for field, value in {
        "block_size": GAMMA,
        "target_layer_ids": [0, 1],
        "mask_token_id": 3,
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "num_hidden_layers": 2,
        "num_target_layers": 2,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
    }.items():
        assert raw[field] == value, field
    reloaded = load_drafter(tmp_path / "ours", target)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, msg=name)


def test_drafter_without_embeddings_needs_its_target(pair, tmp_path: Path) -> None:
    target, _, _ = pair
    model = new_drafter(target, block_size=3, target_layer_ids=[1], mask_token_id=3, markov_rank=8)
    save_drafter(model, tmp_path / "slim", include_embeddings=False)
    with pytest.raises(ValueError, match="lacks"):
        load_drafter(tmp_path / "slim")
    loaded = load_drafter(tmp_path / "slim", target)
    torch.testing.assert_close(loaded.embed_tokens.weight, model.embed_tokens.weight)


@pytest.mark.parametrize(
    "field,value",
    [
        ("target_layer_ids", [0, 5]),
        ("target_layer_ids", [1, 0]),
        ("markov_head_type", "rnn"),
        ("block_size", 0),
        ("mask_token_id", 99999),
    ],
)
def test_bad_config_fields_are_named(pair, tmp_path: Path, field: str, value: object) -> None:
    target, drafter_dir, _ = pair
    raw = json.loads((drafter_dir / "config.json").read_text())
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(drafter_dir / "model.safetensors")
    with pytest.raises(ValueError, match=field):
        load_drafter(tmp_path, target)


def test_drafter_without_markov_head_is_lossless(pair, tmp_path: Path) -> None:
    """markov_rank = 0 (DeepSpec's DFlash-style block) with a confidence head on h alone."""
    target, drafter_dir, _ = pair
    raw = json.loads((drafter_dir / "config.json").read_text())
    raw.update(markov_rank=0, confidence_head_with_markov=False)
    state = load_file(str(drafter_dir / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.startswith("markov_head.")}
    state["confidence_head.proj.weight"] = state["confidence_head.proj.weight"][:, :64].contiguous()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(state, str(tmp_path / "model.safetensors"))
    prompts = [[5, 6, 7, 8], [9] * 12]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = Engine(target, proposer="none", policy="off").generate(prompts, params)
    engine = Engine(target, proposer="dspark", drafter=tmp_path, policy="fixed", k=GAMMA)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert engine.proposer.model.markov_head is None
    assert sum(o.stats["verified_tokens"] for o in outs) > 0
