"""Where in-process workers run: one rule for the engine and the Ray actors."""

from __future__ import annotations

import torch


def resolve_device(device: str | None = None) -> str:
    """`device` checked ("cpu", "cuda" or "cuda:N"), or, for None, "cuda" where CUDA is present
    and "cpu" elsewhere. Raises ValueError naming the bad value.

    Example:
        >>> resolve_device("cpu")
        'cpu'
        >>> resolve_device("tpu")
        Traceback (most recent call last):
        ...
        ValueError: device='tpu': choose 'cpu', 'cuda' or 'cuda:N'
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError):
        kind = None
    if kind is None or kind.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: choose 'cpu', 'cuda' or 'cuda:N'")
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available on this machine")
        if kind.index is not None and kind.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA devices"
            )
    return device
