"""A weight's values a bounded chunk at a time, never the whole tensor in memory.

Sketching and probing a model's weights used to load each tensor whole (and convert it to
float64): a 1 GiB weight cost 3-4 GiB of peak memory on the host, beside onnxruntime's own
copy. `tensor_chunks` yields flat pieces of at most `max_bytes` in the tensor's own dtype:
read into one reused buffer from an external data file (so neither the tensor nor a memory
map of it is ever resident), or as views of the bytes of an embedded tensor.

Tensors that cannot be cut in place (sub-byte packed types, typed `*_data` fields, big-endian
hosts) are not chunkable: callers load those whole (`read_external_tensor`, `numpy_helper`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from onnx import ModelProto, TensorProto, helper

from .index import iter_tensors
from .io import _PACKED
from .proto import external_info, is_external

CHUNK_BYTES = 8 * 2**20  # the buffer a sketch pass holds; its float64 temporaries stay in cache


def numel(t: TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= int(d)
    return n


def nbytes(t: TensorProto) -> int:
    """The tensor's size in bytes as stored (0 for types without a fixed itemsize)."""
    if t.data_type in _PACKED or t.data_type == TensorProto.STRING:
        return 0
    return numel(t) * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def chunkable(t: TensorProto) -> bool:
    """Whether `tensor_chunks` can cut `t` without decoding it whole."""
    if t.data_type in _PACKED or t.data_type == TensorProto.STRING or sys.byteorder != "little":
        return False
    if is_external(t):
        info = external_info(t)
        return int(info.get("length", nbytes(t))) == nbytes(t)
    return len(t.raw_data) == nbytes(t)


def tensor_chunks(
    t: TensorProto, base_dir: str | os.PathLike | None, max_bytes: int = CHUNK_BYTES, align: int = 1
) -> Iterator[np.ndarray]:
    """Flat pieces of `t` in order, each at most `max_bytes` (but at least `align` elements) and a
    multiple of `align` elements (whole rows, say), in its dtype (`chunkable(t)` must hold).

    An external tensor is read from its data file into one buffer reused for every chunk: a
    chunk is only valid until the next one is asked for (copy what must outlive it).
    """
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    count = numel(t)
    align = max(1, align)
    step = max(1, max_bytes // dtype.itemsize // align) * align
    if not is_external(t):
        flat = np.frombuffer(t.raw_data, dtype=dtype, count=count)
        for start in range(0, count, step):
            yield flat[start : start + step]
        return
    if base_dir is None:
        raise ValueError("the tensor is in external data and no base_dir says where")
    info = external_info(t)
    buffer = np.empty(min(step, count), dtype=dtype)
    with open(Path(base_dir) / info["location"], "rb", buffering=0) as f:
        f.seek(int(info.get("offset", 0)))
        for start in range(0, count, step):
            piece = buffer[: min(step, count - start)]
            got = f.readinto(piece.view(np.uint8))  # a byte view: bfloat16 has no buffer format
            if got != piece.nbytes:
                raise ValueError(f"{info['location']} ends inside tensor {t.name!r}")
            yield piece


def weight_bytes(model: ModelProto) -> int:
    """Bytes of every weight of `model` (initializers and Constant values, subgraphs too), stored
    inline or in external data: what a session of it holds."""
    return sum(nbytes(t) for t in iter_tensors(model))
