"""Calibration: quantization ranges from one recording, in the forms onnxruntime and TensorRT load.

- `tensors`: the tensors onnxruntime's `quantize_static` calibrates (its own rule), bodies too;
- `taps`: whole-tensor min / max taps on them, carried out of If / Loop / Scan bodies;
- `ranges`: `calibrate`, the min/max pass over every batch and the method's ranges;
- `generation`: `calibrate_generation`, calibrate over a decoder's prefill and decode steps;
- `histograms` / `methods`: fixed-range histograms merged over batches, and percentile /
  entropy / mse ranges from them;
- `export`: onnxruntime's calibration cache, TensorRT's caches, and a QDQ model from our ranges;
- `fp16`: float16 / bfloat16 headroom and a node block list.

A noun, like `analysis` and `findings`: a package named `calibrate` would rebind the API
function `onnx_opscope.calibrate` to itself when imported.
"""

from .export import EXPORT_FORMATS, quantize_qdq, write_ranges
from .generation import GenerationFeeds, calibrate_generation
from .ranges import METHODS, CalibrationResult, calibrate
from .tensors import CalibTensor, default_op_types, onnxruntime_selection, tensors_to_calibrate

__all__ = [
    "EXPORT_FORMATS",
    "METHODS",
    "CalibTensor",
    "CalibrationResult",
    "calibrate",
    "calibrate_generation",
    "GenerationFeeds",
    "default_op_types",
    "onnxruntime_selection",
    "quantize_qdq",
    "tensors_to_calibrate",
    "write_ranges",
]
