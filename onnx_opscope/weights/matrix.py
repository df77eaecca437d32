"""Every float weight of a model as a [rows, cols] matrix, rows = the consuming op's output channels.

Compression choices are per output channel (a scale per row, a row kept or pruned, a rank over
the row space), so each weight is viewed along the axis its consumer produces channels on:

- MatMul B [..., K, N]: the last axis (rows = N, cols = K x batch dims); MatMul A [..., M, K]:
  axis -2 (a weight on the left, `W @ x`);
- Gemm B: transB=1 -> [N, K] axis 0, transB=0 -> [K, N] axis 1; Gemm A likewise with transA;
- Conv W [M, C/g, kh, kw]: axis 0; ConvTranspose W [C, M/g, kh, kw]: axis 1;
- Gather data (an embedding [vocab, dim]): axis 0;
- LSTM / GRU / RNN W and R [dirs, gates*H, in]: rows = dirs*gates*H, cols = in;
- anything else (biases, norms, weights read by elementwise ops): axis 0, `op` and `node` "".

A weight is found once however many nodes read it: the first consumer that gives a channel axis
(graph order, subgraph bodies after their owner's graph) decides the view. Weights come from
initializers and `Constant` nodes of every graph, If / Loop / Scan bodies included.

Skipped, on purpose: non-float weights (int8 / int4 QDQ weights are quantized already, integer
constants are shapes and indices), float tensors read only as a scale or zero point (of
QuantizeLinear, DequantizeLinear, MatMulNBits, QLinearMatMul, QLinearConv: not weights), sparse
initializers and sparse `Constant` values (the model index does not list them), and weights under
`min_elements`.

float16, bfloat16 and float64 weights are read as float32: the probes' errors are relative, and
float32 holds every float16 / bfloat16 value exactly. External data is read one tensor at a time
when its matrix is asked for, straight from its bytes in the data file (never through onnx's
loader, which would read every weight of the model), so memory stays bounded by the largest
tensor. External locations that leave the model's folder are refused (`graph.io`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from onnx import AttributeProto, NodeProto, TensorProto, numpy_helper

from ..errors import OpscopeError
from ..graph.chunks import chunkable, tensor_chunks
from ..graph.index import Constant, GraphEntry, ModelIndex
from ..graph.io import ModelLike, model_and_data_dir, read_external_tensor
from ..graph.proto import attr, constant_value, is_external

_DTYPE_NAMES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16",
                TensorProto.DOUBLE: "float64", TensorProto.BFLOAT16: "bfloat16"}  # fmt: skip
_QUANT_PARAMS = {
    "QuantizeLinear": 1,
    "DequantizeLinear": 1,
    "MatMulNBits": 2,
    "QLinearMatMul": 0,
    "QLinearConv": 0,
}
"""op -> its first input that is a quantization parameter (scale, zero point): a float tensor read
only there is not a weight."""
_RECURRENT = ("LSTM", "GRU", "RNN")


@dataclass(frozen=True)
class WeightView:
    """Where a weight lives and how it is viewed as a matrix (see the module doc for the axes)."""

    name: str  # initializer or Constant-output name
    graph: str  # ModelIndex path of the graph holding it ("" = main graph)
    op: str  # op type of the first consumer that gives it a channel axis ("" if none)
    node: str  # that consumer's full node id (graph.index: its name when named and unique), "" if none
    shape: tuple[int, ...]  # the stored tensor's shape
    dtype: str  # dtype name as stored ("float32", "float16", "bfloat16", "float64")
    out_axis: int  # output-channel axis in `shape`
    rows: int  # output channels
    cols: int  # elements per output channel (the reduction / input axis, flattened)

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def itemsize(self) -> int:
        """Bytes of one element as stored."""
        return 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize

    @property
    def dense_bytes(self) -> int:
        """Bytes of the weight as stored (rows * cols * itemsize of `dtype`)."""
        return self.size * self.itemsize


def as_matrix(view: WeightView, array: np.ndarray) -> np.ndarray:
    """`array` (of `view.shape`) as a contiguous float32 [rows, cols]: out axis first, the rest flattened."""
    a = np.asarray(array, dtype=np.float32)
    if a.ndim:
        a = np.moveaxis(a, view.out_axis, 0)
    return np.ascontiguousarray(a.reshape(view.rows, view.cols))


def from_matrix(view: WeightView, matrix: np.ndarray) -> np.ndarray:
    """The inverse of `as_matrix`: a float32 array of `view.shape`."""
    m = np.asarray(matrix, dtype=np.float32)
    if not view.shape:
        return m.reshape(())
    moved = (view.shape[view.out_axis], *(d for i, d in enumerate(view.shape) if i != view.out_axis))
    return np.ascontiguousarray(np.moveaxis(m.reshape(moved), 0, view.out_axis))


def find_weights(
    model: ModelLike, *, base_dir: str | os.PathLike | None = None, min_elements: int = 16
) -> list[tuple[WeightView, Callable[[], np.ndarray]]]:
    """Each float weight's view and a loader that reads its float32 [rows, cols] matrix when called.

    Nothing is read here but the protobuf: the weights' data stay where they are until a loader
    runs. `model`: a path (its external data is looked up beside it unless `base_dir` says
    otherwise) or a ModelProto (`base_dir`: the folder of its external data, needed only if it has
    some). Raises OpscopeError for external locations that leave `base_dir`.
    """
    proto, base_dir = model_and_data_dir(model, base_dir)
    index = ModelIndex(proto)
    readers = _readers(index)
    found = []
    for entry in index.graphs.values():
        for name, src in entry.constants.items():
            tensor = src if isinstance(src, TensorProto) else constant_value(src)
            dtype, shape = _float_type(src, tensor)
            if dtype is None or int(np.prod(shape)) < max(min_elements, 1):
                continue
            uses = readers.get((entry.path, name), [])
            if uses and all(i >= _QUANT_PARAMS.get(node.op_type, i + 1) for _, _, node, i in uses):
                continue  # a scale or zero point
            view = _view(name, entry.path, shape, dtype, uses)
            found.append((view, _loader(view, src, tensor, base_dir)))
    return found


def iter_weights(
    model: ModelLike, *, base_dir: str | os.PathLike | None = None, min_elements: int = 16
) -> Iterator[tuple[WeightView, np.ndarray]]:
    """(view, float32 [rows, cols] matrix) of every float weight with `min_elements` or more elements.

    One tensor is read at a time, when it is yielded; drop the matrix before asking for the next
    to keep memory bounded by the largest tensor. See `find_weights` for `model` and `base_dir`.
    """
    for view, load in find_weights(model, base_dir=base_dir, min_elements=min_elements):
        yield view, load()


# --------------------------------------------------------------------------------------------
# who reads each constant, and the view it gives


Use = tuple[GraphEntry, int, NodeProto, int]  # (graph, node position, node, input index)


def _readers(index: ModelIndex) -> dict[tuple[str, str], list[Use]]:
    """(defining graph path, constant name) -> its uses in graph order, subgraph bodies included.

    A name read in a body resolves to the innermost graph around it that defines it, so a body
    input or node output that shadows an outer weight is not taken for the weight.
    """
    uses: dict[tuple[str, str], list[Use]] = {}
    for entry in index.graphs.values():
        for pos, node in enumerate(entry.graph.node):
            for i, name in enumerate(node.input):
                if not name:
                    continue
                owner = next((e for e in index.scopes(entry.path) if e.defines(name)), None)
                if owner is not None and name in owner.constants:
                    uses.setdefault((owner.path, name), []).append((entry, pos, node, i))
    return uses


def _view(name: str, path: str, shape: tuple[int, ...], dtype: str, uses: list[Use]) -> WeightView:
    size = int(np.prod(shape))
    for entry, pos, node, i in uses:
        axis = _out_axis(node, i, len(shape))
        if axis is None:
            continue
        rows = shape[0] * shape[1] if node.op_type in _RECURRENT else shape[axis]
        cols = size // rows if rows else 0
        return WeightView(name, path, node.op_type, entry.ids[pos], shape, dtype, axis, rows, cols)
    rows = shape[0] if shape else 1
    return WeightView(name, path, "", "", shape, dtype, 0, rows, size // rows if rows else 0)


def _out_axis(node: NodeProto, i: int, ndim: int) -> int | None:
    """The output-channel axis of input `i` of `node` (a tensor of rank `ndim`), None when it gives none."""
    op = node.op_type
    if op == "MatMul" and ndim >= 2 and i in (0, 1):
        return ndim - 2 if i == 0 else ndim - 1
    if op == "Gemm" and ndim == 2 and i in (0, 1):
        trans = attr(node, "transA" if i == 0 else "transB", 0)
        return (1 if trans else 0) if i == 0 else (0 if trans else 1)
    if op in ("Conv", "ConvTranspose") and i == 1 and ndim >= 2:
        return 0 if op == "Conv" else 1
    if op == "Gather" and i == 0 and ndim >= 1:
        return 0
    if op in _RECURRENT and i in (1, 2) and ndim == 3:
        return 1
    return None


# --------------------------------------------------------------------------------------------
# reading one weight


def _float_type(src: Constant, tensor: TensorProto | None) -> tuple[str | None, tuple[int, ...]]:
    """(stored dtype name, shape) of a float constant, (None, ()) for anything else."""
    if tensor is not None:
        name = _DTYPE_NAMES.get(tensor.data_type)
        return name, tuple(int(d) for d in tensor.dims)
    floats = next((a for a in src.attribute if a.name == "value_floats"), None)
    if floats is not None and floats.type == AttributeProto.FLOATS:
        return "float32", (len(floats.floats),)
    return None, ()  # value_float (one number), ints, strings, sparse_value


def _streamed_matrix(view: WeightView, t: TensorProto, base_dir: str | os.PathLike) -> np.ndarray:
    """`as_matrix` of an external weight, read a slab of leading-axis rows at a time straight into the
    float32 [rows, cols] matrix: the peak is the matrix, where reading the tensor and moving its
    output axis first held it twice (a float16 weight three times)."""
    shape = tuple(int(d) for d in t.dims)
    out = np.empty((view.rows, view.cols), np.float32)
    if len(shape) < 2:
        out.reshape(-1)[:] = np.concatenate([c.astype(np.float32) for c in tensor_chunks(t, base_dir)])
        return out
    row = math.prod(shape[1:])
    inner = row // shape[view.out_axis] if view.out_axis else row  # matrix columns per leading-axis row
    start = 0
    for chunk in tensor_chunks(t, base_dir, align=row):
        slab = chunk.reshape(-1, *shape[1:])
        n = slab.shape[0]
        if view.out_axis == 0:
            out[start : start + n] = slab.reshape(n, -1)
        else:
            out[:, start * inner : (start + n) * inner] = np.moveaxis(slab, view.out_axis, 0).reshape(
                view.rows, -1
            )
        start += n
    return out


def _loader(
    view: WeightView, src: Constant, tensor: TensorProto | None, base_dir: str | os.PathLike | None
) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        if tensor is None:
            array = np.array(next(a for a in src.attribute if a.name == "value_floats").floats, np.float32)
        elif is_external(tensor) and base_dir is not None and chunkable(tensor):
            try:
                return _streamed_matrix(view, tensor, base_dir)
            except (OSError, ValueError) as exc:
                raise OpscopeError(f"cannot read weight {view.name!r}: {exc}") from None
        else:
            array = _tensor_array(view, tensor, base_dir)
        return as_matrix(view, array)

    return load


def _tensor_array(view: WeightView, t: TensorProto, base_dir: str | os.PathLike | None) -> np.ndarray:
    try:
        if not is_external(t):
            return numpy_helper.to_array(t).astype(np.float32, copy=False)
        if base_dir is None:
            raise OpscopeError(
                f"weight {view.name!r} is stored in external data, and no base_dir says where",
                hint="pass base_dir= (the folder of the model file the data belongs to)",
            )
        return read_external_tensor(t, base_dir).astype(np.float32, copy=False)
    except (OSError, ValueError) as exc:
        raise OpscopeError(f"cannot read weight {view.name!r}: {exc}") from None
