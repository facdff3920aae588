"""Our Llama/Qwen3 decoder against transformers' own implementations (fp32, tiny random models).

Every comparison is a relative error, max |ours - ref| / max |ref|, at most `RTOL`. Weights are
drawn with a larger spread than HF's init (std 0.02 makes attention nearly uniform, which would
hide RoPE and masking mistakes); the scaled-RoPE tests also check that scaling changes HF's
logits, so they cannot pass by ignoring it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoints import rel_err
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dspark.models.checkpoint import load_model
from dspark.models.decoder import DecoderLM
from dspark.models.kv_cache import PagedKVCache

RTOL = 1e-4
VOCAB = 100
HIDDEN = 64
BLOCK = 4  # small, so every sequence crosses block boundaries

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**_BASE, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(std=0.15)
    return model


def _save_and_load(hf: torch.nn.Module, path: Path) -> DecoderLM:
    hf.save_pretrained(path)
    return load_model(path)


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [seq, vocab]
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def _paged_prefill(
    model: DecoderLM, seqs: Sequence[torch.Tensor], hidden_layers: Sequence[int] = ()
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Prefill every sequence in one varlen batch; logits [len_i, vocab] per sequence."""
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 64, BLOCK)
    req_ids = [f"r{i}" for i in range(len(seqs))]
    for r, s in zip(req_ids, seqs, strict=True):
        cache.reserve(r, len(s))
    meta = cache.metadata(req_ids, [0] * len(seqs), [len(s) for s in seqs])
    ids = torch.cat(list(seqs))
    with torch.no_grad():
        out = model.forward_paged(ids, meta, cache, torch.arange(len(ids)), hidden_layers)
    return list(out.logits.split([len(s) for s in seqs])), out.hidden


def _check_prefill_parity(hf: torch.nn.Module, model: DecoderLM, lengths: Sequence[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    refs = [_hf_logits(hf, s) for s in seqs]
    with torch.no_grad():
        for s, ref in zip(seqs, refs, strict=True):
            dense = model.compute_logits(model.forward_dense(s[None])[0])[0]
            assert rel_err(dense, ref) <= RTOL
    paged, _ = _paged_prefill(model, seqs)
    for got, ref in zip(paged, refs, strict=True):
        assert rel_err(got, ref) <= RTOL


# --- prefill parity -------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_matches_hf(tmp_path: Path, arch: str, tie: bool) -> None:
    hf = _hf_model(arch, tie_word_embeddings=tie)
    model = _save_and_load(hf, tmp_path)
    assert model.config.tie_word_embeddings == tie
    assert hasattr(model, "lm_head") != tie
    _check_prefill_parity(hf, model, [1, 7, 13, 24])


def test_dense_batch_matches_hf(tmp_path: Path) -> None:
    """forward_dense over a [batch, seq] batch equals HF row by row."""
    hf = _hf_model("qwen3")
    model = _save_and_load(hf, tmp_path)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.compute_logits(model.forward_dense(ids)[0])
        ref = hf(ids).logits
    assert rel_err(ours, ref) <= RTOL


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_and_mlp_bias_match_hf(tmp_path: Path, arch: str) -> None:
    extra = {"mlp_bias": True} if arch == "llama" else {}
    hf = _hf_model(arch, attention_bias=True, **extra)
    model = _save_and_load(hf, tmp_path)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    if arch == "llama":
        assert model.model.layers[0].mlp.down_proj.bias is not None
    _check_prefill_parity(hf, model, [5, 18])


# --- varlen step over the paged cache -------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_varlen_mixed_query_lengths_match_hf(tmp_path: Path, arch: str) -> None:
    """Prefill, then one batch where requests bring 1, 3, 8 tokens and a new one its whole prompt;
    then a rollback (truncate) and fresh tokens at the rolled-back positions."""
    hf = _hf_model(arch)
    model = _save_and_load(hf, tmp_path)
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 64, BLOCK)
    gen = torch.Generator().manual_seed(3)
    full = {
        r: torch.randint(0, VOCAB, (n,), generator=gen)
        for r, n in {"a": 6, "b": 12, "c": 21, "d": 7}.items()
    }
    done = {"a": 5, "b": 9, "c": 13}  # prefilled lengths; d is new in the second batch

    def step(plan: dict[str, tuple[int, int]]) -> None:
        """plan: req -> (start, end) of the tokens it brings; compare every row with HF."""
        req_ids = list(plan)
        for r in req_ids:
            cache.reserve(r, plan[r][1])
        meta = cache.metadata(
            req_ids, [s for s, _ in plan.values()], [e - s for s, e in plan.values()]
        )
        ids = torch.cat([full[r][s:e] for r, (s, e) in plan.items()])
        with torch.no_grad():
            out = model.forward_paged(ids, meta, cache, torch.arange(len(ids)))
        rows = out.logits.split([e - s for s, e in plan.values()])
        for r, got in zip(req_ids, rows, strict=True):
            s, e = plan[r]
            assert rel_err(got, _hf_logits(hf, full[r][:e])[s:e]) <= RTOL, r

    step({r: (0, n) for r, n in done.items()})
    step({"a": (5, 6), "b": (9, 12), "c": (13, 21), "d": (0, 7)})
    # Rollback: c keeps 15 positions (its stale entries 15..20 stay in the last kept block) and
    # brings different tokens there; b brings a single token after a truncate to a block edge.
    cache.truncate("c", 15)
    cache.truncate("b", 8)
    full["c"] = torch.cat([full["c"][:15], torch.randint(0, VOCAB, (4,), generator=gen)])
    full["b"] = torch.cat([full["b"][:8], torch.randint(0, VOCAB, (1,), generator=gen)])
    step({"c": (15, 19), "b": (8, 9)})


def test_logits_indices_select_rows(tmp_path: Path) -> None:
    hf = _hf_model("llama")
    model = _save_and_load(hf, tmp_path)
    cfg = model.config
    seqs = [
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 10)
    ]
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16, BLOCK)
    for r, s in zip("xy", seqs, strict=True):
        cache.reserve(r, len(s))
    meta = cache.metadata(["x", "y"], [0, 0], [3, 10])
    with torch.no_grad():
        out = model.forward_paged(torch.cat(seqs), meta, cache, torch.tensor([2, 12]))
    assert out.logits.shape == (2, VOCAB)
    assert out.hidden is None
    assert rel_err(out.logits[0], _hf_logits(hf, seqs[0])[-1]) <= RTOL
    assert rel_err(out.logits[1], _hf_logits(hf, seqs[1])[-1]) <= RTOL


