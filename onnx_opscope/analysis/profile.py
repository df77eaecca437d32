"""Measured time per op kind: onnxruntime's profiler over seeded synthetic feeds (`run.feeds`).

On the CPU provider with graph optimizations off and one thread, so that nodes map one to
one onto the analysed graph and the shares repeat from run to run. Floats are U(-1, 1),
integer inputs follow `run.feeds.default_ranges` (valid indices), bools are fair coins;
symbolic dims come from `shapes` / `dims`, else the feeds' defaults (1 on axis 0, 64
elsewhere). The first run warms up and is not counted.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import OpscopeError
from ..graph.io import ModelLike
from ..run.feeds import FeedSpec, synthetic_feeds
from ..run.session import RuntimeConfig, make_session, run


def _numeric_shapes(
    shapes: Mapping[str, Sequence[int | str]], dims: Mapping[str, int]
) -> dict[str, list[int]]:
    out = {}
    for name, shape in shapes.items():
        resolved = []
        for axis, d in enumerate(shape):
            if isinstance(d, str):
                if d not in dims:
                    raise OpscopeError(
                        f"--profile runs the model: dim {axis} of {name!r} is the symbol {d!r}, give it a size",
                        hint=f"--dim {d}=N, or a number in --shape",
                    )
                d = dims[d]
            resolved.append(int(d))
        out[name] = resolved
    return out


def profile_ops(
    model: ModelLike,
    shapes: Mapping[str, Sequence[int | str]] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    runs: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Seconds spent per op kind over `runs` profiled runs (after one warm-up)."""
    dims = dict(dims or {})
    spec = FeedSpec(dist="uniform", seed=seed, shapes=_numeric_shapes(shapes or {}, dims), dims=dims)
    feeds = synthetic_feeds(model, spec)
    with tempfile.TemporaryDirectory(prefix="opscope-prof-") as tmp:
        config = RuntimeConfig(graph_opt="disable", threads=1, profile_prefix=str(Path(tmp) / "prof"))
        sess = make_session(model, config)
        try:
            for _ in range(1 + max(1, runs)):
                run(sess, feeds)
        except OpscopeError as exc:
            raise OpscopeError(
                f"profiling run failed: {exc}",
                hint="give the real input sizes with --shape NAME:D0,D1,... or --dim NAME=V",
            ) from None
        events = json.loads(Path(sess.end_profiling()).read_text())
    runs_ts = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("name") == "model_run")
    after = runs_ts[0][1] if len(runs_ts) > 1 else -1
    out: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time") or e["ts"] < after:
            continue
        op = e.get("args", {}).get("op_name", "?")
        out[op] = out.get(op, 0.0) + e.get("dur", 0) * 1e-6
    return out
