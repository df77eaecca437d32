"""`calibrate`: quantization ranges of the tensors onnxruntime's quantizer calibrates, from one pass.

Pass 1 taps every selected tensor (`tensors`) with a whole-tensor min and max in the graph
(`taps`), runs each batch once and folds the batch's values into one running min / max per
tensor on the host: a few bytes per tensor leave the session and memory does not grow with the
number of batches (onnxruntime's calibrators keep every batch's outputs until the end).

`minmax` is what onnxruntime's `MinMaxCalibrater` computes with its defaults (no moving average,
not symmetric unless asked): np.nanmin / np.nanmax of the per-batch float32 ReduceMin / ReduceMax,
on a session with graph optimizations off as onnxruntime's calibrator runs it, so the ranges are
the same floats bit for bit. Batches may differ in shape (sequence lengths), which onnxruntime's
histogram calibrators cannot merge. `percentile`, `entropy`, `entropy-trt` and `mse` take a second pass of
fixed-range histograms over pass 1's ranges (`histograms`) and turn them into ranges (`methods`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from onnx import ModelProto

from ..errors import OpscopeError, did_you_mean
from ..graph import load_model
from ..graph.io import ModelLike, without_weight_data
from ..run import FeedSpec, RuntimeConfig, iter_feeds
from ..run.engine import Engine, InOrder, run_batches, sessions_for
from ..run.feeds import DEFAULT_BATCHES
from .taps import MinMaxTap, add_minmax_taps
from .tensors import CalibTensor, default_op_types, tensors_to_calibrate

METHODS = ("minmax", "percentile", "entropy", "entropy-trt", "mse")
HISTOGRAM_METHODS = METHODS[1:]

Feeds = FeedSpec | Iterable[Mapping[str, np.ndarray]] | Any
"""A FeedSpec (what `record` takes), an onnxruntime CalibrationDataReader, or any iterable of feed dicts."""


@dataclass
class CalibrationResult:
    """Ranges per tensor name, as numpy scalars of the tensor's own type (float32 or float16).

    `ranges` are the method's; `minmax` the observed min / max (pass 1), which the histogram
    methods start from. `unobserved`: selected tensors that never ran (an If branch never taken,
    a Loop with zero iterations): they have no range. `op_types` are the ones the selection used.
    """

    method: str
    ranges: dict[str, tuple[np.floating, np.floating]]
    minmax: dict[str, tuple[np.floating, np.floating]]
    tensors: list[CalibTensor]
    op_types: list[str]
    batches: int
    seconds: float
    unobserved: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def tensors_data(self):
        """The ranges as onnxruntime's `TensorsData`, each value a shape-[1] array as its calibrators make."""
        from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

        kind = {"minmax": "MinMax", "entropy": "Entropy", "entropy-trt": "Entropy", "percentile": "Percentile",
                "mse": "MinMax"}  # fmt: skip
        data = {
            name: TensorData(lowest=_as_float(lo), highest=_as_float(hi))
            for name, (lo, hi) in self.ranges.items()
        }
        return TensorsData(CalibrationMethod[kind[self.method]], data)


def _as_float(v: Any) -> np.ndarray:
    """A shape-[1] array of `v`'s own float type (float16 / float32), else float32, as TensorData wants."""
    arr = np.asarray(v)
    return arr.reshape(1) if arr.dtype in (np.float16, np.float32) else arr.astype(np.float32).reshape(1)


DEFAULT_BINS = {"entropy": 128}  # onnxruntime's create_calibrator defaults: 128 for entropy, 2048 otherwise


