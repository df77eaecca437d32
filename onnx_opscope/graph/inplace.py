"""A model's inline weights referenced where they lie in its own file, never parsed into Python.

A model with its weights inside the .onnx file (everything under 2 GB, which is what most
exporters write) cost a recording three times its size: protobuf parses every weight into
memory, the instrumented copy holds them, and onnxruntime copies them again. `load_in_place`
reads the file's protobuf wire format itself (a memory map, only the framing is touched), and
returns the model with each big main-graph initializer marked as external data whose location
is the model file itself, at the offset of its `raw_data` bytes. onnxruntime then reads those
bytes from the file like any external weight (memory-mapping them where the offset allows),
and `graph.chunks` streams them for the host sketches: Python never holds them.

Only the framing is trusted: a file that does not parse this way (a truncated or non-ONNX file)
falls back to `load_model`, which gives its one-line error.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from google.protobuf.message import DecodeError
from onnx import GraphProto, ModelProto, TensorProto

from .io import _check_header, check_external_data, load_model

MIN_BYTES = 64 * 1024  # smaller weights stay inline: a few KB of framing each is not worth a reference
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_LEN = 2  # wire type of a length-delimited field


def load_in_place(path: str | os.PathLike, min_bytes: int = MIN_BYTES) -> ModelProto:
    """The model at `path` with its main-graph initializers of `min_bytes` or more referenced in
    place (external data at their offset in `path` itself); the rest parsed as usual."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            model = _model(buf, path.name, min_bytes)
    except (OSError, ValueError, DecodeError):
        return load_model(path)  # its own clear error for a missing, empty, truncated or non-ONNX file
    _check_header(model, path)
    check_external_data(model, path.parent, name=str(path))
    return model


def _fields(buf: mmap.mmap | bytes, start: int, end: int):
    """(field number, wire type, span start, payload start, span end) of each field in buf[start:end]."""
    pos = start
    while pos < end:
        begin = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
            payload = pos
        elif wire == 1:
            payload, pos = pos, pos + 8
        elif wire == _LEN:
            length, payload = _varint(buf, pos)
            pos = payload + length
        elif wire == 5:
            payload, pos = pos, pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > end:
            raise ValueError("field runs past its message")
        yield number, wire, begin, payload, pos


def _varint(buf: mmap.mmap | bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _model(buf: mmap.mmap, location: str, min_bytes: int) -> ModelProto:
    rest, graph_span = bytearray(), None
    for number, wire, begin, payload, end in _fields(buf, 0, len(buf)):
        if number == _MODEL_GRAPH and wire == _LEN:
            graph_span = (payload, end)
        else:
            rest += buf[begin:end]
    model = ModelProto.FromString(bytes(rest))
    if graph_span is None:
        raise ValueError("no graph")
    model.graph.CopyFrom(_graph(buf, *graph_span, location, min_bytes))
    return model


def _graph(buf: mmap.mmap, start: int, end: int, location: str, min_bytes: int) -> GraphProto:
    rest, referenced = bytearray(), []
    for number, wire, begin, payload, stop in _fields(buf, start, end):
        initializer = number == _GRAPH_INITIALIZER and wire == _LEN
        tensor = _referenced(buf, payload, stop, location, min_bytes) if initializer else None
        if tensor is None:
            rest += buf[begin:stop]
        else:
            referenced.append(tensor)
    graph = GraphProto.FromString(bytes(rest))
    graph.initializer.extend(referenced)
    return graph


def _referenced(buf: mmap.mmap, start: int, end: int, location: str, min_bytes: int) -> TensorProto | None:
    """The initializer in buf[start:end] without its raw_data, marked external at the data's offset in
    the file; None when it is small or keeps its values elsewhere."""
    framing, data = bytearray(), None
    for number, wire, begin, payload, stop in _fields(buf, start, end):
        if number == _TENSOR_RAW_DATA and wire == _LEN and stop - payload >= min_bytes and data is None:
            data = (payload, stop - payload)
        else:
            framing += buf[begin:stop]
    if data is None:
        return None
    t = TensorProto.FromString(bytes(framing))
    if t.data_location == TensorProto.EXTERNAL or t.external_data:
        return None
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(data[0])), ("length", str(data[1]))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t
