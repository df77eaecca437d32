"""Feeds for any model signature: seeded synthetic distributions, or real data from files.

Synthetic feeds follow the model's declared inputs. Symbolic and unknown dims are set by
the user (`shapes`, `dims`) or by one documented default; integer inputs get a range that
keeps them valid indices for the axis they index (its size read from a constant, an input's
resolved shape, or shape inference with those shapes); one batch may take at most a
quarter of the process's memory (`feed_budget`), checked before anything is allocated;
each float distribution is built so that one sketch lights up on it (sparse90 ->
sparsity, outlier -> outlier channels, coherent -> adjacent-row deltas, ...). A step's arrays depend only on (seed, step, input name), so any batch of a
run can be rebuilt on its own. Real data comes from `.npz` / `.npy` files or
onnxruntime's `test_data_set_*/input_*.pb` folders. Every user mistake is one
`OpscopeError` line that names the input, what was given and what the model expects.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, numpy_helper

from ..errors import OpscopeError, did_you_mean, listing
from ..graph.index import ModelIndex
from ..graph.io import ModelLike, load_model
from ..graph.proto import attr as _attr
from ..graph.proto import constant_value, is_external
from ..shapes import infer_shapes

Dim = int | str | None
Shape = tuple[int, ...]
Scalar = int | float | bool
Value = Scalar | list[Scalar] | np.ndarray
Distribution = Callable[[np.random.Generator, Shape], np.ndarray]

DEFAULT_BATCH = 1  # an unknown axis 0 (the batch axis, in practice)
DEFAULT_DIM = 64  # any other unknown dim
DEFAULT_INT_RANGE = (0, 16)  # integer inputs whose valid range the graph does not tell
DEFAULT_BATCHES = 4  # synthetic batches when none is asked for

_NP_TYPES: dict[int, np.dtype] = {
    TensorProto.FLOAT: np.dtype(np.float32),
    TensorProto.DOUBLE: np.dtype(np.float64),
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.INT8: np.dtype(np.int8),
    TensorProto.INT16: np.dtype(np.int16),
    TensorProto.INT32: np.dtype(np.int32),
    TensorProto.INT64: np.dtype(np.int64),
    TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.UINT32: np.dtype(np.uint32),
    TensorProto.UINT64: np.dtype(np.uint64),
    TensorProto.BOOL: np.dtype(np.bool_),
}


# ---------------------------------------------------------------------------------------------
# Signature


@dataclass(frozen=True)
class InputSpec:
    """One model input. `dims`: int (static), str (a symbol shared across inputs), None (unknown);
    `dims` is None when the model declares no shape at all. `dtype` is None for types numpy or
    onnxruntime's Python API cannot hold (bfloat16, float8, strings, sequences); `type_name`
    always says what the model declares."""

    name: str
    dtype: np.dtype | None
    dims: list[Dim] | None
    type_name: str = ""

    @property
    def rank(self) -> int | None:
        return None if self.dims is None else len(self.dims)

    def shape_str(self) -> str:
        if self.dims is None:
            return "[?...]"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"

    def describe(self) -> str:
        return f"{self.name} {self.type_name}{self.shape_str()}"


def input_signature(model: ModelLike) -> list[InputSpec]:
    """The inputs a caller must feed, in graph order (initializers listed as inputs are left out).

    A declared dim of 0 or less, or the symbol '?', counts as unknown: exporters write those
    for "anything" (silero_vad declares 0, Paddle writes '?').
    """
    model = load_model(model)
    inits = {t.name for t in model.graph.initializer} | {
        t.values.name for t in model.graph.sparse_initializer
    }
    return [_spec_of(vi) for vi in model.graph.input if vi.name not in inits]


def _spec_of(vi: onnx.ValueInfoProto) -> InputSpec:
    kind = vi.type.WhichOneof("value")
    if kind != "tensor_type":
        return InputSpec(vi.name, None, None, (kind or "unknown").removesuffix("_type"))
    tt = vi.type.tensor_type
    type_name = TensorProto.DataType.Name(tt.elem_type).lower() if tt.elem_type else "undefined"
    type_name = {"float": "float32", "double": "float64"}.get(type_name, type_name)
    dims: list[Dim] | None = None
    if tt.HasField("shape"):
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param not in ("", "?"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
    return InputSpec(vi.name, _NP_TYPES.get(tt.elem_type), dims, type_name)


# ---------------------------------------------------------------------------------------------
# Distributions (float inputs). Arrays of rank < 2 count as one row for the row-wise ones.


def _rows(shape: Shape) -> tuple[Shape, int, int]:
    """(leading dims, rows, columns) with rows along axis -2; rank 0/1 become one row."""
    if len(shape) >= 2:
        return tuple(shape[:-2]), shape[-2], shape[-1]
    return (), 1, (shape[0] if shape else 1)


def gaussian(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """N(0, 1): the neutral baseline every other distribution is compared against."""
    return rng.standard_normal(shape, dtype=np.float32)


def uniform(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """U(-1, 1): bounded, flat histogram; the range sketches see exactly [-1, 1)."""
    return (rng.random(shape, dtype=np.float32) * 2 - 1).astype(np.float32)


def sparse90(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """N(0, 1) with 90% of values set to exact zeros (density 0.1): lights up sparsity."""
    x = gaussian(rng, shape)
    x[rng.random(shape) >= 0.1] = 0.0
    return x


def lowrank(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """A rank-4 product A @ B over the last two axes, scaled by 1/sqrt(4) so values stay ~N(0, 1)."""
    lead, m, n = _rows(shape)
    a = rng.standard_normal((*lead, m, 4), dtype=np.float32)
    b = rng.standard_normal((*lead, 4, n), dtype=np.float32)
    return (a @ b / np.float32(2.0)).astype(np.float32).reshape(shape)


def outlier_channels(n: int) -> np.ndarray:
    """The last-axis channels `outlier` scales: 1% of `n` (at least one), sorted.

    Picked by a fixed generator seeded with `n`, so every seed and step marks the same
    channels, as real activation outliers stay in the same channels from batch to batch.
    """
    k = max(1, round(n / 100))
    return np.sort(np.random.default_rng([0x0A71E5, n]).choice(n, size=k, replace=False))


def outlier(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """N(0, 1) with the channels `outlier_channels(shape[-1])` of the last axis scaled by 30.

    About 1% of the values are outliers and they sit in a few channels, so a per-channel
    max|x| shows a handful of channels 30x above the rest.
    """
    x = gaussian(rng, shape)
    if x.ndim:
        x[..., outlier_channels(shape[-1])] *= 30.0
    return x


def quantized(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """round(2x)/2 of N(0, 1), saturated at +-4: 17 levels, as a low-bit quantizer's output has."""
    return np.clip(np.round(2 * gaussian(rng, shape)) / 2, -4, 4).astype(np.float32)


