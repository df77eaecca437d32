"""The measured roofline of the provider a model runs on: memory bandwidth and peak FLOP/s, probed.

Both probes are one-node ONNX models run on the same providers and session options as the
model, timed by onnxruntime's own profiler (the kernel's time, so host-to-device copies of
the feeds are not counted and CUDA needs no change): bandwidth is a large elementwise copy
(y = x + 0 over 64 MiB, 128 MiB moved, far beyond any last-level cache), best of 8; peak
compute is a square fp32 MatMul, best of 5. Best of N, because the question is what the
hardware can do, and on a shared machine every other run is slower for reasons that are not
the op's. The ridge (peak / bandwidth) then says which intensity separates memory- from
compute-bound on this machine, rather than on a datasheet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, TensorProto, helper

from ..errors import OpscopeError
from ..run.session import CPU, RuntimeConfig, resolve_providers
from .events import profile_session
from .roofline import Device

COPY_BYTES = 64 << 20  # one 64 MiB fp32 operand; the copy moves twice that
COPY_REPEATS = 8
MATMUL_REPEATS = 5
MATMUL_N = {CPU: 1024}  # square MatMul side per provider; 4096 elsewhere (GPUs need a big one to fill)
MATMUL_N_DEFAULT = 4096


@dataclass(frozen=True)
class Measured:
    """What the probes measured on one provider: bytes/s and FLOP/s, and how."""

    provider: str
    bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s (fp32)
    source: str

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.bandwidth

    def device(self) -> Device:
        """As a roofline `Device`, for the static roofline's functions and plots."""
        return Device(
            f"measured {self.provider.removesuffix('ExecutionProvider')}",
            self.peak_flops,
            self.bandwidth,
            "fp32",
            self.source,
        )


def _one_node(op: str, inputs: list[tuple[str, list[int]]], extra: list | None = None) -> ModelProto:
    vis = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    names = [n for n, _ in inputs] + [t.name for t in extra or []]
    node = helper.make_node(op, names, ["y"], name="probe")
    graph = helper.make_graph(
        [node],
        "probe",
        vis,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=extra or [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _best(model: ModelProto, feeds: dict[str, np.ndarray], config: RuntimeConfig, repeats: int) -> float:
    trace = profile_session(model, feeds, config, runs=repeats)
    times = [r["probe"] for r in trace.runs if r.get("probe", 0) > 0]
    if not times:
        raise OpscopeError(
            "the roofline probe gave no kernel time", hint="onnxruntime's profiler recorded no node"
        )
    return min(times)


def measure_bandwidth(
    config: RuntimeConfig | None = None, nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS
) -> float:
    """Bytes/s of an elementwise copy of `nbytes` (read + write counted), best of `repeats`."""
    n = max(1, nbytes // 4)
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    model = _one_node("Add", [("x", [n])], [zero])
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    secs = _best(model, {"x": x}, config or RuntimeConfig(), repeats)
    return 2 * n * 4 / secs


def measure_peak(
    config: RuntimeConfig | None = None, n: int | None = None, repeats: int = MATMUL_REPEATS
) -> float:
    """FLOP/s of an n x n x n fp32 MatMul (2 n^3 FLOPs), best of `repeats`."""
    config = config or RuntimeConfig()
    if n is None:
        first = resolve_providers(config.providers, fallback=config.fallback)[0]
        n = MATMUL_N.get(first, MATMUL_N_DEFAULT)
    model = _one_node("MatMul", [("a", [n, n]), ("b", [n, n])])
    rng = np.random.default_rng(0)
    feeds = {"a": rng.random((n, n), dtype=np.float32), "b": rng.random((n, n), dtype=np.float32)}
    return 2.0 * n**3 / _best(model, feeds, config, repeats)


def measure(
    config: RuntimeConfig | None = None, *, nbytes: int = COPY_BYTES, n: int | None = None
) -> Measured:
    """Both probes on `config`'s providers and session options."""
    config = config or RuntimeConfig()
    provider = resolve_providers(config.providers, fallback=config.fallback)[0]
    bw = measure_bandwidth(config, nbytes)
    peak = measure_peak(config, n)
    if not (math.isfinite(bw) and math.isfinite(peak)):
        raise OpscopeError("the roofline probes gave no finite time", hint="run again on a quieter machine")
    threads = "default" if config.threads is None else str(config.threads)
    side = n or MATMUL_N.get(provider, MATMUL_N_DEFAULT)
    source = (
        f"measured on {provider} ({threads} threads): copy of {nbytes >> 20} MiB best of {COPY_REPEATS} "
        f"-> {bw / 1e9:.3g} GB/s; {side}^3 fp32 MatMul best of {MATMUL_REPEATS} -> {peak / 1e9:.3g} GFLOP/s"
    )
    return Measured(provider, bw, peak, source)
