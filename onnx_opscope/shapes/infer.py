"""Shapes of every value in a model: the best of three sources, symbols kept as symbols.

No single shape inference is enough on real exports. onnx's own inference (with data
propagation) is fast and always runs, but loses symbolic dims at Reshape/Expand targets
built from Shape ops, leaving anonymous `unk__N` dims. onnxruntime's symbolic inference
(`onnxruntime.tools.symbolic_shape_infer`, needs sympy) keeps `batch`/`seq` through those
chains but is slow in Python and stops on some quantized or contrib graphs. So:

1. graph inputs get a name for every dim (`batch`, or `<input>_<axis>` for unnamed, `?`
   and 0 dims), then the user's `--shape` / `--dim` values are written in;
2. onnx inference runs; `unk__N` dims it invents read as unknown (None), not as symbols;
3. a per-node fallback walks the graph in order and fills the dims still missing for the
   common ops (contrib and quantized ops included), folding small constant tensors (pads,
   scales, If conditions) and tracking shape tensors by value (Shape -> Gather -> Concat ->
   Reshape) so symbols survive;
4. only when something is still unresolved, sympy is importable and the graph has at most
   `ort_max_nodes` nodes, onnxruntime's symbolic inference runs (whatever it inferred before
   stopping is kept) and the fallback runs again on top of it.

Graphs of at least `RULES_FIRST_NODES` nodes made only of ops whose rules here are exact
(`shape_rules.EXACT_RULE_OPS`: MatMul, Gemm, Conv, elementwise, Softmax, Reshape, ...) try
step 3 first and skip onnx's inference when nothing is left unresolved.

Per dim, the best answer wins: a number, then an expression in the input symbols, then
any other symbol (a data-dependent size), then unknown.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
from onnx import GraphProto, ModelProto, TensorProto

from ..errors import OpscopeError, did_you_mean, listing
from ..graph.index import ModelIndex
from .rules import EXACT_RULE_OPS, Fallback
from .symbolic import Poly, parse_dim, safe_symbol
from .table import Dim, Shape, ShapeTable, best_shape

ORT_MAX_NODES = 4000  # onnxruntime's symbolic inference costs ~1 ms per node in Python
RULES_FIRST_NODES = 20_000  # from this size, graphs of EXACT_RULE_OPS only try the per-node rules first


# -- user overrides ----------------------------------------------------------------------


def input_symbols(model: ModelProto) -> dict[str, str]:
    """Symbol name -> "input[axis]" for every non-static dim of the model's real inputs."""
    return _symbols_of(_real_inputs(model.graph))


def _symbols_of(real: list[onnx.ValueInfoProto]) -> dict[str, str]:
    syms: dict[str, str] = {}
    for vi in real:
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            name = _input_dim_symbol(vi.name, axis, d)
            if name:
                syms.setdefault(name, f"{vi.name}[{axis}]")
    return syms


def _input_dim_symbol(input_name: str, axis: int, d) -> str | None:
    if d.HasField("dim_value") and d.dim_value > 0:
        return None
    p = d.dim_param.strip() if d.HasField("dim_param") else ""
    if p and p != "?":
        return safe_symbol(p)
    return safe_symbol(f"{input_name}_{axis}")


def _inputs_already_named(real: list[onnx.ValueInfoProto]) -> bool:
    for vi in real:
        tt = vi.type.tensor_type
        for axis, d in enumerate(tt.shape.dim):
            sym = _input_dim_symbol(vi.name, axis, d)
            if sym is not None and (not d.HasField("dim_param") or d.dim_param != sym):
                return False
    return True


def _real_inputs(graph: GraphProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in graph.initializer}
    return [vi for vi in graph.input if vi.name not in inits and vi.type.HasField("tensor_type")]


