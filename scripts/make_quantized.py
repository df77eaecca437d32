"""Build quantized test models from float ones with onnxruntime's own quantizer.

Variants (`VARIANTS`): static QDQ with uint8 or int8 activations, per tensor or per channel;
static QOperator (QLinearConv / QLinearMatMul); dynamic int8 (DynamicQuantizeLinear +
MatMulInteger / ConvInteger). Static ones are calibrated on synthetic feeds from
`onnx_opscope.run.feeds` (the same ones `record` uses), so a model and its feeds are
reproducible. Files land in `models/derived/` (git-ignored; override with `--dest`).

    python scripts/make_quantized.py models/cnn.onnx                 # every variant
    python scripts/make_quantized.py models/real/captcha_crnn.onnx --variant qdq_s8_pc
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from onnx_opscope.graph.io import load_model
from onnx_opscope.run.feeds import FeedSpec, iter_feeds

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = ROOT / "models" / "derived"

# name -> (format or "dynamic", activation type, per channel)
VARIANTS: dict[str, tuple[str, QuantType, bool]] = {
    "qdq_u8": ("qdq", QuantType.QUInt8, False),
    "qdq_s8": ("qdq", QuantType.QInt8, False),
    "qdq_u8_pc": ("qdq", QuantType.QUInt8, True),
    "qdq_s8_pc": ("qdq", QuantType.QInt8, True),
    "qop_u8": ("qop", QuantType.QUInt8, False),
    "dynamic": ("dynamic", QuantType.QUInt8, False),
}


class _Feeds(CalibrationDataReader):
    def __init__(self, feeds: list[dict]):
        self._it = iter(feeds)

    def get_next(self) -> dict | None:
        return next(self._it, None)


def quantize(src: Path, variant: str, dest: Path = DEFAULT_DEST, batches: int = 4) -> Path:
    """Write `<dest>/<src stem>.<variant>.onnx` (kept when it is already there) and return its path."""
    fmt, act, per_channel = VARIANTS[variant]
    out = dest / f"{src.stem}.{variant}.onnx"
    if out.is_file():
        return out
    dest.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.onnx")
    if fmt == "dynamic":
        quantize_dynamic(src, tmp, weight_type=QuantType.QInt8)
    else:
        feeds = list(iter_feeds(load_model(src), FeedSpec(batches=batches)))
        quantize_static(
            src,
            tmp,
            _Feeds(feeds),
            quant_format=QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator,
            activation_type=act,
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
        )
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path, help="float .onnx models")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="default: every variant")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = ap.parse_args(argv)
    for src in args.models:
        for variant in args.variant or VARIANTS:
            print(quantize(src, variant, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
