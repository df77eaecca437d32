"""Write a rewritten model next to its source's weights and measure what the rewrite costs in quality.

`write_rewrite(source, rewritten, out)` saves `rewritten.model` (external data hard-linked, never
copied: `graph.io.save_model`) and, with `check`, compares it with the source on the same feeds
(`parity`, outputs only): max relative error, cosine, top-1 agreement. `opscope rewrite` is
one `skip_blocks` / `fake_quant` call and this.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from onnx import ModelProto

from ..compare import ParityReport
from ..errors import OpscopeError
from ..files import check_writable
from ..graph.io import ModelLike, save_model
from ..transform import Rewritten
from .feeds import FeedSpec
from .parity import parity
from .session import RuntimeConfig


@dataclass
class WrittenRewrite:
    rewritten: Rewritten
    path: Path
    quality: ParityReport | None  # None when not checked


def write_rewrite(
    source: ModelLike,
    rewritten: Rewritten,
    out: str | os.PathLike,
    *,
    check: bool = True,
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
) -> WrittenRewrite:
    """Save the rewrite at `out` and, with `check`, score it against `source` on `feeds`."""
    out = Path(out)
    if isinstance(source, ModelProto):
        raise OpscopeError(
            "write_rewrite needs the source model's path: its external data and the comparison read it"
        )
    source = Path(source)
    check_writable(out, inputs=[source])
    path = save_model(rewritten.model, out, base_dir=source.parent)
    quality = parity(source, path, feeds=feeds, runtime=runtime, layers=False) if check else None
    return WrittenRewrite(rewritten, path, quality)