def prepare_inputs(
    model: ModelProto,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
) -> tuple[ModelProto, dict[str, str]]:
    """A copy of `model` whose input dims are all named or given; returns it and its symbols.

    Raises OpscopeError for unknown input names, rank mismatches, overrides that contradict
    a static dim, and `--dim` names that are no input symbol.
    """
    shapes = dict(shapes or {})
    dims = {safe_symbol(k): v for k, v in (dims or {}).items()}
    if not shapes and not dims:
        real = _real_inputs(model.graph)  # once: it reads every initializer's name
        if _inputs_already_named(real):
            return model, _symbols_of(real)  # nothing to write: no copy
    m = ModelProto()
    m.CopyFrom(model)
    real = _real_inputs(m.graph)
    names = [vi.name for vi in real]
    for name in shapes:
        if name not in names:
            raise OpscopeError(
                f"--shape: the model has no input {name!r}{did_you_mean(name, names)}",
                hint=f"inputs: {listing(names)}",
            )
    symbols: dict[str, str] = {}
    for vi in real:
        tt = vi.type.tensor_type
        if vi.name in shapes:
            _write_shape(vi, shapes[vi.name])
        if not tt.HasField("shape"):
            continue
        for axis, d in enumerate(tt.shape.dim):
            sym = _input_dim_symbol(vi.name, axis, d)
            if sym is None:
                continue
            symbols.setdefault(sym, f"{vi.name}[{axis}]")
            if sym in dims:
                d.dim_value = dims[sym]
            else:
                d.dim_param = sym
    unknown = [k for k in dims if k not in symbols]
    if unknown:
        raise OpscopeError(
            f"--dim {unknown[0]}: no input dim is called that{did_you_mean(unknown[0], symbols)}",
            hint=f"symbolic input dims: {listing(symbols) or 'none'}",
        )
    return m, {k: v for k, v in symbols.items() if k not in dims}


def _write_shape(vi: onnx.ValueInfoProto, given: Sequence[int | str]) -> None:
    """Replace input `vi`'s declared shape by `given` (ints or symbols), checked against what it declares."""
    tt = vi.type.tensor_type
    old = list(tt.shape.dim) if tt.HasField("shape") else None
    if old is not None and len(old) != len(given):
        raise OpscopeError(f"--shape {vi.name}: the model declares rank {len(old)}, got {len(given)} dims")
    for axis, g in enumerate(given):
        declared = old[axis].dim_value if old is not None and old[axis].HasField("dim_value") else 0
        if isinstance(g, int) and declared > 0 and declared != g:
            raise OpscopeError(
                f"--shape {vi.name}: axis {axis} is {declared} in the model, --shape gives {g}"
            )
    tt.shape.ClearField("dim")
    tt.shape.SetInParent()
    for g in given:
        d = tt.shape.dim.add()
        if isinstance(g, int):
            d.dim_value = g
        else:
            d.dim_param = safe_symbol(g)


# -- reading shapes out of protos --------------------------------------------------------


def _read_type(
    tp: onnx.TypeProto, strong: set[str], keep_new: bool = False
) -> tuple[int, Shape | None] | None:
    """(elem_type, dims) of a tensor type; dim_params outside the input symbols read as unknown.

    `keep_new` keeps other symbols too: onnxruntime names data-dependent sizes (NonZero
    outputs) that way, while `unk__N` and exporters' own value_info names carry no meaning.
    """
    if not tp.HasField("tensor_type"):
        return None
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return tt.elem_type, None
    out: list[Dim] = []
    for d in tt.shape.dim:
        v = d.dim_value
        if v:  # the common case: a positive static dim
            out.append(v)
            continue
        which = d.WhichOneof("value")
        if which == "dim_value":
            out.append(v)
        elif which == "dim_param":
            p = d.dim_param
            if p in strong:
                out.append(parse_dim(p))
            elif p.startswith("unk__"):
                out.append(None)
            else:
                v = parse_dim(p)
                out.append(v if keep_new or not isinstance(v, Poly) or v.symbols() <= strong else None)
        else:
            out.append(None)
    return tt.elem_type, tuple(out)


