"""Held-out prompts for tests and benchmarks, cut from the held-out stdlib files."""

from __future__ import annotations

import json
import random
from pathlib import Path

from dspark.training.corpus import read_texts


def make_heldout_prompts(out_file: str | Path, count: int = 200, seed: int = 0) -> Path:
    """Write `count` prompts of 6-20 consecutive source lines, each starting at a line start."""
    rng = random.Random(seed)
    texts = [t for t in read_texts(held_out=True) if t.count("\n") > 40]
    rows = []
    while len(rows) < count:
        lines = rng.choice(texts).splitlines(keepends=True)
        start = rng.randrange(0, len(lines) - 21)
        prompt = "".join(lines[start : start + rng.randint(6, 20)])
        if 80 <= len(prompt) <= 900:
            rows.append({"prompt": prompt})
    out = Path(out_file)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def load_prompts(path: str | Path, count: int | None = None) -> list[str]:
    rows = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line]
    return rows[:count] if count is not None else rows