def calibrate(
    model: ModelLike,
    feeds: Feeds = None,
    *,
    method: str = "minmax",
    op_types: Iterable[str] | None = None,
    runtime: RuntimeConfig | None = None,
    symmetric: bool | None = None,
    bins: int | None = None,
    percentile: float = 99.999,
    base_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    engine: Engine | None = None,
) -> CalibrationResult:
    """Ranges for every tensor `quantize_static(model, op_types_to_quantize=op_types)` calibrates, If /
    Loop / Scan bodies included, over the batches of `feeds` (None: synthetic, as `record`).

    `runtime` defaults to onnxruntime's calibrator's session (CPU, graph optimizations off), which
    makes `minmax` equal its ranges bit for bit. `symmetric`: (-m, m) with m = max(|lo|, |hi|), as
    onnxruntime's CalibTensorRangeSymmetric (None: its default, on for percentile only). `bins` and
    `percentile` are for the histogram methods; `bins` None is onnxruntime's default for the method
    (`create_calibrator`: 128 for entropy, 2048 otherwise), so `--method entropy` means its entropy.
    `progress(done, total_or_None)` is called after each batch of each pass. `engine`: where the
    batches run (`run.engine`; on Ray each worker returns per-batch min/max or counts only).
    """
    started = time.perf_counter()
    if method not in METHODS:
        raise OpscopeError(
            f"unknown calibration method {method!r}{did_you_mean(method, METHODS)}; choose one of: {', '.join(METHODS)}"
        )
    methods_api = _histogram_api(method) if method in HISTOGRAM_METHODS else None
    runtime = runtime or RuntimeConfig(graph_opt="disable")
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    source = load_model(model)
    op_types = list(op_types) if op_types else None
    tensors = tensors_to_calibrate(source, op_types)
    if not tensors:
        raise OpscopeError(
            f"no float tensor to calibrate for op types {', '.join(op_types) if op_types else '(default)'}",
            hint="--op-types names the ops whose inputs and outputs are calibrated, e.g. Conv,MatMul",
        )
    engine = engine or Engine()
    observed, batches = _minmax_pass(source, tensors, feeds, runtime, base_dir, progress, engine)
    minmax = {t.name: observed[t.name] for t in tensors if t.name in observed}
    unobserved = sorted({t.name for t in tensors} - set(minmax))
    ranges = minmax
    if symmetric is None:  # onnxruntime's defaults: create_calibrator's extra_options
        symmetric = method == "percentile"
    options: dict[str, Any] = {"symmetric": symmetric}
    bins = bins or DEFAULT_BINS.get(method, 2048)
    if methods_api is not None:
        histogram_pass, compute_ranges = methods_api
        mode = (
            "absolute" if (method == "percentile" and symmetric) or method == "entropy-trt" else "symmetric"
        )
        counted = {t: minmax[t.name] for t in tensors if t.name in minmax}
        hists = histogram_pass(
            source,
            counted,
            _replayable(feeds, source),
            runtime,
            bins=bins,
            mode=mode,
            base_dir=base_dir,
            engine=engine,
        )
        extra = {"percentile": percentile, "symmetric": symmetric} if method == "percentile" else {}
        ranges = compute_ranges(method, hists, **extra)
        options.update(bins=bins, mode=mode, **extra)
    elif symmetric:
        ranges = {k: _symmetric(lo, hi) for k, (lo, hi) in minmax.items()}
    return CalibrationResult(
        method=method,
        ranges=ranges,
        minmax=minmax,
        tensors=tensors,
        op_types=op_types or list(default_op_types()),
        batches=batches,
        seconds=time.perf_counter() - started,
        unobserved=unobserved,
        options=options,
    )


def _symmetric(lo: np.floating, hi: np.floating) -> tuple[np.floating, np.floating]:
    """MinMaxCalibrater's symmetric range: m = nanmax(|lo|, |hi|), then (-m, m)."""
    m = np.nanmax([np.abs(lo), np.abs(hi)])
    return (-m, m)


def _histogram_api(method: str) -> tuple[Callable, Callable]:
    try:
        from .histograms import histogram_pass
        from .methods import compute_ranges
    except ImportError as exc:
        raise OpscopeError(
            f"method {method} needs onnx_opscope.calibration.histograms.histogram_pass and "
            f"onnx_opscope.calibration.methods.compute_ranges, which this build lacks ({exc})",
            hint="use --method minmax",
        ) from None
    return histogram_pass, compute_ranges


