"""Tensor parallelism without Ray: two gloo processes load an awkward checkpoint (vocabulary not
divisible by tp, untied LM head, attention and MLP biases, Llama) and must reproduce the
single-process model's logits. Covers the vocabulary padding and the once-only row bias."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark.models.checkpoint import load_model, save_model
from dspark.models.config import ModelConfig
from dspark.models.decoder import DecoderLM

ATOL, RTOL = 1e-4, 1e-4  # fp32; only the order of the all-reduced partial sums differs
RAW = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4093,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "tie_word_embeddings": False, "attention_bias": True,
    "mlp_bias": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}


def _rank_main(rank: int, world: int, rendezvous: str, path: str, ids: list[int], out: str) -> None:
    from dspark.target_worker.tensor_parallel import TPGroup, load_tp_model

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # A file rendezvous: no store server thread in rank 0 to race the other rank's exit, and no
    # port to pick. Gloo's own connections still run over loopback.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    try:
        model = load_tp_model(path, TPGroup(rank, world))
        with torch.inference_mode():
            h, _ = model.forward_dense(torch.tensor([ids]))
            logits = model.compute_logits(h)[0]
        torch.save(logits, f"{out}.{rank}")
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_logits_with_padded_vocab_and_biases(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = DecoderLM(ModelConfig.from_dict(RAW))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)  # biases too: a bias added twice would show
    save_model(model, RAW, tmp_path / "ckpt", dtype=torch.float32)
    ids = torch.randint(0, RAW["vocab_size"], (23,)).tolist() + [RAW["vocab_size"] - 1]
    out = str(tmp_path / "logits")
    rendezvous = str(tmp_path / "rendezvous")
    mp.spawn(_rank_main, args=(2, rendezvous, str(tmp_path / "ckpt"), ids, out), nprocs=2)
    full = load_model(tmp_path / "ckpt")
    with torch.inference_mode():
        h, _ = full.forward_dense(torch.tensor([ids]))
        want = full.compute_logits(h)[0]
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got.shape == want.shape == (len(ids), RAW["vocab_size"])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
