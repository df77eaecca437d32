"""onnx-opscope: where the work goes in an ONNX model, what its hot tensors look like, what pays off."""

from .errors import OpscopeError
from .model import load_model, save_model

__all__ = ["OpscopeError", "load_model", "save_model"]
__version__ = "0.1.0"