def _collect_into(table: ShapeTable, index: ModelIndex, strong: set[str]) -> None:
    """Merge the declared and inferred value types of all graphs of a model into `table`."""
    shapes, dtypes = table.shapes, table.dtypes
    for entry in index.graphs.values():
        g = entry.graph
        for vis in (g.input, g.value_info, g.output):
            for vi in vis:
                r = _read_type(vi.type, strong)
                if r is None:
                    continue
                name = vi.name
                if r[0] and name not in dtypes:
                    dtypes[name] = r[0]
                old = shapes.get(name)
                shapes[name] = r[1] if old is None else best_shape(old, r[1], strong)


# -- the inference pipeline --------------------------------------------------------------


def infer_shapes(
    model: ModelProto,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    symbolic: bool | str = "auto",
    ort_max_nodes: int = ORT_MAX_NODES,
    index: ModelIndex | None = None,
) -> ShapeTable:
    """Shapes and dtypes for every value of `model` (subgraphs too), see the module doc.

    `symbolic`: "auto" runs onnxruntime's symbolic inference when it can help and the graph
    has at most `ort_max_nodes` nodes; True forces it, False skips it. `index`: the caller's
    index of `model`, used when nothing is written into the inputs (its tables are then shared).
    """
    prepared, symbols = prepare_inputs(model, shapes, dims)
    strong = set(symbols)
    table = ShapeTable(symbols=symbols)
    if index is None or index.model is not prepared:
        index = ModelIndex(prepared)
    inits = _static_facts(table, index)
    n_nodes = sum(len(e.graph.node) for e in index.graphs.values())
    if n_nodes >= RULES_FIRST_NODES and _op_types(index) <= EXACT_RULE_OPS:
        # Huge graph of plain ops: the per-node rules are exact for these, and a third of the
        # cost of onnx's inference (serialise, infer, parse back) is saved when they suffice.
        _collect_into(table, index, strong)
        fallback = Fallback(index, table, inits, strong)
        filled, unresolved = fallback.run()
        if not unresolved:
            table.sources["onnx"] = f"skipped: the per-node rules resolved all {n_nodes} nodes"
            table.sources["onnxruntime-symbolic"] = "not needed"
            return _finish(table, fallback, filled, 0)
    inferred = _onnx_inference(table, prepared)
    inferred_index = index if inferred is None else ModelIndex(inferred)
    _collect_into(table, inferred_index, strong)
    fallback = Fallback(inferred_index, table, inits, strong)
    filled, left = fallback.run()
    want_ort = symbolic is True or (symbolic == "auto" and left and n_nodes <= ort_max_nodes)
    if not want_ort:
        why = (
            "not needed"
            if not left
            else "off"
            if symbolic is False
            else f"skipped: {n_nodes} nodes > {ort_max_nodes}"
        )
        table.sources["onnxruntime-symbolic"] = why
        return _finish(table, fallback, filled, left)
    ort_shapes, table.sources["onnxruntime-symbolic"] = _ort_symbolic(prepared, strong)
    if ort_shapes:
        _merge_into(table, *ort_shapes, strong)
        fallback.forget_values()  # shape values may now resolve further
        more, left = fallback.run()
        filled += more
    return _finish(table, fallback, filled, left)


def _op_types(index: ModelIndex) -> set[str]:
    if len(index.graphs) == 1:
        return {n.op_type for n in index.main.graph.node}
    return {n.op_type for _, _, n in index.nodes()}


def _static_facts(table: ShapeTable, index: ModelIndex) -> dict[str, TensorProto]:
    """Initializers (sparse ones too) and Constant outputs: their shapes, dtypes, and that they are weights."""
    inits: dict[str, TensorProto] = {}
    for entry in index.graphs.values():
        g = entry.graph
        for t in g.initializer:
            inits[t.name] = t
        for sp in g.sparse_initializer:
            inits[sp.values.name] = sp.values
            table.shapes[sp.values.name] = tuple(sp.dims)
            table.dtypes[sp.values.name] = sp.values.data_type
            table.weights.add(sp.values.name)
        for node in g.node:
            if node.op_type == "Constant" and node.output:
                table.weights.add(node.output[0])
    shapes, dtypes = table.shapes, table.dtypes
    table.weights.update(inits)
    same: dict[Shape, Shape] = {}  # equal dims (all ints) share one tuple: the rules' memo keys on ids
    for name, t in inits.items():
        if name not in shapes:
            shape = tuple(t.dims)
            shapes[name] = same.setdefault(shape, shape)
            dtypes[name] = t.data_type
    return inits