def coherent(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """Rows along axis -2 form a random walk (first row N(0, 1), steps 0.15 N(0, 1)).

    Adjacent rows are close, as consecutive frames, tokens or image rows are, which is
    what delta-compute exploits.
    """
    lead, m, n = _rows(shape)
    steps = rng.standard_normal((*lead, m, n), dtype=np.float32)
    steps[..., 1:, :] *= np.float32(0.15)
    return np.cumsum(steps, axis=-2, dtype=np.float32).reshape(shape)


DISTRIBUTIONS: dict[str, Distribution] = {
    "gaussian": gaussian,
    "uniform": uniform,
    "sparse90": sparse90,
    "lowrank": lowrank,
    "outlier": outlier,
    "quantized": quantized,
    "coherent": coherent,
}


# ---------------------------------------------------------------------------------------------
# Feed spec


@dataclass
class FeedSpec:
    """What to feed: a distribution and seed for synthetic data, or a `data` path, plus overrides.

    `shapes`: input name -> full shape; `dims`: symbol -> size (one value for every input
    that uses the symbol); `ranges`: int input -> (lo, hi) with hi excluded; `values`: input
    -> fixed value (a scalar, filling the input's shape, or a 1-D list), which wins over
    everything else, also over `data`. `batches`: how many batches (None: DEFAULT_BATCHES
    synthetic, or every batch of `data`).
    """

    dist: str = "gaussian"
    seed: int = 0
    shapes: dict[str, list[int]] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    values: dict[str, Value] = field(default_factory=dict)
    data: str | os.PathLike | None = None
    batches: int | None = None

    def __post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise OpscopeError(
                f"unknown distribution {self.dist!r}{did_you_mean(self.dist, DISTRIBUTIONS)}; "
                f"choose one of: {', '.join(DISTRIBUTIONS)}"
            )
        if not isinstance(self.seed, int | np.integer) or self.seed < 0:
            raise OpscopeError(f"seed {self.seed!r}: expected a non-negative integer")
        if self.batches is not None and self.batches < 1:
            raise OpscopeError(f"batches {self.batches}: expected at least 1")
        for name, dims in self.shapes.items():
            if any(not isinstance(d, int | np.integer) or d < 1 for d in dims):
                raise OpscopeError(f"shape of {name!r} {list(dims)}: dims must be positive integers")
        for sym, size in self.dims.items():
            if not isinstance(size, int | np.integer) or size < 1:
                raise OpscopeError(f"dim {sym}={size!r}: expected a positive integer")
        for name, (lo, hi) in self.ranges.items():
            if hi <= lo:
                raise OpscopeError(f"range of {name!r} [{lo}, {hi}): expected lo < hi (hi is excluded)")


# ---------------------------------------------------------------------------------------------
# Shapes and ranges


def resolve_shapes(
    model: ModelLike | Sequence[InputSpec],
    shapes: Mapping[str, Sequence[int]] | None = None,
    dims: Mapping[str, int] | None = None,
) -> dict[str, list[int]]:
    """Concrete shapes for every input.

    An input named in `shapes` takes that shape (its rank and static dims must match the
    model), and lends its sizes to the symbols it declares. A symbol takes its `dims` value,
    else the size an explicit shape gave it, else 1 when it is axis 0 of some input and 64
    otherwise. An unknown dim is 1 on axis 0 and 64 elsewhere.
    """
    signature = _signature(model)
    shapes, dims = dict(shapes or {}), dict(dims or {})
    names = [s.name for s in signature]
    _check_known(shapes, names, "--shape")
    symbols = {d for s in signature for d in (s.dims or []) if isinstance(d, str)}
    for sym in dims:
        if sym not in symbols:
            known = (
                f"the model's symbolic dims are: {listing(symbols)}"
                if symbols
                else ("the model's inputs have no symbolic dims (use --shape NAME:D0,D1,...)")
            )
            raise OpscopeError(
                f"--dim {sym}={dims[sym]}: no input has a dim named {sym!r}"
                f"{did_you_mean(sym, symbols)}; {known}"
            )
    bound = dict(dims)
    for spec in signature:
        if spec.name in shapes:
            given = [int(d) for d in shapes[spec.name]]
            _check_shape(spec, given, "--shape")
            for d, g in zip(spec.dims or [], given, strict=False):
                if isinstance(d, str):
                    bound.setdefault(d, g)
    at_axis0 = {s.dims[0] for s in signature if s.dims and isinstance(s.dims[0], str)}
    out: dict[str, list[int]] = {}
    for spec in signature:
        if spec.name in shapes:
            out[spec.name] = [int(d) for d in shapes[spec.name]]
            continue
        if spec.dims is None:
            raise OpscopeError(
                f"input {spec.name!r} declares no shape: give one with --shape {spec.name}:D0,D1,..."
            )
        resolved = []
        for axis, d in enumerate(spec.dims):
            if isinstance(d, int):
                resolved.append(d)
            elif isinstance(d, str):
                resolved.append(bound.get(d, DEFAULT_BATCH if d in at_axis0 else DEFAULT_DIM))
            else:
                resolved.append(DEFAULT_BATCH if axis == 0 else DEFAULT_DIM)
        out[spec.name] = resolved
    return out


_PASS_THROUGH = {
    "Reshape",
    "Expand",
    "Unsqueeze",
    "Squeeze",
    "Flatten",
    "Identity",
    "Cast",
    "Transpose",
    "Tile",
}
# Ops whose output holds only values of the listed inputs (None: any input), so an index keeps its
# range through them: the rows of an edge list picked by Slice / Split / Gather, two lists concatenated.
_VALUE_SUBSET: dict[str, tuple[int, ...] | None] = {
    "Slice": (0,),
    "Split": (0,),
    "Gather": (0,),
    "GatherElements": (0,),
    "GatherND": (0,),
    "Compress": (0,),
    "Concat": None,
    "Where": (1, 2),
}
# Ops that index input 0 (data) with input 1 (indices): the indices must lie in [-d, d) of the axis
# they index; synthetic feeds draw [0, d).
_INDEXING = {"Gather", "GatherElements", "ScatterElements", "Scatter", "GatherND", "ScatterND"}

ShapeOf = Callable[[str], "list[int | None] | None"]


def default_ranges(
    model: ModelLike, shapes: Mapping[str, Sequence[int]] | None = None
) -> dict[str, tuple[int, int]]:
    """The default [lo, hi) of every integer input, read from how the graph uses it.

    The input is followed through shape-only ops (Reshape, Expand, Unsqueeze, Squeeze,
    Flatten, Identity, Cast, Transpose, Tile) and ops that pass on a subset of its values
    (Slice, Split, Concat, Compress, Where, and Gather / GatherElements / GatherND of it) to
    the ops that index with it: Gather, GatherElements, ScatterElements -> [0, d) for the
    size d of the data axis they index (`axis`, negative counted from the end); GatherND,
    ScatterND -> [0, smallest d) over the data axes the last index dim addresses; OneHot with a
    constant depth -> [0, depth); Equal against a constant 0..n-1 (a one-hot written as a
    comparison, as jax2tf exports it) -> [0, n); com.microsoft EmbedLayerNormalization ->
    [0, rows) of its table. Several uses take the tightest bound. An input named like a mask
    gets [0, 2); anything else [0, 16).

    The data's size comes from a constant's dims, an input's shape in `shapes` (the concrete
    input shapes the feeds will have; default: `resolve_shapes` of the model), or, for an
    intermediate tensor (a message buffer built by ConstantOfShape(Shape(x)), say), shape
    inference with those input shapes, run only when such a use is found. A symbolic dim (the
    node count N of a graph network) is therefore bounded by the size the feeds give it.
    """
    model = load_model(model)
    consts: dict[str, TensorProto] = {}
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    index = ModelIndex(model)
    for entry in index.graphs.values():
        consts.update((t.name, t) for t in entry.graph.initializer)
    for _, _, node in index.nodes():
        if node.op_type == "Constant" and node.output and (value := constant_value(node)) is not None:
            consts[node.output[0]] = value
        for i, name in enumerate(node.input):
            if name:
                uses.setdefault(name, []).append((node, i))
    signature = input_signature(model)
    if shapes is None:
        with contextlib.suppress(OpscopeError):
            shapes = resolve_shapes([s for s in signature if s.dims is not None])
    shape_of = _shape_lookup(model, consts, dict(shapes or {}))
    out = {}
    for spec in signature:
        if spec.dtype is None or spec.dtype.kind not in "iu":
            continue
        bounds = _index_bounds(spec.name, uses, consts, shape_of)
        if bounds:
            out[spec.name] = (0, min(bounds))
        elif "mask" in spec.name.lower():
            out[spec.name] = (0, 2)
        else:
            out[spec.name] = DEFAULT_INT_RANGE
    return out


def _shape_lookup(
    model: ModelProto, consts: dict[str, TensorProto], shapes: dict[str, Sequence[int]]
) -> ShapeOf:
    """name -> static dims (None per unknown dim; None when the rank is unknown): constants and inputs
    directly, anything else from shape inference with the concrete input shapes (run once, when asked)."""
    table: list = []

    def shape_of(name: str) -> list[int | None] | None:
        if name in consts:
            return [int(d) for d in consts[name].dims]
        if name in shapes:
            return [int(d) for d in shapes[name]]
        if not table:
            try:  # only graphs that index an intermediate tensor pay for this
                table.append(infer_shapes(model, shapes, symbolic=False).shapes)
            except OpscopeError:
                table.append({})
        found = table[0].get(name)
        return None if found is None else [d if type(d) is int else None for d in found]

    return shape_of


_EMBED_TABLES = {0: 2, 1: 4, 8: 3}  # EmbedLayerNormalization: ids -> word, segment ids -> segment, pos -> pos


def _passes_values(node: onnx.NodeProto, i: int) -> bool:
    if node.op_type in _PASS_THROUGH:
        return i == 0
    if node.op_type not in _VALUE_SUBSET or node.domain not in ("", "ai.onnx"):
        return False
    inputs = _VALUE_SUBSET[node.op_type]
    return inputs is None or i in inputs


def _index_bounds(name: str, uses: dict, consts: dict[str, TensorProto], shape_of: ShapeOf) -> list[int]:
    bounds: list[int] = []
    todo, seen = [name], set()
    while todo:
        tensor = todo.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        for node, i in uses.get(tensor, []):
            if _passes_values(node, i):
                todo.extend(o for o in node.output if o)
            elif (bound := _use_bound(node, i, tensor, consts, shape_of)) is not None:
                bounds.append(bound)
    return bounds


def _use_bound(
    node: onnx.NodeProto, i: int, tensor: str, consts: dict[str, TensorProto], shape_of: ShapeOf
) -> int | None:
    """The exclusive upper bound that using `tensor` as input `i` of `node` puts on its values, if any."""
    op = node.op_type
    if op in _INDEXING and i == 1 and node.domain in ("", "ai.onnx"):
        return _indexed_size(node, tensor, shape_of)
    if op == "OneHot" and i == 0 and len(node.input) > 1:
        depth = _const_array(consts.get(node.input[1]))
        if depth is not None and depth.size == 1 and depth.item() > 0:
            return int(depth.item())
    elif op == "Equal" and len(node.input) == 2:
        other = _const_array(consts.get(node.input[1 - i]))
        if other is not None and other.size > 1 and np.array_equal(other.ravel(), np.arange(other.size)):
            return int(other.size)
    elif op == "EmbedLayerNormalization" and i in _EMBED_TABLES and len(node.input) > _EMBED_TABLES[i]:
        table = consts.get(node.input[_EMBED_TABLES[i]])
        if table is not None and table.dims:
            return int(table.dims[0])
    return None


def _indexed_size(node: onnx.NodeProto, indices: str, shape_of: ShapeOf) -> int | None:
    """The size of the data axis (the smallest, for GatherND / ScatterND) that `indices` addresses."""
    data = shape_of(node.input[0])
    if not data:
        return None
    rank = len(data)
    if node.op_type in ("GatherND", "ScatterND"):
        start = int(_attr(node, "batch_dims", 0)) if node.op_type == "GatherND" else 0
        idx = shape_of(indices)
        k = idx[-1] if idx else None  # how many leading data axes one index tuple addresses
        axes = range(start, start + k) if k is not None and start + k <= rank else range(start, rank)
    else:
        axis = int(_attr(node, "axis", 0))
        axes = range(axis + rank, axis + rank + 1) if axis < 0 else range(axis, axis + 1)
    sizes = [data[a] for a in axes if 0 <= a < rank]
    if not sizes or any(s is None or s < 1 for s in sizes):
        return None
    return min(s for s in sizes if s is not None)


def _const_array(t: TensorProto | None, limit: int = 1 << 16) -> np.ndarray | None:
    """The values of a small inline constant; None for external or large ones (never loaded)."""
    if t is None or is_external(t) or np.prod(t.dims, dtype=np.int64) > limit:
        return None
    return numpy_helper.to_array(t)


# ---------------------------------------------------------------------------------------------
# Memory budget

FEED_BUDGET_ENV = "OPSCOPE_FEED_BUDGET"
FEED_BUDGET_SHARE = 4  # the default budget is 1/4 of the memory this process may use
FEED_BUDGET_FALLBACK = 16 << 30  # where the memory size cannot be read
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def memory_bytes() -> int | None:
    """The memory this process may use: physical memory, or the cgroup limit where it is lower."""
    found = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(limit).read_text().strip()
            if text != "max" and 0 < int(text) < 1 << 60:  # v1 writes ~2**63 for "no limit"
                found.append(int(text))
    return min(found) if found else None


def feed_budget() -> tuple[int, str]:
    """(bytes, where the number comes from) that one batch of synthetic feeds may take.

    `OPSCOPE_FEED_BUDGET` (bytes, or with a K/M/G/T suffix: `64G`, `200GiB`) sets it; else it
    is a quarter of `memory_bytes()`: drawing a float32 feed briefly needs up to 3.25x its size
    (sparse90 draws a float64 mask beside it) and onnxruntime's first activations are at least
    as large again, so feeds above a quarter of memory end in swapping or an out-of-memory kill.
    """
    text = os.environ.get(FEED_BUDGET_ENV, "").strip()
    if text:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", text.lower())
        if not m or float(m.group(1)) <= 0:
            raise OpscopeError(
                f"{FEED_BUDGET_ENV}={text}: expected a size in bytes, e.g. 64G or 200GiB (K, M, G, T are powers of 1024)"
            )
        return int(float(m.group(1)) * _UNITS[m.group(2)]), f"{FEED_BUDGET_ENV}={text}"
    memory = memory_bytes()
    if memory is None:
        return FEED_BUDGET_FALLBACK, "the default, as this machine's memory size is unknown"
    return memory // FEED_BUDGET_SHARE, f"a quarter of the {_gib(memory)} of memory this process may use"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 27 else f"{n / (1 << 20):.1f} MiB"


def _fills_shape(s: InputSpec, values: Mapping[str, Value]) -> bool:
    """Whether the feed of `s` is an array of its full resolved shape (drawn, or a scalar --value filled)."""
    return s.dtype is not None and (s.name not in values or np.ndim(values[s.name]) == 0)


def check_feed_budget(inputs: Sequence[tuple[InputSpec, Sequence[int]]]) -> None:
    """Raise OpscopeError, before anything is allocated, when one batch of these feeds would take more
    than `feed_budget()`; it names the input (the largest), its shape, dtype and size."""
    sizes = [
        (math.prod(int(d) for d in shape) * s.dtype.itemsize, s, shape) for s, shape in inputs if s.dtype
    ]
    total = sum(n for n, _, _ in sizes)
    if not sizes or total <= (budget := feed_budget())[0]:
        return
    limit, source = budget
    n, s, shape = max(sizes, key=lambda x: x[0])
    what = f"input {s.name!r} {s.type_name}[{', '.join(map(str, shape))}]"
    message = (
        f"{what} needs {_gib(n)} of synthetic feed per batch"
        if n > limit
        else f"the synthetic feeds need {_gib(total)} per batch, the largest {what} {_gib(n)}"
    )
    raise OpscopeError(
        f"{message}, over the feed budget of {_gib(limit)} ({source})",
        hint=f"{_smaller(s)}, or raise the budget with {FEED_BUDGET_ENV}=SIZE "
        f"(e.g. {FEED_BUDGET_ENV}={math.ceil(total / (1 << 30)) + 1}G)",
    )


def _smaller(s: InputSpec) -> str:
    """How the user can make the feed of `s` smaller: the flag that sets its free dims, if it has any."""
    symbols = [d for d in (s.dims or []) if isinstance(d, str)]
    if symbols:
        return f"give its {'dims' if len(symbols) > 1 else 'dim'} with --dim {symbols[0]}=N (or --shape)"
    if s.dims is None or None in s.dims:
        return f"give its shape with --shape {s.name}:D0,D1,..."
    return "the model declares this shape with static dims: feed real data with --data"


# ---------------------------------------------------------------------------------------------
# Synthetic feeds


@dataclass(frozen=True)
class _Plan:
    """How to make one input at any step; built once per (model, spec)."""

    spec: InputSpec
    kind: str  # "value", "float", "int", "bool"
    shape: Shape = ()
    low: int = 0
    high: int = 0
    value: np.ndarray | None = None


def _plans(model: ModelLike, spec: FeedSpec) -> list[_Plan]:
    model = load_model(model)
    signature = input_signature(model)
    names = [s.name for s in signature]
    _check_known(spec.values, names, "--value")
    _check_known(spec.ranges, names, "--range")
    _check_known(spec.shapes, names, "--shape")
    # Inputs declaring no shape are resolved only when --shape names them; the loop below
    # explains what else they need.
    shapes = resolve_shapes(
        [s for s in signature if s.dims is not None or s.name in spec.shapes], spec.shapes, spec.dims
    )
    check_feed_budget(
        [(s, shapes[s.name]) for s in signature if s.name in shapes and _fills_shape(s, spec.values)]
    )
    int_ranges = (
        default_ranges(model, shapes)
        if any(s.dtype is not None and s.dtype.kind in "iu" and s.name not in spec.ranges for s in signature)
        else {}
    )
    plans = []
    for s in signature:
        if s.name in spec.values:
            plans.append(_Plan(s, "value", value=_value_array(s, spec.values[s.name], shapes.get(s.name))))
            continue
        if s.dtype is None:
            raise OpscopeError(
                f"input {s.name!r} has type {s.type_name}, which synthetic feeds cannot make",
                hint="pass this input with --data or --value",
            )
        if s.name not in shapes:
            raise OpscopeError(
                f"input {s.name!r} declares no shape: give one with --shape {s.name}:D0,D1,..."
            )
        shape = tuple(shapes[s.name])
        if s.name in spec.ranges and s.dtype.kind not in "iu":
            raise OpscopeError(
                f"--range {s.name}:{','.join(map(str, spec.ranges[s.name]))}: {s.name!r} is {s.type_name}, "
                "and ranges apply to integer inputs only",
                hint="float inputs follow --dist; give fixed values with --value or real ones with --data",
            )
        if s.dtype.kind == "b":
            plans.append(_Plan(s, "bool", shape))
        elif s.dtype.kind in "iu":
            lo, hi = spec.ranges.get(s.name) or int_ranges.get(s.name, DEFAULT_INT_RANGE)
            info = np.iinfo(s.dtype)
            if lo < info.min or hi - 1 > info.max:
                raise OpscopeError(
                    f"range [{lo}, {hi}) of {s.name!r} does not fit its type {s.type_name} "
                    f"([{info.min}, {info.max}])"
                )
            plans.append(_Plan(s, "int", shape, int(lo), int(hi)))
        else:
            plans.append(_Plan(s, "float", shape))
    return plans


def _value_array(spec: InputSpec, value: Value, shape: list[int] | None) -> np.ndarray:
    given = np.asarray(value)
    if given.dtype == object or given.ndim > 1 and not isinstance(value, np.ndarray):
        raise OpscopeError(f"--value for {spec.name!r}: expected a number or a comma list, got {value!r}")
    dtype = spec.dtype
    if dtype is None:
        raise OpscopeError(
            f"--value for {spec.name!r}: its type {spec.type_name} cannot be made here; use --data"
        )
    if dtype.kind in "iub" and given.dtype.kind == "f" and not np.all(np.mod(given, 1) == 0):
        raise OpscopeError(
            f"--value {spec.name}:{_fmt(value)}: {spec.name!r} is {spec.type_name}, expected whole numbers"
        )
    if dtype.kind in "iu" and given.size:
        info = np.iinfo(dtype)
        if given.min() < info.min or given.max() > info.max:
            raise OpscopeError(f"--value {spec.name}:{_fmt(value)}: out of range for {spec.type_name}")
    arr = given.astype(dtype)
    if arr.ndim == 0 and spec.rank:  # a scalar fills a non-scalar input
        arr = np.full(shape if shape is not None else [], arr, dtype=dtype)
    return arr


def _fmt(value: Value) -> str:
    return ",".join(map(str, np.ravel(value).tolist()))


def _draw(plans: list[_Plan], dist: str, seed: int, step: int) -> dict[str, np.ndarray]:
    make = DISTRIBUTIONS[dist]
    feeds = {}
    for p in plans:
        if p.kind == "value":
            feeds[p.spec.name] = p.value
            continue
        # Each input's stream depends only on (seed, step, name): adding or fixing another input
        # never changes this one.
        rng = np.random.default_rng([seed, step, zlib.crc32(p.spec.name.encode())])
        if p.kind == "float":
            value = make(rng, p.shape).astype(p.spec.dtype, copy=False)
        elif p.kind == "int":
            value = rng.integers(p.low, p.high, size=p.shape, dtype=p.spec.dtype)
        else:
            value = rng.random(p.shape) < 0.5
        feeds[p.spec.name] = np.asarray(value)  # rank-0 draws come back as numpy scalars
    return feeds


def synthetic_feeds(model: ModelLike, spec: FeedSpec | None = None, step: int = 0) -> dict[str, np.ndarray]:
    """One batch of synthetic feeds for step `step`: the same (seed, step) gives the same arrays.

    Float inputs follow `spec.dist`; integer inputs are uniform over their range (see
    `default_ranges`, overridden by `spec.ranges`, hi excluded); bool inputs are fair coin
    flips; `spec.values` wins for its inputs. Shapes follow `resolve_shapes`.
    """
    spec = spec or FeedSpec()
    return _draw(_plans(model, spec), spec.dist, spec.seed, step)


def first_batch_shapes(model: ModelLike, spec: FeedSpec | None = None) -> dict[str, list[int]]:
    """The input shapes of the first batch `iter_feeds(model, spec)` gives, without drawing it
    (synthetic) or reading past the first batch (data). What `inject` sizes its taps by."""
    spec = spec or FeedSpec()
    if spec.data is None:
        known = [s for s in input_signature(model) if s.dims is not None or s.name in spec.shapes]
        return resolve_shapes(known, spec.shapes, spec.dims)
    first = next(iter(load_data(spec.data, model)), None)
    return {name: list(np.shape(v)) for name, v in (first or {}).items()}


def iter_feeds(
    model: ModelLike, spec: FeedSpec | None = None, batches: int | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Batches to run: from `spec.data` when set (checked against the model, `spec.values`
    filling in or overriding inputs), else synthetic steps 0, 1, ...

    `batches` (else `spec.batches`) caps the count; synthetic runs default to DEFAULT_BATCHES,
    data runs to every batch found. Errors in the spec are raised before the first batch.
    """
    spec = spec or FeedSpec()
    model = load_model(model)
    count = batches if batches is not None else spec.batches
    if count is not None and count < 1:
        raise OpscopeError(f"batches {count}: expected at least 1")
    if spec.data is None:
        plans = _plans(model, spec)
        return (_draw(plans, spec.dist, spec.seed, step) for step in range(count or DEFAULT_BATCHES))
    unused = [
        flag
        for flag, given in (("--shape", spec.shapes), ("--dim", spec.dims), ("--range", spec.ranges))
        if given
    ]
    if unused:
        raise OpscopeError(
            f"{', '.join(unused)} shape synthetic feeds only, and --data {spec.data} was given",
            hint="with --data the shapes and values come from the files; --value still applies",
        )
    signature = input_signature(model)
    _check_known(spec.values, [s.name for s in signature], "--value")
    known = [s for s in signature if s.dims is not None]
    shapes = resolve_shapes(known) if known else {}  # only to fill non-scalar inputs from a scalar --value
    check_feed_budget(
        [(s, shapes[s.name]) for s in known if s.name in spec.values and _fills_shape(s, spec.values)]
    )
    fixed = {
        s.name: _value_array(s, spec.values[s.name], shapes.get(s.name))
        for s in signature
        if s.name in spec.values
    }
    batches_it = load_data(spec.data, model)

    def gen() -> Iterator[dict[str, np.ndarray]]:
        for k, feeds in enumerate(batches_it):
            if count is not None and k >= count:
                return
            feeds = {**feeds, **fixed}
            check_feeds(signature, feeds)
            yield feeds

    return gen()


# ---------------------------------------------------------------------------------------------
# Real data


def load_data(path: str | os.PathLike, model: ModelLike | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Batches of real inputs from `path`, one dict per batch, in a stable order.

    - a `.npz` file: one batch, keys are input names (np.savez's `arr_0`, `arr_1`, ...
      map to the model's inputs by position when `model` is given);
    - a `.npy` or `.pb` (TensorProto) file: one batch of one input, named by the file
      stem (`.npy`) or the tensor's name, else the model's first input;
    - a folder of `.npz` files: one batch each, in natural order (b2 before b10);
    - a folder of `<input>.npy` files: one batch;
    - a folder of `input_<k>.pb` files (onnxruntime's test_data_set layout): one batch,
      each tensor named by its own name, else by position k among the model's inputs;
    - a folder of batch folders (e.g. `test_data_set_0`, `test_data_set_1`, or `b0/`, `b1/`
      of `.npy`): one batch per folder, in natural order.
    The layout is checked now; the arrays are read lazily, batch by batch.
    """
    root = Path(path)
    names = [s.name for s in input_signature(model)] if model is not None else None
    if not root.exists():
        raise OpscopeError(f"--data {root}: no such file or folder")
    loaders = [_file_loader(root, names)] if root.is_file() else _folder_loaders(root, names)
    return (load() for load in loaders)


Loader = Callable[[], dict[str, np.ndarray]]


def _file_loader(path: Path, names: list[str] | None) -> Loader:
    if path.suffix == ".npz":
        return lambda: _read_npz(path, names)
    if path.suffix == ".npy":
        return lambda: {path.stem: _read_npy(path)}
    if path.suffix == ".pb":
        return lambda: dict([_read_pb(path, 0, names)])
    raise OpscopeError(f"--data {path}: expected an .npz, .npy or .pb file, or a folder of them")


def _folder_loaders(root: Path, names: list[str] | None, nested: bool = False) -> list[Loader]:
    files = sorted((p for p in root.iterdir() if p.is_file()), key=_natural)
    npz = [p for p in files if p.suffix == ".npz"]
    npy = [p for p in files if p.suffix == ".npy"]
    pb = [p for p in files if re.fullmatch(r"input_\d+\.pb", p.name)]
    kinds = [k for k, found in (("*.npz", npz), ("*.npy", npy), ("input_*.pb", pb)) if found]
    if len(kinds) > 1:
        raise OpscopeError(f"--data {root}: mixes {' and '.join(kinds)} files; keep one layout per folder")
    if npz and not nested:
        return [(lambda p=p: _read_npz(p, names)) for p in npz]
    if npy:
        return [lambda: {p.stem: _read_npy(p) for p in npy}]
    if pb:
        return [lambda: dict(_read_pb(p, int(p.stem.split("_")[1]), names) for p in pb)]
    subdirs = (
        []
        if nested
        else sorted(
            (p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))), key=_natural
        )
    )
    if subdirs:
        loaders = []
        for sub in subdirs:
            found = _folder_loaders(sub, names, nested=True)
            if not found:
                raise OpscopeError(f"--data {sub}: batch folder has no .npy or input_*.pb files")
            loaders += found
        return loaders
    if nested:
        return []
    raise OpscopeError(f"--data {root}: no .npz, .npy or input_*.pb files and no batch folders in it")


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _read_npz(path: Path, names: list[str] | None) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise OpscopeError(f"--data {path}: not a readable .npz file ({exc})") from None
    positional = [re.fullmatch(r"arr_(\d+)", k) for k in data]
    if names and data and all(positional) and not set(data) & set(names):
        if len(data) > len(names):
            raise OpscopeError(
                f"--data {path}: {len(data)} unnamed arrays, the model has {len(names)} inputs"
            )
        data = {names[int(m.group(1))]: data[m.group(0)] for m in positional if m}
    return data


