"""Checkpoint directories: sharded loading, `save_model` read back by transformers, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import rel_err
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dspark.models.checkpoint import load_model, read_state_dict, save_model
from dspark.models.config import ModelConfig
from dspark.models.decoder import DecoderLM
from dspark.training.lm_training import _COMMON, PRESETS

RTOL = 1e-4
VOCAB = 100


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int = 17) -> torch.Tensor:  # [1, n]
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(0))


def _our_logits(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model.forward_dense(ids)[0])


def _hf_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.15)
    return model


def _raw_config(preset: str, **overrides: Any) -> dict[str, Any]:
    """Built like `train_lm` does: `_COMMON` + a preset, with tiny sizes."""
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
    return {
        **_COMMON,
        **PRESETS[preset],
        **small,
        "vocab_size": VOCAB,
        "eos_token_id": 0,
        **overrides,
    }


def _our_model(raw: dict[str, Any]) -> DecoderLM:
    torch.manual_seed(1)
    model = DecoderLM(ModelConfig.from_dict(raw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(std=0.15)
    return model


# --- sharded safetensors --------------------------------------------------------------------


def test_sharded_checkpoint_loads_and_matches(tmp_path: Path) -> None:
    hf = _hf_llama()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert not (tmp_path / "model.safetensors").exists()
    assert set(read_state_dict(tmp_path)) == set(index["weight_map"])

    model = load_model(tmp_path)
    with torch.no_grad():
        ref = hf(_ids()).logits
    assert rel_err(_our_logits(model, _ids()), ref) <= RTOL


# --- save_model -> transformers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "tie"), [("target", True), ("draft-model", True), ("draft-model", False)]
)
def test_save_model_fp32_loads_in_transformers(tmp_path: Path, preset: str, tie: bool) -> None:
    raw = _raw_config(preset, tie_word_embeddings=tie)
    ours = _our_model(raw)
    save_model(ours, raw, tmp_path, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == raw["architectures"][0]
    assert hf.dtype == torch.float32
    assert hf.config.tie_word_embeddings == tie
    with torch.no_grad():
        ref = hf(_ids()).logits
    assert rel_err(_our_logits(ours, _ids()), ref) <= RTOL
    # And back into our loader.
    assert rel_err(_our_logits(load_model(tmp_path), _ids()), ref) <= RTOL


def test_save_model_bf16_default_matches_rounded_weights(tmp_path: Path) -> None:
    """The default storage is bf16: transformers loads it as bf16 ('auto'), and in fp32 it equals
    our model with every weight rounded to bf16."""
    raw = _raw_config("target")
    ours = _our_model(raw)
    save_model(ours, raw, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path).dtype == torch.bfloat16

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    rounded = _our_model(raw)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        ref = hf(_ids()).logits
    assert rel_err(_our_logits(rounded, _ids()), ref) <= RTOL
    assert rel_err(_our_logits(ours, _ids()), ref) > 1e-4  # the rounding is really there


def test_load_model_bf16_keeps_rope_frequencies_float32(tmp_path: Path) -> None:
    """Regression: `load_model(dtype=bf16)` used to cast the RoPE inv_freq buffer to bf16 (HF keeps
    it float32), which moves every rotary angle by up to ~0.4% of its value."""
    _hf_llama().save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(model.rotary.inv_freq, hf.model.rotary_emb.inv_freq)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tie", "missing"),
    [
        (False, "model.layers.1.mlp.up_proj.weight"),
        (False, "lm_head.weight"),
        (True, "model.embed_tokens.weight"),
    ],
)
def test_missing_tensor_is_named(tmp_path: Path, tie: bool, missing: str) -> None:
    _hf_llama(tie=tie).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state[missing]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=f"Missing key.*{missing}"):
        load_model(tmp_path)


def test_no_weights_file_is_a_clear_error(tmp_path: Path) -> None:
    _hf_llama().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    raw = _raw_config("draft-model", architectures=["MistralForCausalLM"], model_type="mistral")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="mistral"):
        ModelConfig.from_dict({**raw, "architectures": None})


def test_unsupported_rope_type_is_named() -> None:
    raw = _raw_config("target", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_dict(raw)


def test_the_top_level_name_kernels_is_never_this_repositorys_folder() -> None:
    """The folder `kernels/` is `dspark.kernels`; with the repository root on sys.path it would
    shadow the Hub's `kernels` package, which transformers >= 5.25 imports (tests/conftest.py)."""
    import importlib.util

    import dspark.kernels

    ours = Path(dspark.kernels.__file__).resolve().parent
    spec = importlib.util.find_spec("kernels")
    assert spec is None or spec.origin is None or Path(spec.origin).resolve().parent != ours
