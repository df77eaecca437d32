"""Sketches of constant tensors (weights), computed once on the host.

`inject` gives a tap on an initializer or a `Constant` node's output no nodes and no graph
outputs: a weight does not change between batches, and folding its tap in the graph cost
onnxruntime ~300 MB at session creation on zoo.bert_like's 24 MatMul weights. `host_values`
reads each such tensor from the model once (external data one tensor at a time, dropped after use), applies each sketch's
numpy reference, and returns what `manifest.decode(..., host=...)` needs:

    tap id -> ({sketch: values}, shape)

The model may be the source model or the instrumented one (it keeps every initializer). A tap
on a tensor made from weights alone (`folded`) is evaluated here, once, from the weights it reads.
Constant taps are found by their graph path (`TapRecord.graph`, the model index's paths) and
tensor name, looking in that graph and then its enclosing ones; the nodes inject adds are all
named, so the paths of the source and of the instrumented model are the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
from onnx import TensorProto, numpy_helper

from .. import sketch as sk
from ..errors import OpscopeError
from ..graph.chunks import chunkable, nbytes, numel, tensor_chunks
from ..graph.index import Constant, ModelIndex
from ..graph.io import ModelLike, model_and_data_dir, read_external_tensor
from ..graph.proto import is_external
from . import folded, weight_cache
from .decode import HostValues
from .manifest import Manifest, TapRecord

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)


def host_values(
    manifest: Manifest, model: ModelLike, base_dir: str | os.PathLike | None = None, *, cache: bool = False
) -> HostValues:
    """tap id -> ({sketch: values}, shape) for every constant tap of `manifest`, from `model`.

    `model`: a path (external data is looked up beside it unless `base_dir` says otherwise)
    or a ModelProto (then `base_dir` is the folder its external data lives in; required only
    when a tapped weight is external). Each weight is loaded on its own and dropped after its
    sketches are taken; shape-only taps read the dims without loading anything. Float weights
    are read a chunk at a time (`graph.chunks`, `sketch.streamed_references`) when their
    sketches allow it, so the peak is a chunk, not the tensor. `cache`: keep and reuse the
    values of big weights between runs (`weight_cache`).
    """
    taps = [t for t in manifest.taps if t.constant]
    if not taps:
        return {}
    proto, base_dir = model_and_data_dir(model, base_dir)
    opts = manifest.sketch_options()
    index = ModelIndex(proto)
    out: HostValues = {}
    for tap in taps:
        nodes = folded.chain(index, tap.graph, tap.tensor)
        if nodes is not None:  # made from weights alone: evaluated once, here
            x = folded.evaluate(nodes, tap.tensor, _leaf_of(index, tap, base_dir), list(proto.opset_import))
            out[tap.id] = (sk.references(tap.sketches, x, tap.info(), opts), [int(d) for d in x.shape])
            continue
        src = _find(index, tap)
        if not tap.sketches and isinstance(src, TensorProto):
            out[tap.id] = ({}, [int(d) for d in src.dims])
            continue
        info = tap.info()
        whole = _streamed_tensor(src, tap, opts)
        if whole is not None:
            out[tap.id] = _streamed(whole, tap, manifest, base_dir, cache)
            continue
        x = _array(src, tap, base_dir)
        if tap.dequant is not None:
            x = _dequantized(index, tap, x, base_dir)
        values = sk.references(tap.sketches, x, info, opts)
        out[tap.id] = (values, [int(d) for d in x.shape])
        del x
    return out


def _streamed_tensor(src: Constant, tap: TapRecord, opts: sk.SketchOptions) -> TensorProto | None:
    """The tensor to sketch a chunk at a time, if the weight is one: a float initializer (or Constant
    value) whose bytes can be cut in place, and sketches that merge over pieces; else None (the
    weight is loaded whole)."""
    t = src if isinstance(src, TensorProto) else next((a.t for a in src.attribute if a.name == "value"), None)
    if t is None or tap.dequant is not None or t.data_type not in _FLOATS:
        return None
    return t if chunkable(t) and sk.streamable(tap.sketches, opts) else None


def _streamed(
    t: TensorProto, tap: TapRecord, manifest: Manifest, base_dir: str | os.PathLike | None, cache: bool
) -> tuple[dict[str, np.ndarray], list[int]]:
    opts = manifest.sketch_options()
    key = None
    if cache and nbytes(t) >= weight_cache.MIN_BYTES:
        config = {"sketches": tap.sketches, "options": asdict(opts), "info": asdict(tap.info())}
        key = weight_cache.weight_key(t, (tap.graph, tap.tensor), config, manifest.source_sha256, base_dir)
        hit = weight_cache.load(key) if key else None
        if hit is not None and set(hit[0]) == set(tap.sketches):
            return hit
    values = sk.streamed_references(tap.sketches, _chunks(t, tap, base_dir), numel(t), tap.info(), opts)
    shape = [int(d) for d in t.dims]
    if key:
        weight_cache.store(key, values, shape)
    return values, shape


def _chunks(t: TensorProto, tap: TapRecord, base_dir: str | os.PathLike | None) -> Iterator[np.ndarray]:
    name = t.name or tap.tensor
    if is_external(t) and base_dir is None:
        raise OpscopeError(
            f"weight {name!r} (tap {tap.id}) is stored in external data, and no base_dir says where",
            hint="pass base_dir= (the folder of the model file the data belongs to)",
        )
    try:
        yield from tensor_chunks(t, base_dir)
    except (OSError, ValueError) as exc:
        raise OpscopeError(f"cannot read weight {name!r} (tap {tap.id}): {exc}") from None


def _find(index: ModelIndex, tap: TapRecord) -> Constant:
    """The constant a weight tap names: by graph path (its graph, then the ones around it), else by
    name alone when exactly one graph defines it (paths that no longer resolve)."""
    if tap.graph in index:
        hit = index.constant(tap.graph, tap.tensor)
        if hit is not None:
            return hit
    hits = index.find_constant(tap.tensor)
    if len(hits) == 1:
        return hits[0]
    where = f"graph {tap.graph!r}" if tap.graph else "the main graph"
    if hits:
        raise OpscopeError(
            f"weight {tap.tensor!r} (tap {tap.id}) is not in {where} or above it, and {len(hits)} "
            "subgraphs define that name: cannot tell which one the manifest means",
            hint="compute host values from the model the manifest was made from (or its instrumented copy)",
        )
    raise OpscopeError(
        f"weight {tap.tensor!r} (tap {tap.id}, {where}) is not an initializer or Constant of this model",
        hint="compute host values from the model the manifest was made from (or its instrumented copy)",
    )


def _leaf_of(
    index: ModelIndex, tap: TapRecord, base_dir: str | os.PathLike | None
) -> Callable[[str], np.ndarray]:
    """The value of a constant that a folded tap's chain reads, looked up from the tap's graph."""
    return lambda name: _array(_find(index, TapRecord(**{**vars(tap), "tensor": name})), tap, base_dir)


def _dequantized(
    index: ModelIndex, tap: TapRecord, q: np.ndarray, base_dir: str | os.PathLike | None
) -> np.ndarray:
    """DequantizeLinear's result on a quantized weight: (q - zero_point) * scale, per tensor, per axis
    or per block along `axis`, in the scale's type (what onnxruntime's kernel reads)."""
    dq = tap.dequant
    scale = _array(_find(index, TapRecord(**{**vars(tap), "tensor": dq["scale"]})), tap, base_dir)
    zp = None
    if dq["zero_point"]:
        zp = _array(_find(index, TapRecord(**{**vars(tap), "tensor": dq["zero_point"]})), tap, base_dir)
    axis = dq["attrs"].get("axis", 1) % max(q.ndim, 1)
    block = dq["attrs"].get("block_size", 0)

    def along_axis(v: np.ndarray) -> np.ndarray:
        if v.ndim == 0 or v.size == 1:
            return v.reshape(())
        if block:
            v = np.repeat(v, block, axis=axis)[tuple(slice(0, n) for n in q.shape)]
            return v
        return v.reshape([-1 if i == axis else 1 for i in range(q.ndim)])

    x = q.astype(np.float32) if zp is None else q.astype(np.float32) - along_axis(zp).astype(np.float32)
    return (x * along_axis(scale).astype(np.float32)).astype(scale.dtype)


# --------------------------------------------------------------------------------------------
# loading one constant


def _array(src: Constant, tap: TapRecord, base_dir: str | os.PathLike | None) -> np.ndarray:
    if isinstance(src, TensorProto):
        return _tensor_array(src, tap, base_dir)
    attr = next((a for a in src.attribute), None)
    if attr is None:
        raise OpscopeError(f"Constant node {src.name!r} (tap {tap.id}) has no value")
    if attr.name == "value":
        return _tensor_array(attr.t, tap, base_dir)
    if attr.name == "value_float":
        return np.array(attr.f, np.float32)
    if attr.name == "value_floats":
        return np.array(attr.floats, np.float32)
    if attr.name == "value_int":
        return np.array(attr.i, np.int64)
    if attr.name == "value_ints":
        return np.array(attr.ints, np.int64)
    if attr.name == "sparse_value":
        sp = attr.sparse_tensor
        values = _tensor_array(sp.values, tap, base_dir).ravel()
        idx = _tensor_array(sp.indices, tap, base_dir).astype(np.int64)
        dense = np.zeros(int(np.prod(sp.dims)), values.dtype)
        flat = idx.ravel() if idx.ndim == 1 else np.ravel_multi_index(tuple(idx.T), tuple(sp.dims))
        dense[flat] = values
        return dense.reshape(tuple(sp.dims))
    raise OpscopeError(f"Constant node {src.name!r} (tap {tap.id}): cannot sketch a {attr.name} value")


def _tensor_array(t: TensorProto, tap: TapRecord, base_dir: str | os.PathLike | None) -> np.ndarray:
    name = t.name or tap.tensor
    try:
        if not is_external(t):
            return numpy_helper.to_array(t)
        if base_dir is None:
            raise OpscopeError(
                f"weight {name!r} (tap {tap.id}) is stored in external data, and no base_dir says where",
                hint="pass base_dir= (the folder of the model file the data belongs to)",
            )
        return read_external_tensor(t, Path(base_dir))
    except (OSError, ValueError, TypeError) as exc:
        raise OpscopeError(f"cannot read weight {name!r} (tap {tap.id}): {exc}") from None
