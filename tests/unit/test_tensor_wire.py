"""Tensors sent as raw bytes (`dspark.tensor_wire`): exact round trips, only the tensor's own bytes
on the wire, and writable tensors on receipt, whatever the dtype, shape or memory layout."""

from __future__ import annotations

import pickle

import pytest
import torch

from dspark.tensor_wire import from_wire, to_wire

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
          torch.uint8, torch.bool)
SHAPES = ((), (0,), (4, 0), (5,), (3, 7), (2, 3, 4))


def _sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 100
    return x > 0 if dtype == torch.bool else x.to(dtype)


def _through_pickle(t: torch.Tensor, read_only: bool) -> torch.Tensor:
    """Pickle protocol 5 with the bytes out of band, as Ray sends them; `read_only` hands the
    buffers back read-only, as Ray's object store does."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(to_wire(t), protocol=5, buffer_callback=buffers.append)
    raw = [bytes(b.raw()) if read_only else bytearray(b.raw()) for b in buffers]
    return from_wire(pickle.loads(data, buffers=raw))


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_exact(dtype: torch.dtype, read_only: bool) -> None:
    for i, shape in enumerate(SHAPES):
        x = _sample(shape, dtype, i)
        y = _through_pickle(x, read_only)
        assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x), (dtype, shape)
        if x.numel():
            y.view(-1)[0] = y.view(-1)[-1]  # writable: a read-only buffer was copied first


def test_views_send_only_their_own_elements() -> None:
    # A row slice of a pass's hidden states: pickled as is it carries the whole storage.
    big = torch.randn(20, 768)
    rows = big[3:6]
    wire = to_wire(rows)
    assert wire[0].nbytes == rows.numel() * rows.element_size() == 3 * 768 * 4
    assert len(pickle.dumps(rows)) > 20 * 768 * 4  # what it replaces
    assert torch.equal(_through_pickle(rows, True), rows)
    # Non-contiguous views (a transpose, a strided column) arrive as their values.
    for view in (big.t(), big[:, ::5], big.t()[2:9]):
        assert torch.equal(_through_pickle(view, False), view)


def test_tensors_needing_grad_arrive_detached() -> None:
    w = torch.randn(3, 4, requires_grad=True)
    y = _through_pickle(w * 2, False)
    assert not y.requires_grad and torch.equal(y, (w * 2).detach())