def _read_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise OpscopeError(f"--data {path}: not a readable .npy file ({exc})") from None


def _read_pb(path: Path, index: int, names: list[str] | None) -> tuple[str, np.ndarray]:
    try:
        tensor = onnx.load_tensor(str(path))
        array = numpy_helper.to_array(tensor)
    except Exception as exc:  # protobuf and onnx raise several unrelated types for a bad file
        raise OpscopeError(f"--data {path}: not a readable TensorProto file ({type(exc).__name__})") from None
    if tensor.name:
        return tensor.name, array
    if names is None:
        raise OpscopeError(
            f"--data {path}: the tensor has no name and no model was given to place it by position"
        )
    if index >= len(names):
        raise OpscopeError(f"--data {path}: position {index} but the model has only {len(names)} inputs")
    return names[index], array


# ---------------------------------------------------------------------------------------------
# Checks


def _signature(model: ModelLike | Sequence[InputSpec]) -> list[InputSpec]:
    if isinstance(model, Sequence) and not isinstance(model, str | bytes):
        return list(model)
    return input_signature(model)


def _suggest(word: str, choices: Sequence[str]) -> str:
    """did_you_mean, also for a name that differs only in case ('X' for 'x')."""
    same = [c for c in choices if c.lower() == word.lower()]
    return f" (did you mean {same[0]!r}?)" if same else did_you_mean(word, choices)


