"""Plain conversions between the Python API's types and the `dspark.v1` messages.

Both sides use them: the SDK to encode requests and decode chunks, the server the reverse, so
one file says what each field means on the wire. Only protobuf is imported (no grpc, no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from dspark.protos import dspark_pb2 as pb
from dspark.sampling_params import SamplingParams

Prompt = str | Sequence[int]

FINISH_REASONS: dict[str, int] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}
_OPTIONAL = ("temperature", "top_k", "top_p", "max_tokens", "seed")
_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
_STAT_COUNTS = ("target_passes", "drafted_tokens", "verified_tokens", "accepted_tokens")


@dataclass(frozen=True)
class Chunk:
    """Tokens committed in one step and the text they add; the last chunk also says why it ended.

    Concatenating every chunk's `token_ids` (`text`) gives the request's output ids (text).
    `finish_reason`, `stats` and `prompt_ids` are set on the last chunk only.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    stats: dict[str, object] | None = None  # RequestStats.as_dict() on the last chunk
    prompt_ids: tuple[int, ...] = ()  # the prompt as the server tokenised it, last chunk

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# --- requests ---------------------------------------------------------------------------------
def params_to_proto(params: SamplingParams | Mapping[str, object] | None) -> pb.SamplingParams:
    """Encode SamplingParams; a mapping is sent as given (the server validates it)."""
    if params is None:
        return pb.SamplingParams()
    values = (
        dict(params)
        if isinstance(params, Mapping)
        else {name: getattr(params, name) for name in _PARAM_FIELDS}
    )
    unknown = sorted(set(values) - set(_PARAM_FIELDS))
    if unknown:
        raise ValueError(
            f"SamplingParams has no field {unknown[0]!r}: fields are {list(_PARAM_FIELDS)}"
        )
    msg = pb.SamplingParams()
    for name, value in values.items():
        if value is None:
            continue  # unset optional: the server uses SamplingParams' default
        if name in ("stop_token_ids", "stop"):
            getattr(msg, name).extend(value)  # type: ignore[call-overload]
        else:
            setattr(msg, name, value)
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Decode and validate; raises ValueError naming the bad field (SamplingParams' own check)."""
    kwargs: dict[str, object] = {n: getattr(msg, n) for n in _OPTIONAL if msg.HasField(n)}
    return SamplingParams(
        **kwargs,  # type: ignore[arg-type]
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
    )


def request_to_proto(
    prompt: Prompt, params: SamplingParams | Mapping[str, object] | None
) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(params=params_to_proto(params))
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
    return msg


def request_from_proto(msg: pb.GenerateRequest) -> tuple[str | tuple[int, ...], SamplingParams]:
    """(prompt, params) of a request; raises ValueError when either is malformed."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise ValueError("GenerateRequest.prompt is empty: set text or token_ids")
    prompt = msg.text if kind == "text" else tuple(msg.token_ids.ids)
    return prompt, params_from_proto(msg.params)


# --- parsing on the server -------------------------------------------------------------------
@dataclass(frozen=True)
class MalformedMessage:
    """Bytes that are not a valid message of the expected type; `message` says where they fail.

    The server's request deserializer returns this instead of raising, so the servicer answers
    INVALID_ARGUMENT with the reason (a raising deserializer makes gRPC answer INTERNAL).
    """

    message: str


def lenient_parser(cls: type[Message]) -> Callable[[bytes], Any]:
    """A request deserializer for `cls` that returns a `MalformedMessage` instead of raising.

    Example:
        >>> parse = lenient_parser(pb.GenerateRequest)
        >>> parse(pb.GenerateRequest(text="hi").SerializeToString()).text
        'hi'
        >>> print(parse(bytes([10, 3, 97, 255, 99])).message)  # doctest: +ELLIPSIS
        GenerateRequest.text is not valid UTF-8: 'utf-8' codec can't decode byte 0xff in ...
    """

    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return MalformedMessage(_diagnose(cls.DESCRIPTOR, data, e))

    return parse


def _diagnose(descriptor: Descriptor, data: bytes, error: DecodeError) -> str:
    """Name the string field holding bad UTF-8, or say the bytes are no such message."""
    name = descriptor.name
    try:
        raw = _bytes_twin(descriptor).FromString(data)
    except DecodeError:
        return f"{name}: not a valid {descriptor.full_name} message ({_reason(error)})"
    for path, value in _string_fields(raw, descriptor, name):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"{path} is not valid UTF-8: {e}"
    return f"{name}: not a valid {descriptor.full_name} message ({_reason(error)})"


def _reason(error: DecodeError) -> str:
    return str(error).rsplit(": ", 1)[-1]


@cache
def _bytes_twin(descriptor: Descriptor) -> type[Message]:
    """The message class of `descriptor` with every string field read as bytes (no UTF-8
    check), built in a private descriptor pool: it parses what the real class refuses."""
    proto = descriptor_pb2.FileDescriptorProto()
    descriptor.file.CopyToProto(proto)
    proto.ClearField("service")

    def loosen(messages: Any) -> None:
        for msg in messages:
            for f in msg.field:
                if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            loosen(msg.nested_type)

    loosen(proto.message_type)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(descriptor.full_name))


def _string_fields(raw: Message, descriptor: Descriptor, path: str) -> list[tuple[str, bytes]]:
    """(field path, bytes) of every string field set in `raw` (the bytes twin), nested too."""
    out: list[tuple[str, bytes]] = []
    for f in descriptor.fields:
        value = getattr(raw, f.name)
        here = f"{path}.{f.name}"
        if f.type == FieldDescriptor.TYPE_STRING:
            items = list(value) if f.is_repeated else [value]
            out += [(f"{here}[{i}]" if f.is_repeated else here, v) for i, v in enumerate(items)]
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            items = list(value) if f.is_repeated else [value] if raw.HasField(f.name) else []
            for i, v in enumerate(items):
                out += _string_fields(v, f.message_type, f"{here}[{i}]" if f.is_repeated else here)
    return out


# --- chunks -----------------------------------------------------------------------------------
def stats_to_proto(stats: Mapping[str, object]) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        **{k: int(stats[k]) for k in _STAT_COUNTS},  # type: ignore[call-overload]
        accepted_per_position=list(stats["accepted_per_position"]),  # type: ignore[call-overload]
        verified_per_position=list(stats["verified_per_position"]),  # type: ignore[call-overload]
        mean_accepted_length=float(stats["mean_accepted_length"]),  # type: ignore[arg-type]
    )


def stats_from_proto(msg: pb.SpeculationStats) -> dict[str, object]:
    """The same dict as `RequestStats.as_dict()` (keys and value types)."""
    out: dict[str, object] = {k: getattr(msg, k) for k in _STAT_COUNTS}
    out["accepted_per_position"] = list(msg.accepted_per_position)
    out["verified_per_position"] = list(msg.verified_per_position)
    out["mean_accepted_length"] = msg.mean_accepted_length
    return out


def chunk_to_proto(chunk: Chunk) -> pb.GenerateChunk:
    msg = pb.GenerateChunk(request_id=chunk.request_id, token_ids=chunk.token_ids, text=chunk.text)
    if chunk.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS[chunk.finish_reason]  # type: ignore[assignment]
        msg.prompt_token_ids.extend(chunk.prompt_ids)
        if chunk.stats is not None:
            msg.stats.CopyFrom(stats_to_proto(chunk.stats))
    return msg


def chunk_from_proto(msg: pb.GenerateChunk) -> Chunk:
    finish = _FINISH_NAMES.get(msg.finish_reason)
    return Chunk(
        request_id=msg.request_id,
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        finish_reason=finish,
        stats=stats_from_proto(msg.stats) if msg.HasField("stats") else None,
        prompt_ids=tuple(msg.prompt_token_ids),
    )


def info_from_proto(msg: pb.ModelInfo) -> dict[str, object]:
    """ModelInfo as a plain dict (field name -> value; repeated fields as lists)."""
    return {
        f.name: list(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name)
        for f in msg.DESCRIPTOR.fields
    }
