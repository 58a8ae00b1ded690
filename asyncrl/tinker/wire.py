"""What crosses the wire between Tinker's SDK and this server, as the SDK's own source spells it
(``tinker`` 0.38: ``resources/*.py`` the routes, ``proto/request_conv.py`` and
``proto/response_conv.py`` the binary bodies, ``lib/api_future_impl.py`` the futures).

Pure builders and parsers, testable without a server:

- ``forward_backward`` arrives as the SDK's protobuf (``application/x-protobuf``, zstd when
  the client config says so, which this server never does): :func:`decode_forward_backward`;
- a ``ForwardBackwardOutput`` and a ``SampleResponse`` must go back as protobuf too (the SDK
  refuses them as JSON): :func:`forward_backward_proto`, :func:`sample_proto`;
- every other body is JSON, read into the SDK's own pydantic request types (so a field the
  SDK does not send is refused as the hosted service would), and written from its response
  types.

The message types come from the SDK (``tinker.proto.tinker_public_pb2``): the server speaks
the version of the wire its installed SDK speaks, never a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTO = "application/x-protobuf"

_NUMPY = {pb.DTYPE_FLOAT32: np.dtype(np.float32), pb.DTYPE_INT64: np.dtype(np.int64),
          pb.DTYPE_INT32: np.dtype(np.int32)}


class WireError(ValueError):
    """A request body this server cannot read (the client's mistake: a 400)."""


@dataclass(frozen=True)
class WireDatum:
    """One datum of a ``forward_backward``: its input tokens and each loss input as a dense
    array (a sparse CSR tensor densified, its implicit entries 0)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


def _tensor(msg: pb.Tensor, name: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: dtype {msg.dtype} is not float32 or int64")
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, cols] = values
        return dense
    flat = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != flat.size:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold its {flat.size} values")
    return flat.reshape(shape) if shape else flat


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """The SDK's ``ForwardBackwardRequest`` protobuf, read."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"the forward_backward body is not the SDK's protobuf: {exc}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # preferred where set (it carries strings too)
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"data[{i}].model_input: only token chunks are served (this server runs text "
                                f"models), got a {chunk.WhichOneof('chunk')} chunk")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor(t, f"data[{i}].{name}") for name, t in datum.loss_fn_inputs.items()}
        data.append(WireDatum(tokens, inputs))
    return ForwardBackwardCall(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def forward_backward_proto(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ``ArrayRecord`` whose fields batch each datum's 1-D
    float32 arrays (``logprobs`` …) end to end, with byte offsets per datum."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(out[name], dtype=np.float32).ravel() for out in outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


@dataclass(frozen=True)
class SampledRow:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # a stop sequence (or EOS) ended it; else its length did


def sample_proto(rows: list[SampledRow], prompt_logprobs: list[float] | None) -> bytes:
    """A ``SampleResponse``: each sequence's int32 tokens and float32 logprobs; the prompt's
    logprobs (NaN at position 0, which nothing precedes) when asked."""
    msg = pb.SampleResponse()
    for row in rows:
        msg.sequences.add(stop_reason=pb.STOP_REASON_STOP if row.stopped else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(row.tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(row.logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def stop_tokens(stop: object, encode: object, eos: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``SamplingParams.stop`` as (token ids that end a sequence, strings that do): ``None``
    is EOS, ``[]`` nothing; a string that is one token stops on that token (the engine stops on
    it between two steps), a longer one is matched in the decoded text afterwards."""
    if stop is None:
        return eos, ()
    items = [stop] if isinstance(stop, str) else list(stop)  # type: ignore[call-overload]
    ids = tuple(i for i in items if isinstance(i, int))
    texts = [s for s in items if isinstance(s, str)]
    single = []
    longer = []
    for text in texts:
        encoded = encode(text)  # type: ignore[operator]
        (single if len(encoded) == 1 else longer).append((text, encoded))
    return ids + tuple(e[0] for _, e in single), tuple(t for t, _ in longer)