def _check_known(given: Mapping[str, Any], names: list[str], flag: str) -> None:
    for name in given:
        if name not in names:
            raise OpscopeError(
                f"{flag} names {name!r}, which is not an input of the model"
                f"{_suggest(name, names)}; inputs: {listing(names)}"
            )


def _check_shape(spec: InputSpec, shape: Sequence[int], what: str) -> None:
    if spec.dims is None:
        return
    got = "[" + ",".join(map(str, shape)) + "]"
    if len(shape) != len(spec.dims):
        raise OpscopeError(
            f"{what} {spec.name!r}: got shape {got} (rank {len(shape)}), the model expects "
            f"rank {len(spec.dims)} {spec.shape_str()}"
        )
    for axis, (d, g) in enumerate(zip(spec.dims, shape, strict=True)):
        if isinstance(d, int) and d != g:
            raise OpscopeError(
                f"{what} {spec.name!r}: got shape {got}, the model expects dim {axis} = {d} "
                f"{spec.shape_str()}"
            )


def check_feeds(model: ModelLike | Sequence[InputSpec], feeds: Mapping[str, Any]) -> None:
    """Raise OpscopeError unless `feeds` has exactly the model's inputs, with their dtypes,
    ranks and static dims. `model` may also be a signature (a list of InputSpec), e.g. a
    session's: checking here gives a did-you-mean and the expected shape in one line.
    """
    signature = _signature(model)
    names = [s.name for s in signature]
    overridable: set[str] = set()
    if isinstance(model, ModelProto | str | os.PathLike):
        graph = load_model(model).graph
        overridable = {vi.name for vi in graph.input} - set(names)
    for name in feeds:
        if name not in names and name not in overridable:
            raise OpscopeError(
                f"feed {name!r} is not an input of the model{_suggest(name, names)}; inputs: {listing(names)}"
            )
    missing = [n for n in names if n not in feeds]
    if missing:
        absent = ", ".join(map(repr, missing))
        raise OpscopeError(
            f"input {absent} missing from the feeds (got: {listing(feeds) or 'none'}); "
            f"the model needs: {', '.join(s.describe() for s in signature)}",
            hint="give it in the data, or fix its value with --value NAME:V",
        )
    for spec in signature:
        arr = feeds[spec.name]
        if not isinstance(arr, np.ndarray):
            raise OpscopeError(f"input {spec.name!r}: got a {type(arr).__name__}, expected a numpy array")
        if spec.dtype is not None and arr.dtype != spec.dtype:
            raise OpscopeError(
                f"input {spec.name!r}: got {arr.dtype} data, the model expects {spec.type_name}",
                hint=f"convert it, e.g. array.astype(np.{spec.dtype.name})",
            )
        _check_shape(spec, arr.shape, "input")


def describe_feeds(feeds: Mapping[str, np.ndarray]) -> str:
    """'x float32[1,3,48,320], sr int64[]': one line for banners and error messages."""
    return ", ".join(
        f"{k} {np.asarray(v).dtype}[{','.join(map(str, np.shape(v)))}]" for k, v in feeds.items()
    )
