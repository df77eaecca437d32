"""MatMulNBits weights (com.microsoft weight-only int2 / int4 / int8) as the float [N, K] matrices the node multiplies by.

MatMulNBits computes A @ Wᵀ from B uint8 [N, k_blocks, blob]: codes of `bits` bits packed low bits
first along K, `block_size` codes a block, K padded up to whole blocks. W[n, k] = (code - zero_point)
* scale, with the scale and zero point of k's block (column k's group `g_idx[k]` when that input is
given). Scales are [N * k_blocks] (or [N, k_blocks]) in A's float type; zero points are absent
(2^(bits-1)), uint8 packed like the codes with each row's k_blocks padded to whole bytes, or float
[N * k_blocks] (which lets a GGUF Q4_1 block, d * q + m, be stored exactly: zp = -m / d).

The packed codes mean nothing without their scales, so the weight probes read them here, on the
host, once (a weight is the same every step): the view is the dequantized matrix, rows = N output
channels, cols = K, `shape` (N, K) and `dtype` the scales' (so `dense_bytes` is the float matrix's
size, what the 4-bit storage is compared with). `find_weights_packed` lists them among the float
weights of `weights.matrix.find_weights` (what the probes read); the weight planner keeps to the
float ones (these are quantized already, and a plan's rewrite replaces float weights).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from onnx import NodeProto, TensorProto, numpy_helper

from ..errors import OpscopeError
from ..graph.index import GraphEntry, ModelIndex
from ..graph.io import ModelLike, model_and_data_dir, read_external_tensor
from ..graph.proto import attr, constant_value, input_at, is_external
from .matrix import _DTYPE_NAMES, Use, WeightView, _readers, find_weights

NBITS = ("com.microsoft", "MatMulNBits")
BITS = (2, 4, 8)


def nbits_matrix(
    packed: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None = None,
    g_idx: np.ndarray | None = None,
    *,
    k: int,
    n: int,
    bits: int = 4,
    block_size: int,
) -> np.ndarray:
    """The float32 [N, K] matrix W a MatMulNBits node multiplies by (A @ Wᵀ), from its B, scales, zero points."""
    if bits not in BITS:
        raise OpscopeError(f"MatMulNBits with bits={bits}: expected one of {BITS}")
    blocks = -(-k // block_size)
    per_byte = 8 // bits
    codes = _unpack(np.asarray(packed, np.uint8).reshape(n, -1), bits)[:, : blocks * block_size]
    scale = np.asarray(scales, np.float32).reshape(n, blocks)
    if zero_points is None:
        zp = np.full((n, blocks), 1 << (bits - 1), np.float32)
    elif np.asarray(zero_points).dtype == np.uint8:
        zp = _unpack(np.asarray(zero_points).reshape(n, -(-blocks // per_byte)), bits)[:, :blocks]
    else:
        zp = np.asarray(zero_points, np.float32).reshape(n, blocks)
    group = np.arange(k) // block_size if g_idx is None else np.asarray(g_idx, np.int64).ravel()[:k]
    return np.ascontiguousarray((codes[:, :k].astype(np.float32) - zp[:, group]) * scale[:, group])


def find_weights_packed(
    model: ModelLike, *, base_dir: str | os.PathLike | None = None, min_elements: int = 16
) -> list[tuple[WeightView, Callable[[], np.ndarray]]]:
    """`find_weights`'s float weights and every MatMulNBits' packed B (as its [N, K] matrix), in the
    order the model defines them; nothing read until a loader runs."""
    proto, base_dir = model_and_data_dir(model, base_dir)
    found = find_weights(proto, base_dir=base_dir, min_elements=min_elements)
    floats = {(view.graph, view.name): (view, load) for view, load in found}
    index = ModelIndex(proto)
    readers = _readers(index)
    out = []
    for entry in index.graphs.values():
        for name in entry.constants:
            hit = floats.get((entry.path, name)) or packed_weight(index, entry, name, readers, base_dir)
            if hit is not None:
                out.append(hit)
    return out


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """[rows, bytes] uint8 -> [rows, bytes * 8 / bits] codes, low bits of each byte first."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def packed_weight(
    index: ModelIndex,
    entry: GraphEntry,
    name: str,
    readers: dict[tuple[str, str], list[Use]],
    base_dir: str | os.PathLike | None,
) -> tuple[WeightView, Callable[[], np.ndarray]] | None:
    """(view, loader of the float32 [N, K] matrix) of constant `name` of graph `entry` when a MatMulNBits
    reads it as B, else None. `readers`: `weights.matrix`'s (graph path, constant) -> uses."""
    uses = readers.get((entry.path, name), [])
    nbits = ((e, pos, node) for e, pos, node, i in uses if i == 1 and (node.domain, node.op_type) == NBITS)
    reader = next(nbits, None)
    if reader is None:
        return None
    at, pos, node = reader
    k, n, bits, block = (attr(node, a, d) for a, d in (("K", 0), ("N", 0), ("bits", 4), ("block_size", 0)))
    scale = _constant(index, at, input_at(node, 2) or "")
    if not (k > 0 and n > 0 and block > 0) or bits not in BITS or scale is None:
        return None  # not a weight we can read: left out like any non-float constant
    dtype = _DTYPE_NAMES.get(scale.data_type, "float32")
    view = WeightView(name, entry.path, node.op_type, at.ids[pos], (n, k), dtype, 0, n, k)

    def load() -> np.ndarray:
        inputs = [_constant(index, at, input_at(node, i) or "") for i in (1, 3, 4)]
        zp, g_idx = (None if t is None else _array(t, name, base_dir) for t in inputs[1:])
        b = _array(inputs[0], name, base_dir)
        return nbits_matrix(
            b, _array(scale, name, base_dir), zp, g_idx, k=k, n=n, bits=bits, block_size=block
        )

    return view, load


def _constant(index: ModelIndex, entry: GraphEntry, name: str) -> TensorProto | None:
    """The tensor of constant `name` as seen from graph `entry` (its own, then the graphs around it)."""
    if not name:
        return None
    src = index.constant(entry.path, name)
    if src is None or isinstance(src, TensorProto):
        return src
    return constant_value(src) if isinstance(src, NodeProto) else None


def _array(t: TensorProto, weight: str, base_dir: str | os.PathLike | None) -> np.ndarray:
    try:
        if not is_external(t):
            return numpy_helper.to_array(t)
        if base_dir is None:
            raise OpscopeError(
                f"MatMulNBits weight {weight!r} is stored in external data, and no base_dir says where",
                hint="pass base_dir= (the folder of the model file the data belongs to)",
            )
        return read_external_tensor(t, base_dir)
    except (OSError, ValueError) as exc:
        raise OpscopeError(f"cannot read MatMulNBits weight {weight!r}: {exc}") from None
