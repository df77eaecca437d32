"""onnxruntime's profiler, read per run: the seconds each kernel took in each counted run.

A session with profiling on writes one JSON trace of events; a node's event is called
`<node name>_kernel_time` (cat "Node") and each `session.run` is one `model_run` event. The
first run warms up (allocations, thread pools, first-touch pages) and is not counted; a
kernel that runs several times in one run (a Loop body) is summed within the run. Other
profiling (of other sessions) is never mixed in: each session writes its own file, in a
temporary folder removed afterwards.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import OpscopeError
from ..graph.io import ModelLike
from ..run.session import RuntimeConfig, make_session, run

_SUFFIX = "_kernel_time"


@dataclass
class Trace:
    """Kernel seconds per counted run, what each kernel is, and the session that ran them."""

    runs: list[dict[str, float]]  # one dict per counted run: kernel (node name) -> seconds
    wall: list[float]  # seconds of each counted `model_run`
    op_types: dict[str, str] = field(default_factory=dict)  # kernel -> the op onnxruntime ran
    providers: dict[str, str] = field(default_factory=dict)  # kernel -> its execution provider
    session_providers: list[str] = field(default_factory=list)

    def mean(self) -> dict[str, float]:
        """Each kernel's mean seconds per run (0 in a run it did not run in, e.g. an If branch). The
        mean, not the median: means add up, so the kernels' times sum to the runs' mean kernel time
        (medians of 690 captcha_crnn kernels summed to 34 ms of runs whose kernels took 78-107 ms)."""
        names = {k for r in self.runs for k in r}
        return {k: float(np.mean([r.get(k, 0.0) for r in self.runs])) for k in sorted(names)}


def profile_session(
    model: ModelLike,
    feeds: Mapping[str, np.ndarray],
    config: RuntimeConfig,
    runs: int = 3,
    optimized_model: str | None = None,
) -> Trace:
    """Run `model` once to warm up and `runs` more times with onnxruntime's profiler on.

    `optimized_model`: save the graph onnxruntime runs there (to map its kernels back onto the
    model's nodes); when the provider cannot save it (compiled kernels), the run goes on without.
    """
    with tempfile.TemporaryDirectory(prefix="opscope-prof-") as tmp:
        cfg = replace(config, profile_prefix=str(Path(tmp) / "prof"), optimized_model=optimized_model)
        try:
            sess = make_session(model, cfg)
        except OpscopeError:
            if optimized_model is None:
                raise
            sess = make_session(model, replace(cfg, optimized_model=None))
        try:
            for _ in range(1 + max(1, runs)):
                run(sess, feeds)
        except OpscopeError as exc:
            raise OpscopeError(
                f"profiling run failed: {exc}",
                hint="give the real input sizes with --shape NAME:D0,D1,... or --dim NAME=V",
            ) from None
        events = json.loads(Path(sess.end_profiling()).read_text())
    return _parse(events, list(sess.get_providers()))


def _parse(events: list[dict], session_providers: list[str]) -> Trace:
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("name") == "model_run")
    counted = spans[1:] if len(spans) > 1 else spans
    trace = Trace(
        [{} for _ in counted], [(b - a) * 1e-6 for a, b in counted], session_providers=session_providers
    )
    starts = [a for a, _ in counted]
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") != "Node" or not name.endswith(_SUFFIX):
            continue
        k = int(np.searchsorted(starts, e["ts"], side="right")) - 1
        if k < 0 or e["ts"] > counted[k][1]:
            continue  # the warm-up run, or outside any run
        kernel = name[: -len(_SUFFIX)]
        trace.runs[k][kernel] = trace.runs[k].get(kernel, 0.0) + e.get("dur", 0) * 1e-6
        args = e.get("args", {})
        trace.op_types.setdefault(kernel, str(args.get("op_name", "?")))
        trace.providers.setdefault(kernel, str(args.get("provider", "")))
    return trace
