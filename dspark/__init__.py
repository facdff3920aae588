"""dspark-serve: lossless speculative decoding with confidence-scheduled verification.

Example:
    >>> from dspark import Engine, SamplingParams
    >>> engine = Engine()  # the shipped demo target and draft model
    >>> out = engine.generate("import os\\n", SamplingParams(temperature=0, max_tokens=16))
    >>> out[0].finish_reason
    'length'
"""

from dspark.sampling_params import SamplingParams

__all__ = ["AsyncClient", "Chunk", "Client", "Engine", "GenerationResult", "SamplingParams"]


def __getattr__(name: str) -> object:
    # Lazy: `import dspark` stays light (no torch model code) for the SDK and CLI help.
    if name == "Engine":
        from dspark.coordinator.engine import Engine

        return Engine
    if name == "GenerationResult":
        from dspark.coordinator.request import GenerationResult

        return GenerationResult
    if name in ("Client", "AsyncClient", "Chunk"):
        # The gRPC SDK: grpc and the generated stubs load only when asked for.
        from dspark import client

        return getattr(client, name)
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
