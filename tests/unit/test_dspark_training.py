"""DSpark drafter training: the training layout computes what serving computes, and a run
resumed from its checkpoint ends exactly where an uninterrupted run ends (fixed seeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_checkpoints import write_tiny_checkpoint

import dspark.training.drafter_training as drafter_training
from dspark.draft_worker.dspark_checkpoint import new_drafter, save_drafter
from dspark.draft_worker.dspark_proposer import DSparkProposer
from dspark.messages import DraftQuery, NewRequest
from dspark.models.checkpoint import load_model
from dspark.sampling_params import SamplingParams
from dspark.training.block_eval import block_hidden
from dspark.training.drafter_training import DrafterTrainConfig, train_drafter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dspark_train")
    target = write_tiny_checkpoint(root / "target", "qwen3", layers=2, seed=1, std=0.2)
    drafter = new_drafter(
        target,
        block_size=5,
        num_draft_layers=2,
        target_layer_ids=[0, 1],
        mask_token_id=9,
        markov_rank=16,
        std=0.1,
        seed=4,
    )
    save_drafter(drafter, root / "drafter", dtype=torch.float32)
    return target, root / "drafter"


def test_training_blocks_equal_serving_blocks(tiny) -> None:
    """Many anchors per window with a context mask (training) = one request's cached context."""
    target_dir, drafter_dir = tiny
    target = load_model(target_dir)
    proposer = DSparkProposer(drafter_dir, target_dir)
    model = proposer.model
    gen = torch.Generator().manual_seed(0)
    window = torch.randint(1, 4096, (1, 48), generator=gen)
    anchors = torch.tensor([[3, 17, 30, 41]])
    with torch.no_grad():
        _, hidden = target.forward_dense(window, hidden_layers=model.config.target_layer_ids)
        h, anchor_tokens = block_hidden(model, hidden, window, anchors)
    for n, a in enumerate(anchors[0].tolist()):
        req = f"r{n}"
        proposer.add_request(NewRequest(req, (1,), SamplingParams(temperature=0), seed=0))
        drafts = proposer.propose(
            [DraftQuery(req, tuple(window[0, : a + 1].tolist()), 5, hidden[0, :a])]
        )
        # The same tokens by the Markov loop over the training path's base logits ...
        prev, tokens = anchor_tokens[0, n], []
        for k in range(5):
            prev = (model.base_logits(h[0, n, k]) + model.markov_bias(prev)).argmax()
            tokens.append(int(prev))
        assert drafts.token_ids[0].tolist() == tokens
        # ... and the same confidences.
        prev_ids = torch.tensor([int(anchor_tokens[0, n])] + tokens[:-1])
        conf = model.calibrated(model.confidence_logits(h[0, n], prev_ids))
        torch.testing.assert_close(drafts.confidences[0].float(), conf, atol=1e-5, rtol=1e-4)


def test_resumed_run_ends_where_an_uninterrupted_run_ends(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target_dir, _ = tiny
    gen = torch.Generator().manual_seed(5)
    stream = torch.randint(1, 4096, (5000,), generator=gen, dtype=torch.int32)
    monkeypatch.setattr(drafter_training, "encode_corpus", lambda _dir, held_out: stream)
    kw = dict(
        batch_size=2,
        seq_len=40,
        num_anchors=4,
        block_size=5,
        num_draft_layers=1,
        target_layer_ids=(0, 1),
        markov_rank=8,
        eval_every=1000,
        eval_windows=2,
        checkpoint_every=2,
        mask_token_id=9,
    )
    straight = train_drafter(target_dir, tmp_path / "a", DrafterTrainConfig(steps=4, **kw))
    train_drafter(target_dir, tmp_path / "b", DrafterTrainConfig(steps=2, **kw))
    resumed = train_drafter(target_dir, tmp_path / "b", DrafterTrainConfig(steps=4, **kw))
    assert [r["loss"] for r in resumed["train"]] == [r["loss"] for r in straight["train"]]
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "a" / "training_loss.png").exists()
    assert straight["train"][0]["loss"] > 0 and len(straight["eval"]) == 1


def test_init_from_continues_from_a_drafters_weights(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`init_from` starts the run at the given drafter's weights and mask token (not at random
    ones), and a drafter of another shape is refused by name."""
    target_dir, drafter_dir = tiny
    stream = torch.randint(1, 4096, (5000,), generator=torch.Generator().manual_seed(6),
                           dtype=torch.int32)
    monkeypatch.setattr(drafter_training, "encode_corpus", lambda _dir, held_out: stream)
    kw = dict(batch_size=2, seq_len=40, num_anchors=4, block_size=5, num_draft_layers=2,
              target_layer_ids=(0, 1), markov_rank=16, eval_every=1000, eval_windows=2,
              autocast_bf16=False)
    start = load_file(str(drafter_dir / "model.safetensors"))
    seen: list[dict[str, torch.Tensor]] = []
    real_loss = drafter_training.drafter_loss

    def spy(target, drafter, *args):  # noqa: ANN001, ANN202 - records the weights at step 1
        if not seen:
            seen.append({k: v.detach().clone() for k, v in drafter.state_dict().items()})
        return real_loss(target, drafter, *args)

    monkeypatch.setattr(drafter_training, "drafter_loss", spy)
    train_drafter(target_dir, tmp_path / "c",
                  DrafterTrainConfig(steps=1, init_from=str(drafter_dir), **kw))
    assert set(seen[0]) == set(start)
    for name, tensor in start.items():
        assert torch.equal(seen[0][name], tensor), name
    assert json.loads((tmp_path / "c" / "config.json").read_text())["mask_token_id"] == 9
    with pytest.raises(ValueError, match="init_from=.*shapes differ"):
        train_drafter(target_dir, tmp_path / "d", DrafterTrainConfig(
            steps=1, init_from=str(drafter_dir), **{**kw, "markov_rank": 8}))