# --- RoPE scaling ---------------------------------------------------------------------------

# (arch, rope_parameters): original_max_position_embeddings is small so that every band of the
# scaled frequencies (kept, smoothed, scaled / extrapolated, ramp, interpolated) is populated.
_ROPES: dict[str, tuple[str, dict[str, Any]]] = {
    "linear": ("llama", {"rope_type": "linear", "factor": 2.0}),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}),
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn-mscale": (
        "qwen3",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "yarn-attention-factor": (
        "qwen3",
        {
            "rope_type": "yarn",
            "factor": 3.0,
            "attention_factor": 1.3,
            "truncate": False,
            "original_max_position_embeddings": 48,
        },
    ),
}


def _old_style(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """The pre-transformers-5 layout: `rope_theta` at top level, scaling in `rope_scaling`."""
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    if rope_type != "default":
        raw["rope_scaling"] = {key: rope_type, **params}
    return raw


@pytest.mark.parametrize("style", ["new", "old-type", "old-rope_type"])
@pytest.mark.parametrize("name", sorted(_ROPES))
def test_rope_scaling_matches_hf(tmp_path: Path, name: str, style: str) -> None:
    arch, rope = _ROPES[name]
    hf = _hf_model(arch, rope_parameters={"rope_theta": 10000.0, **rope})
    hf.save_pretrained(tmp_path)
    if style != "new":
        path = tmp_path / "config.json"
        raw = _old_style(json.loads(path.read_text()), style.removeprefix("old-"))
        assert "rope_parameters" not in raw and "rope_scaling" in raw
        path.write_text(json.dumps(raw))
    model = load_model(tmp_path)
    assert model.config.rope.rope_type == rope["rope_type"]
    _check_prefill_parity(hf, model, [9, 30])

    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(4))
    plain = _hf_model(arch)  # same seed and weights, default RoPE
    changed = rel_err(_hf_logits(hf, ids), _hf_logits(plain, ids))
    if rope["rope_type"] == "dynamic":
        # Dynamic NTK only rescales past max_position_embeddings: inside it, it is the default.
        assert changed <= RTOL
    else:
        assert changed > 1e-2, "the scaling must matter at these lengths for the test to bite"


def test_old_style_rope_theta_is_read(tmp_path: Path) -> None:
    hf = _hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_old_style(json.loads(path.read_text()), "type")))
    model = load_model(tmp_path)
    assert model.config.rope.theta == 500.0
    _check_prefill_parity(hf, model, [20])


# --- hidden states --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hidden_layers_are_raw_layer_outputs(tmp_path: Path, arch: str) -> None:
    """`hidden_layers=(-1, 0, 1)` concatenates the embeddings and the raw outputs of layers 0, 1.

    What transformers 5 returns (checked here, so a change in it shows up): `hidden_states` has
    num_layers + 1 entries; index 0 is the embedding output, index i (0 < i < num_layers) the raw
    output of layer i - 1, but the LAST entry is the final-normed output of the last layer, not
    its raw output. So for a 2-layer model ours[-1] = HF[0], ours[0] = HF[1], and ours[1] is
    compared with a forward hook on HF's layer 1; HF[2] equals model.norm(ours[1]).
    """
    hf = _hf_model(arch)
    model = _save_and_load(hf, tmp_path)
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(5))
    raw_last: list[torch.Tensor] = []
    hook = hf.model.layers[1].register_forward_hook(
        lambda _m, _i, out: raw_last.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            ref = hf(ids[None], output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    assert len(ref) == 3
    emb, layer0, layer1 = ref[0][0], ref[1][0], raw_last[0][0]

    _, hidden = _paged_prefill(model, [ids], hidden_layers=(-1, 0, 1))
    assert hidden is not None and hidden.shape == (len(ids), 3 * HIDDEN)
    got = hidden.split(HIDDEN, dim=-1)
    assert rel_err(got[0], emb) <= RTOL
    assert rel_err(got[1], layer0) <= RTOL
    assert rel_err(got[2], layer1) <= RTOL
    with torch.no_grad():
        assert rel_err(model.model.norm(got[2]), ref[2][0]) <= RTOL
    assert rel_err(got[2], ref[2][0]) > 1e-2  # HF's last entry really is post-norm

    # The dense forward captures the same tensors, in the order asked for.
    with torch.no_grad():
        _, dense_hidden = model.forward_dense(ids[None], hidden_layers=(1, -1))
    assert dense_hidden is not None
    assert rel_err(dense_hidden[0], torch.cat([layer1, emb], dim=-1)) <= RTOL
