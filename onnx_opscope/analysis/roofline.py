"""Roofline: device presets (with where each number comes from) and op classification.

An op whose arithmetic intensity (FLOPs per byte moved) is at or above the device's ridge
point (peak FLOP/s / memory bandwidth) is compute-bound, below it memory-bound. Peaks are
the dense (no structured sparsity) tensor-core figures for the listed dtype; the CPU preset
is a current server part at its base clock. `--ridge` overrides the ridge point (and so the
bandwidth used for time estimates: peak / ridge).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import OpscopeError, did_you_mean, listing
from ..shapes.symbolic import Dimlike, Poly


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    dtype: str
    source: str

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.bandwidth


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "cpu",
            96 * 2.4e9 * 32,
            12 * 4800e6 * 8,
            "fp32",
            "AMD EPYC 9654: 96 cores x 2.4 GHz base x 32 FP32 FLOP/cycle (2x256-bit FMA), "
            "12 channels DDR5-4800 = 460.8 GB/s -> ridge ~16",
        ),
        Device(
            "h100",
            989e12,
            3.35e12,
            "bf16",
            "NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 -> ~295",
        ),
        Device(
            "h100-pcie",
            756e12,
            2.0e12,
            "bf16",
            "NVIDIA H100 PCIe datasheet: 756 TFLOP/s bf16 dense, 2.0 TB/s HBM2e -> ~378",
        ),
        Device(
            "h200",
            989e12,
            4.8e12,
            "bf16",
            "NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e -> ~206",
        ),
        Device(
            "a100",
            312e12,
            2.039e12,
            "bf16",
            "NVIDIA A100 SXM 80GB datasheet: 312 TFLOP/s bf16 dense, 2.039 TB/s HBM2e -> ~153",
        ),
        Device(
            "a10",
            125e12,
            600e9,
            "bf16",
            "NVIDIA A10 datasheet: 125 TFLOP/s bf16 dense, 600 GB/s GDDR6 -> ~208",
        ),
        Device(
            "l4",
            121e12,
            300e9,
            "bf16",
            "NVIDIA L4 datasheet: 121 TFLOP/s bf16 dense (242 sparse), 300 GB/s GDDR6 -> ~403",
        ),
        Device(
            "t4",
            65e12,
            320e9,
            "fp16",
            "NVIDIA T4 datasheet: 65 TFLOP/s fp16 tensor core, 320 GB/s GDDR6 -> ~203",
        ),
        Device(
            "mi300x",
            1307.4e12,
            5.3e12,
            "bf16",
            "AMD Instinct MI300X datasheet: 1307.4 TFLOP/s bf16 dense, 5.3 TB/s HBM3 -> ~247",
        ),
    )
}


def get_device(name: str = "cpu", ridge: float | None = None) -> Device:
    """The preset called `name`; with `ridge`, its bandwidth is set to peak / ridge."""
    key = name.lower()
    if key not in DEVICES:
        raise OpscopeError(
            f"unknown device {name!r}{did_you_mean(key, DEVICES)}",
            hint=f"devices: {listing(DEVICES)}; or give --ridge FLOP_PER_BYTE",
        )
    dev = DEVICES[key]
    if ridge is not None:
        if ridge <= 0:
            raise OpscopeError(f"--ridge must be > 0, got {ridge}")
        dev = replace(
            dev, bandwidth=dev.peak_flops / ridge, source=f"{dev.source}; ridge overridden to {ridge:g}"
        )
    return dev


def intensity(flops: Dimlike | None, nbytes: Dimlike | None) -> float | None:
    """FLOPs per byte; None when unknown or when it still depends on a symbol."""
    if flops is None or nbytes is None:
        return None
    if isinstance(flops, Poly) or isinstance(nbytes, Poly):
        if isinstance(flops, Poly) and isinstance(nbytes, Poly):
            return flops.ratio_to(nbytes)
        return None
    if nbytes == 0:
        return None
    return float(flops) / float(nbytes)


def classify(flops: Dimlike | None, nbytes: Dimlike | None, ridge: float) -> str:
    """'compute', 'memory', 'none' (no FLOPs, no bytes: views) or 'unknown'."""
    if flops is None or nbytes is None:
        return "unknown"
    if flops == 0:
        return "none" if nbytes == 0 else "memory"
    ai = intensity(flops, nbytes)
    if ai is None:
        return "unknown" if nbytes != 0 else "compute"
    return "compute" if ai >= ridge else "memory"


def est_time(flops: float | None, nbytes: float | None, device: Device) -> float | None:
    """Roofline time in seconds: max(FLOPs / peak, bytes / bandwidth)."""
    if flops is None or nbytes is None:
        return None
    return max(flops / device.peak_flops, nbytes / device.bandwidth)


def attainable(ai: float, device: Device) -> float:
    """The roofline: the FLOP/s an op of arithmetic intensity `ai` (FLOP/byte) can reach on `device`,
    min(peak, bandwidth x ai): the memory slope left of the ridge, the compute ceiling right of it."""
    return min(device.peak_flops, device.bandwidth * ai)