def _onnx_inference(table: ShapeTable, prepared: ModelProto) -> ModelProto | None:
    t0 = time.perf_counter()
    try:
        inferred = onnx.shape_inference.infer_shapes(
            prepared, check_type=False, strict_mode=False, data_prop=True
        )
    except Exception as exc:  # noqa: BLE001 - any failure here falls through to the next source
        table.sources["onnx"] = f"failed: {_one_line(exc)}"
        return None
    table.sources["onnx"] = f"ok ({time.perf_counter() - t0:.2f} s)"
    return inferred


def _finish(table: ShapeTable, fallback: Fallback, filled: int, left: int) -> ShapeTable:
    table.value_of, table.const_of = fallback.value, fallback.const
    table.sources["fallback"] = f"filled {filled} dims; {left} node outputs still have unknown dims"
    return table


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def _merge_into(
    table: ShapeTable, shapes: dict[str, Shape | None], dtypes: dict[str, int], strong: set[str]
) -> None:
    for name, shp in shapes.items():
        table.shapes[name] = best_shape(table.shapes.get(name), shp, strong)
    for name, dt in dtypes.items():
        table.dtypes.setdefault(name, dt)


def _symbolic_shape_infer():
    """onnxruntime's `tools/symbolic_shape_infer.py`, loaded on its own: the `onnxruntime.tools` package's
    `__init__` imports torch whenever torch is installed (4 s and 230 MB in every process)."""
    name = "onnxruntime.tools.symbolic_shape_infer"
    if name in sys.modules:
        return sys.modules[name]
    ort = importlib.util.find_spec("onnxruntime")
    if ort is None or ort.origin is None:
        raise ImportError("onnxruntime is not installed")
    spec = importlib.util.spec_from_file_location(
        name, Path(ort.origin).parent / "tools" / "symbolic_shape_infer.py"
    )
    if spec is None or spec.loader is None:
        raise ImportError("onnxruntime has no tools/symbolic_shape_infer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its logger and pickling look itself up by this name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _ort_symbolic(
    model: ModelProto, strong: set[str]
) -> tuple[tuple[dict[str, Shape | None], dict[str, int]] | None, str]:
    """Run onnxruntime's symbolic inference, keeping what it found even when it stops early."""
    try:
        SymbolicShapeInference = _symbolic_shape_infer().SymbolicShapeInference
    except ImportError as exc:  # sympy missing
        return None, f"unavailable ({_one_line(exc)})"
    t0 = time.perf_counter()
    ort_log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = ort_log.level
    ort_log.setLevel(logging.CRITICAL)
    sym = SymbolicShapeInference(int_max=2**31 - 1, auto_merge=True, guess_output_rank=False, verbose=0)
    status = "ok"
    try:
        # The class's own infer_shapes() saves a temp model into the working directory when it
        # stops early; we drive the same steps and keep its partial results instead.
        sym._preprocess(model)
        rounds = 0
        while sym.run_ and rounds < 8:
            rounds += 1
            done = sym._infer_impl()
        sym._update_output_from_vi()
        if not done:
            status = "partial"
    except Exception as exc:  # noqa: BLE001 - keep what was inferred before the failure
        status = f"partial, stopped: {_one_line(exc)}"
    finally:
        ort_log.setLevel(level)
    vis = getattr(sym, "known_vi_", None) or {}
    shapes: dict[str, Shape | None] = {}
    dtypes: dict[str, int] = {}
    with contextlib.suppress(Exception):
        for name, vi in vis.items():
            r = _read_type(vi.type, strong, keep_new=True)
            if r is not None:
                shapes[name] = r[1]
                if r[0]:
                    dtypes[name] = r[0]
    return (shapes, dtypes), f"{status} ({time.perf_counter() - t0:.2f} s)"
