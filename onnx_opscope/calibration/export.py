"""Ranges out, in the forms the quantizers load: onnxruntime's calibration cache, TensorRT's, a QDQ model.

- `ort`: the JSON `quantize_static(..., calibration_cache_path=PATH)` loads (onnxruntime 1.32's
  `load_tensors_data`): `TensorsData.to_dict()` with onnxruntime's own `CalibrationCacheEncoder`,
  plus `"smooth_quant": false`, byte for byte what its `save_tensors_data` writes. quantize_static
  checks the cache's `calibration_method` against its `calibrate_method` argument: minmax and mse
  caches say MinMax, entropy Entropy, percentile Percentile.
- `trt-ep`: a folder with the three files onnxruntime's `write_calibration_table` writes for the
  TensorRT execution provider (calibration.flatbuffers, which `trt_int8_calibration_table_name`
  reads, .json and .cache). That function writes max(lo, hi) as the dynamic range, which is
  max|x| only for a symmetric range, so it is given the symmetric range (-m, m), m = max|lo|, |hi|.
- `trt`: TensorRT's own calibration cache (what `IInt8Calibrator.writeCalibrationCache` writes):
  a `TRT-<version>-EntropyCalibration2` line, then `<tensor>: <scale>` per tensor, the scale
  m / 127 as the big-endian hex of its float32.

Every file is written whole or not at all (`files.atomic_path`).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OpscopeError, did_you_mean
from ..files import atomic_path, check_writable, write_text
from ..graph.io import ModelLike
from .ranges import CalibrationResult

EXPORT_FORMATS = ("ort", "trt", "trt-ep")
TRT_VERSION = 8601
"""The version number in a `trt` cache's header line (TensorRT 8.6.1) unless one is given."""


def _tensors_data(ranges: CalibrationResult | Any):
    return ranges.tensors_data() if isinstance(ranges, CalibrationResult) else ranges


def ort_cache_text(ranges: CalibrationResult | Any) -> str:
    """The JSON text of onnxruntime's calibration cache for `ranges` (a result or a TensorsData)."""
    from onnxruntime.quantization.calibrate import CalibrationCacheEncoder

    payload = _tensors_data(ranges).to_dict()
    payload["smooth_quant"] = False
    return json.dumps(payload, cls=CalibrationCacheEncoder)


def _amax(td) -> float:
    lo, hi = td.range_value
    return float(max(abs(float(np.asarray(lo).ravel()[0])), abs(float(np.asarray(hi).ravel()[0]))))


def trt_cache_text(ranges: CalibrationResult | Any, version: int = TRT_VERSION) -> str:
    """TensorRT's calibration cache: scale = max(|lo|, |hi|) / 127 per tensor, as big-endian float32 hex."""
    lines = [f"TRT-{version}-EntropyCalibration2"]
    for name, td in sorted(_tensors_data(ranges).items()):
        scale = np.float32(_amax(td) / 127.0)
        lines.append(f"{name}: {struct.pack('>f', scale).hex()}")
    return "\n".join(lines) + "\n"


def write_ranges(
    ranges: CalibrationResult | Any,
    path: str | os.PathLike,
    fmt: str = "ort",
    *,
    trt_version: int = TRT_VERSION,
    inputs: tuple = (),
) -> Path:
    """Write `ranges` to `path` as `fmt` (see the module doc); `trt-ep` makes `path` a folder."""
    if fmt not in EXPORT_FORMATS:
        raise OpscopeError(
            f"unknown format {fmt!r}{did_you_mean(fmt, EXPORT_FORMATS)}; choose one of: {', '.join(EXPORT_FORMATS)}"
        )
    path = Path(path)
    check_writable(path, inputs=inputs, replaces=_is_trt_ep_folder if fmt == "trt-ep" else None)
    if fmt == "ort":
        return write_text(path, ort_cache_text(ranges))
    if fmt == "trt":
        return write_text(path, trt_cache_text(ranges, trt_version))
    from onnxruntime.quantization.calibrate import TensorData
    from onnxruntime.quantization.quant_utils import write_calibration_table

    table = {}
    for name, td in _tensors_data(ranges).items():
        m = np.float32(_amax(td))
        table[name] = TensorData(lowest=np.array([-m]), highest=np.array([m]))
    with atomic_path(path) as tmp:
        tmp.mkdir()
        write_calibration_table(table, dir=str(tmp))
    return path


def _is_trt_ep_folder(path: Path) -> bool:
    """An earlier `trt-ep` output (a folder holding only its three files) may be replaced."""
    names = {p.name for p in path.iterdir()}
    return names <= {"calibration.json", "calibration.flatbuffers", "calibration.cache"}


def quantize_qdq(
    model: ModelLike,
    ranges: CalibrationResult | Any,
    out: str | os.PathLike,
    *,
    op_types: list[str] | None = None,
    **quantize_options: Any,
) -> Path:
    """Write the QDQ model onnxruntime's `quantize_static` makes from `ranges` (no calibration of its own).

    The ranges go in as its calibration cache, the route the installed onnxruntime takes for
    precomputed ranges. `quantize_options` are quantize_static's (activation_type, per_channel, ...);
    `op_types` default to the result's (those the ranges were selected for).
    """
    import onnx
    from onnxruntime.quantization import QuantFormat, quantize_static

    out = Path(out)
    check_writable(out, inputs=[model])
    td = _tensors_data(ranges)
    if op_types is None and isinstance(ranges, CalibrationResult):
        op_types = ranges.op_types
    # a path would make quantize_static write `<model>-inferred.onnx` beside the user's model
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    options: dict[str, Any] = {"quant_format": QuantFormat.QDQ, **quantize_options}
    with tempfile.TemporaryDirectory(prefix="opscope_qdq_") as tmp_dir:
        cache = Path(tmp_dir) / "calibration.json"
        cache.write_text(ort_cache_text(td))
        with atomic_path(out) as tmp:
            try:
                _quiet(
                    quantize_static,
                    proto,
                    str(tmp),
                    calibration_data_reader=None,
                    calibration_cache_path=str(cache),
                    calibrate_method=td.calibration_method,
                    op_types_to_quantize=op_types,
                    **options,
                )
            except ValueError as exc:  # options it refuses (e.g. int8 activations with uint8 weights)
                raise OpscopeError(f"onnxruntime's quantize_static: {exc}") from None
    return out


def _quiet(fn, *args, **kwargs) -> Any:
    """Call onnxruntime's quantizer without its 'consider pre-processing' warning on the root logger."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        return fn(*args, **kwargs)
    finally:
        root.setLevel(level)
