"""Which implementation runs an operation: its Triton kernel or its torch reference.

Every operation in `dspark.kernels` has one dispatch function, and every dispatch asks
`use_triton` once. The rule:

- `DSPARK_KERNELS=torch`: the torch reference, everywhere.
- `DSPARK_KERNELS=triton`: the Triton kernel, everywhere (on CPU tensors this needs
  `TRITON_INTERPRET=1`, which is how the kernel tests run without a GPU).
- unset: the Triton kernel when the tensors are on CUDA, of a dtype the kernel takes, and
  triton is installed; else the reference (float64 attention on a GPU, say: same semantics).

Importing `dspark.kernels` never imports triton: `lazy_jit` imports it on a kernel's first launch.
Triton decides once, when it is imported, whether its library functions (`tl.max`, `tl.randint4x`,
...) are compiled or interpreted, so TRITON_INTERPRET must be set before that import; importing
lazily lets a test set it after `dspark` is imported (tests/conftest.py imports the models). Kernel
modules name `triton.language` as `tl` only for type checkers; `lazy_jit` binds `tl` in the
kernel's module on first launch, the way an import would have.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

ENV_VAR = "DSPARK_KERNELS"
_CHOICES = ("triton", "torch")
HAS_TRITON = importlib.util.find_spec("triton") is not None  # a Linux x86-64 dependency


def use_triton(tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...] | None = None) -> bool:
    """True when the operation on `tensor` (its main input) should run its Triton kernel;
    `dtypes`: those the kernel takes (None: any).

    >>> use_triton(torch.zeros(1))  # a CPU tensor with DSPARK_KERNELS unset: the reference
    False
    """
    choice = os.environ.get(ENV_VAR, "")
    if choice == "torch":
        return False
    if choice == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed")
        return True
    if choice:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {_CHOICES} or unset")
    return HAS_TRITON and tensor.is_cuda and (dtypes is None or tensor.dtype in dtypes)


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter: TRITON_INTERPRET, read as triton does."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): triton block sizes."""
    return 1 << max(0, n - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere): sizes launch grids."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _compiled(fn: Callable[..., None], interpret: bool) -> Any:  # noqa: ANN401 - a triton kernel
    triton = importlib.import_module("triton")
    library_interpreted = type(triton.language.max).__name__ == "InterpretedFunction"
    if library_interpreted != interpret:
        raise RuntimeError(
            f"triton was imported with TRITON_INTERPRET={int(library_interpreted)} and is now "
            f"asked for TRITON_INTERPRET={int(interpret)}: set it before triton is first "
            "imported in the process (GPU and interpreted kernels cannot share a process)"
        )
    fn.__globals__.setdefault("tl", triton.language)  # the deferred `import triton.language as tl`
    return triton.jit(fn)  # reads TRITON_INTERPRET itself, the value the cache key records


class lazy_jit:  # noqa: N801 - used as a decorator, like triton.jit
    """`triton.jit`, applied on the kernel's first launch (module docstring says why).

    `kernel[grid](*args, **constexprs)` launches as with `triton.jit`; triton caches compilations.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        assert HAS_TRITON, "triton is not installed"
        return _compiled(self.fn, interpreting())[grid]
