"""The tensor transport installed by `connect` (`dspark.tensor_wire`), through Ray's own
serializer: small objects travel inline, large ones through the object store, whose buffers are
read-only; both arrive exact and writable."""

from __future__ import annotations

import pytest
import torch

from dspark.tensor_wire import to_wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensors_round_trip_through_ray(ray_instance: None, dtype: torch.dtype) -> None:
    import ray

    g = torch.Generator().manual_seed(0)
    big = torch.randn(600, 768, generator=g)  # 1.8 MB in float32: the object store's
    for x in (big[5:8], big, big.t(), torch.empty(4, 0), torch.tensor(3.5)):
        x = x > 0 if dtype == torch.bool else x.to(dtype)
        y = ray.get(ray.put({"t": x}))["t"]
        assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)
        if y.numel():
            y.view(-1)[0] = y.view(-1)[-1]  # writable


def test_connect_installed_the_transport(ray_instance: None) -> None:
    import ray.cloudpickle

    # Ray's pickler dispatches tensors to `to_wire` in this process (the driver).
    reducer = ray.cloudpickle.CloudPickler.dispatch.get(torch.Tensor)
    assert reducer is not None
    fn, (wire,) = reducer(torch.ones(2, 3))
    assert fn.__name__ == "from_wire" and wire[0].nbytes == 24 and wire[1:] == ("float32", (2, 3))
    assert to_wire(torch.ones(2, 3))[1:] == wire[1:]
