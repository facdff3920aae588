"""The target's own continuations of corpus prompts: training text for a drafter.

When a drafter serves sampled requests, its context is not corpus text but what the target
sampled. Training windows made of such continuations put the drafter where it will work (the
DSpark paper trains on target-generated responses for the same reason).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from dspark.messages import NewRequest, VerifyPlan
from dspark.sampling_params import SamplingParams
from dspark.target_worker.runner import TargetRunner


@torch.inference_mode()
def sample_continuations(
    target_dir: str | Path,
    prompts: torch.Tensor,  # [num, prompt_len] int64
    new_tokens: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    batch: int = 128,
) -> torch.Tensor:  # [num, prompt_len + new_tokens] int64
    """Each prompt followed by `new_tokens` tokens the target samples (EOS not special)."""
    num, prompt_len = prompts.shape
    blocks_per_seq = -(-(prompt_len + new_tokens) // 16) + 1
    runner = TargetRunner(target_dir, num_blocks=blocks_per_seq * min(batch, num), block_size=16)
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True)
    out = torch.zeros(num, prompt_len + new_tokens, dtype=torch.long)
    out[:, :prompt_len] = prompts
    with tqdm(total=num * new_tokens, desc="sample target continuations", unit="tok") as bar:
        for first in range(0, num, batch):
            rows = list(range(first, min(num, first + batch)))
            ids = tuple(f"s{i}" for i in rows)
            for i, r in zip(rows, ids, strict=False):
                runner.add_request(NewRequest(r, tuple(prompts[i].tolist()), params, seed + i))
            length = prompt_len
            pending = {r: tuple(prompts[i].tolist()) for i, r in zip(rows, ids, strict=False)}
            starts = {r: 0 for r in ids}
            for _ in range(new_tokens):
                plan = VerifyPlan(ids, tuple(starts[r] for r in ids),
                                  tuple(pending[r] for r in ids), (0,) * len(ids),
                                  torch.zeros(len(ids), 0, dtype=torch.long), None, 0)
                result = runner.verify(plan)
                for i, r, toks in zip(rows, ids, result.output_tokens, strict=False):
                    out[i, length] = toks[0]
                    starts[r] += len(pending[r])
                    pending[r] = toks
                length += 1
                bar.update(len(ids))
            for r in ids:
                runner.release(r)
    return out