def batches_of(feeds: Feeds, model: ModelProto) -> Iterator[Mapping[str, np.ndarray]]:
    """The feed dicts of `feeds`: a FeedSpec (or None) drawn as `record` draws them, a
    CalibrationDataReader read as onnxruntime reads it (get_next until it returns None or {}),
    one dict as one batch, or any iterable of dicts."""
    if feeds is None or isinstance(feeds, FeedSpec):
        return iter_feeds(model, feeds)
    if isinstance(feeds, Mapping):
        return iter([feeds])
    if callable(getattr(feeds, "get_next", None)):
        return iter(lambda: feeds.get_next() or None, None)
    if isinstance(feeds, Iterable):
        return iter(feeds)
    raise OpscopeError(
        f"feeds of type {type(feeds).__name__}: expected a FeedSpec, a CalibrationDataReader or an "
        "iterable of {input name: array} dicts"
    )


def _replayable(feeds: Feeds, model: ModelProto) -> Iterable[Mapping[str, np.ndarray]]:
    """The same batches again, for a second pass: a FeedSpec draws them again, a list is reread; a
    reader with `rewind()` is rewound; a one-shot iterator or reader cannot be replayed."""
    if feeds is None or isinstance(feeds, FeedSpec | Mapping | list | tuple):
        return _Again(feeds, model)
    if callable(getattr(feeds, "get_next", None)) and callable(getattr(feeds, "rewind", None)):
        feeds.rewind()
        return _Again(feeds, model)
    if isinstance(feeds, Iterable) and iter(feeds) is not feeds:
        return _Again(feeds, model)
    raise OpscopeError(
        "this method runs the batches twice (min/max, then histograms) and these feeds can be read once only",
        hint="pass a list of feed dicts, a FeedSpec, or a CalibrationDataReader with a rewind() method",
    )


@dataclass
class _Again:
    """An iterable that draws `feeds` afresh each time it is iterated."""

    feeds: Feeds
    model: ModelProto

    def __iter__(self) -> Iterator[Mapping[str, np.ndarray]]:
        return batches_of(self.feeds, self.model)


def _minmax_pass(
    source: ModelProto,
    tensors: list[CalibTensor],
    feeds: Feeds,
    runtime: RuntimeConfig,
    base_dir: str | os.PathLike | None,
    progress: Callable[[int, int | None], None] | None,
    engine: Engine,
) -> tuple[dict[str, tuple[np.floating, np.floating]], int]:
    """Run every batch once through the min/max-tapped model; the running min / max per tensor."""
    tapped = without_weight_data(source)  # the weights stay in `source`; the session borrows them
    taps = add_minmax_taps(tapped, tensors)
    data, factory = sessions_for(engine, tapped, runtime, base_dir, weights_from=source)
    names = [n for tap in taps for n in (tap.min_output, tap.max_output)]
    total = _total(feeds)
    acc: dict[str, list] = {}
    done = 0
    for _, values in run_batches(engine, data, factory, batches_of(feeds, source), names, InOrder(names)):
        _fold(acc, taps, values)
        done += 1
        if progress is not None:
            progress(done, total)
    if done == 0:
        raise OpscopeError("no batch to calibrate on: the feeds gave none")
    return {k: (lo, hi) for k, (lo, hi) in acc.items()}, done


def _total(feeds: Feeds) -> int | None:
    if feeds is None:
        return DEFAULT_BATCHES
    if isinstance(feeds, FeedSpec):
        return feeds.batches if feeds.batches is not None else (None if feeds.data else DEFAULT_BATCHES)
    if isinstance(feeds, Mapping):
        return 1
    return len(feeds) if isinstance(feeds, list | tuple) else None


def _fold(acc: dict[str, list], taps: list[MinMaxTap], values: list[np.ndarray]) -> None:
    """Fold one batch into the running (min, max): NaN-ignoring, as onnxruntime's np.nanmin / np.nanmax.

    A tensor's stacked per-iteration values and a branch's "not run" NaN reduce away here; a
    tensor that did not run in this batch (all NaN, or no iteration) leaves its range as it was.
    """
    for k, tap in enumerate(taps):
        lo, hi = values[2 * k].ravel(), values[2 * k + 1].ravel()
        lo, hi = lo[~np.isnan(lo)], hi[~np.isnan(hi)]
        if lo.size == 0 or hi.size == 0:
            continue
        lo, hi = lo.min(), hi.max()
        old = acc.get(tap.tensor.name)
        if old is None:
            acc[tap.tensor.name] = [lo, hi]
        else:
            old[0], old[1] = min(old[0], lo), max(old[1], hi)
