"""The shipped demo checkpoints: real HF directories, within their size and cost limits."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.demo import demo_path
from dspark.models.checkpoint import load_model
from dspark.models.tokenizer import Tokenizer

CAUSAL_LMS = ("target", "draft-model")  # the DSpark drafter has its own tests

transformers = pytest.importorskip("transformers")


def matmul_params_per_token(path) -> int:
    """Weights one token multiplies by: every decoder-layer matrix plus the LM head."""
    model = load_model(path)
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    cfg = model.config
    return layers + cfg.vocab_size * cfg.hidden_size


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_loads_with_transformers_and_matches(name: str, heldout_prompts: list[str]) -> None:
    path = demo_path(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ours_tok = Tokenizer(path)
    for text in heldout_prompts[:20] + ["", "  \n\t x = 'é'  "]:
        assert ours_tok.encode(text) == tok(text)["input_ids"]
    ids = torch.tensor([ours_tok.encode(heldout_prompts[0])])
    ours = load_model(path)
    with torch.no_grad():
        h, _ = ours.forward_dense(ids)
        torch.testing.assert_close(ours.compute_logits(h), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_sizes_and_costs() -> None:
    demo_root = demo_path("target").parent  # every shipped checkpoint, the DSpark drafter included
    total = sum(f.stat().st_size for f in demo_root.glob("*/*.safetensors"))
    assert total < 40 * 2**20, f"shipped weights take {total / 2**20:.1f} MiB"
    target = sum(p.numel() for p in load_model(demo_path("target")).parameters())
    assert 5e6 <= target <= 20e6
    ratio = matmul_params_per_token(demo_path("draft-model")) / matmul_params_per_token(
        demo_path("target")
    )
    assert ratio <= 0.25, f"draft model costs {ratio:.2f} of the target per token"


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_training_log_records_held_out_loss(name: str) -> None:
    log = json.loads((demo_path(name) / "training_log.json").read_text())
    assert log["held_out_loss"] < 4.0 and log["train_seconds"] > 0
