"""Profile the cost model on the real models (start-up or `dspark profile`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.coordinator.cost_model import CostModel, cache_key, hardware_key, median_time, monotone
from dspark.models.decoder import DecoderLM
from dspark.models.kv_cache import PagedKVCache

VERIFY_BLOCK = 8  # tokens per request in a profiled verify batch (anchor + 7 drafts)


@torch.inference_mode()
def time_forward(model: DecoderLM, q_lens: list[int], context: int, repeats: int) -> float:
    """Median seconds of one varlen forward: request i brings q_lens[i] tokens after `context`."""
    cfg = model.config
    block = 16
    per_req = math.ceil((context + max(q_lens)) / block)
    param = next(model.parameters())
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         num_blocks=per_req * len(q_lens), block_size=block,
                         dtype=param.dtype, device=param.device)
    ids = [f"p{i}" for i in range(len(q_lens))]
    for r, n in zip(ids, q_lens):
        cache.reserve(r, context + n)
    tokens = torch.randint(0, cfg.vocab_size, (sum(q_lens),), device=param.device)
    last = torch.tensor(q_lens).cumsum(0) - 1

    def run() -> None:
        # Metadata is rebuilt every call, as the engine does every step.
        meta = cache.metadata(ids, [context] * len(ids), q_lens)
        rows = torch.cat([torch.arange(e - n, e + 1) for e, n in zip(last.tolist(), q_lens)])
        model.forward_paged(tokens, meta, cache, rows.to(param.device))

    return median_time(run, repeats)


def verify_shape(num_tokens: int) -> list[int]:
    """Split B tokens into requests of VERIFY_BLOCK tokens (the last one shorter)."""
    full, rest = divmod(num_tokens, VERIFY_BLOCK)
    return [VERIFY_BLOCK] * full + ([rest] if rest else [])


def profile(target: DecoderLM, drafter: DecoderLM | None, b_max: int = 128, n_max: int = 64,
            context: int = 256, repeats: int = 5, key: str = "") -> CostModel:
    verify = []
    for b in tqdm(range(1, b_max + 1), desc="profile verify", unit="B"):
        verify.append(time_forward(target, verify_shape(b), context, repeats))
    draft = []
    if drafter is not None:
        for n in tqdm(range(1, n_max + 1), desc="profile draft", unit="reqs"):
            draft.append(time_forward(drafter, [1] * n, context, repeats))
    meta = {"hardware": hardware_key(), "context": str(context), "repeats": str(repeats),
            "torch": torch.__version__}
    return CostModel(key or hardware_key(), monotone(verify), monotone(draft), meta)


def load_or_profile(target_dir: str | Path, drafter_dir: str | Path | None, target: DecoderLM,
                    drafter: DecoderLM | None, cache_dir: str | Path, **kwargs: int) -> CostModel:
    """The persisted profile for these models on this hardware, measured once if missing."""
    dirs = [target_dir] + ([drafter_dir] if drafter_dir is not None else [])
    key = cache_key(dirs)
    path = Path(cache_dir) / f"{key}.json"
    if path.exists():
        return CostModel.load(path)
    model = profile(target, drafter, key=key, **kwargs)
    model.save(path)
    return model


def plot(cost: CostModel, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(range(1, len(cost.verify) + 1), [t * 1e3 for t in cost.verify])
    axes[0].set_xlabel("verify tokens B")
    axes[0].set_ylabel("ms per pass")
    axes[0].set_title("target verify step")
    if cost.draft:
        axes[1].plot(range(1, len(cost.draft) + 1), [t * 1e3 for t in cost.draft])
    axes[1].set_xlabel("requests")
    axes[1].set_ylabel("ms per draft position")
    axes[1].set_title("draft forward (one position)")
    fig.suptitle(cost.key, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)
