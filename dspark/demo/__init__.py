"""The shipped demo checkpoints (package data), trained by `dspark train-demo`."""

from __future__ import annotations

from pathlib import Path

DEMO_MODELS = ("target", "draft-model", "dspark")
_ROOT = Path(__file__).resolve().parent


def demo_path(name: str) -> Path:
    """Directory of a shipped demo checkpoint: `target` or `draft-model`.

    Example:
        >>> demo_path("target").name
        'target'
    """
    if name not in DEMO_MODELS:
        raise ValueError(f"demo model {name!r}: choose one of {list(DEMO_MODELS)}")
    path = _ROOT / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"demo checkpoint {name!r} missing at {path}; run `dspark train-demo`"
        )
    return path


def heldout_prompts_path() -> Path:
    """JSON-lines file of prompts cut from the held-out stdlib files (one {"prompt": ...} a
    line)."""
    return _ROOT / "heldout_prompts.jsonl"
