"""Tensors across Ray calls as their raw bytes, not as `torch.save` archives.

Pickled as is, a tensor goes through `torch.save`: a small zip archive per tensor, about 40 us
to write and 50 us to read for a 3 x 768 float32 one, and a row slice carries its whole storage
(a 3-row slice of a 20-row pass: 62 kB for 9 kB of data). Every step sends tensors both ways
(drafts, the verify plan, the target's hidden rows), and on the demo service the two Ray calls
of a step cost 6 ms beyond the workers' own work. `install()` makes this process's Ray
serializer send a tensor as a flat uint8 numpy view instead: pickle protocol 5 carries it as an
out-of-band buffer, and only the tensor's own bytes travel.

The sender registers (`install` in the driver and in each actor's constructor); the receiver
needs nothing, as the deserializer is this module's function. A received tensor is always on
the CPU and writable: bytes Ray hands back read-only (its object store) are copied first.

    >>> t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    >>> torch.equal(from_wire(to_wire(t[1:])), t[1:])
    True
"""

from __future__ import annotations

import numpy as np
import torch

Wire = tuple[np.ndarray, str, tuple[int, ...]]  # (bytes as uint8 [num_bytes], dtype name, shape)


def to_wire(tensor: torch.Tensor) -> Wire:
    """The tensor's own bytes (a view when it is a contiguous CPU tensor), dtype and shape."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # bfloat16 and friends have no numpy dtype: the bytes travel as uint8 and are viewed back.
    data = t.reshape(-1).view(torch.uint8).numpy()
    return data, str(t.dtype).removeprefix("torch."), tuple(t.shape)


def from_wire(wire: Wire) -> torch.Tensor:
    """Rebuild what `to_wire` sent: a CPU tensor of the same dtype, shape and values."""
    data, dtype, shape = wire
    if data.size == 0:  # an empty buffer may come back with stride 0, which `view` refuses
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if not data.flags.writeable:
        data = data.copy()
    return torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)


def install() -> None:
    """Send tensors from this process by `to_wire` in Ray calls and results (idempotent; nothing
    to do in a process that is not connected to Ray)."""
    import ray
    import ray.util

    if not ray.is_initialized():
        return
    ray.util.register_serializer(torch.Tensor, serializer=to_wire, deserializer=from_wire)
