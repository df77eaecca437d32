"""Taps that would change which integer kernels onnxruntime runs: found before recording, left out, reported.

`sites.qdq` and `instrument.qdq` keep taps off the tensors that onnxruntime's QDQ fusions
consume, but a fusion can also hinge on a float tensor. In a weight-only int8 model
`MatMul(x, DequantizeLinear(w)) + b` becomes a float Gemm; a tap on the MatMul's output stops
that fusion, and onnxruntime then turns DQ + MatMul into `MatMulNBits`, an int8 kernel, which
moves the output by 6e-3 of its max (zoo `quantized`). Such a tap cannot be placed without
changing what the model computes, so it is not placed.

The check is static, needs no feeds and runs only on models with quantized ops, at the level
and on the providers the user records with: onnxruntime optimizes the plain model and the
instrumented one (sessions created, nothing run), and the integer kernels of the two graphs
(QLinear*, *Integer*, *Quantize*, MatMulNBits, ...; the tap's own nodes excluded) are counted.
Where the counts differ, the taps of sites with quantized operands are searched by halving
(a few session creations per culprit), each culprit is left out, and the result is checked once
more. Float fusions (Conv + BatchNorm, MatMul + Add) are left alone: they move outputs by
float rounding only (1.2e-7 on ppocrv4_det), within the parity gate's tolerance.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
from onnx import ModelProto

from ..graph.index import ModelIndex
from ..graph.io import ModelLike, load_model
from ..instrument import inject, sites_of
from ..instrument.templates import TAP_PREFIX
from ..sites import Selection, Site
from .session import RuntimeConfig, make_session, resolve_providers

_INTEGER = re.compile(r"^Q[A-Z]|Integer|Quantize|NBits|Bnb4")
_TAP_NODES = ("opscope_",)
_FUSED_FROM = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"}
Unit = tuple[int, str]  # (index in the site list, role)


class KernelChangeWarning(UserWarning):
    """A tap was left out because it would change onnxruntime's integer kernels."""


@dataclass(frozen=True)
class KernelChange:
    """One tap left out: tapping `tensor` (role `role` of `site`) changes onnxruntime's integer kernels."""

    site: str
    role: str
    tensor: str
    graph_opt: str
    change: str  # e.g. "+1 MatMulNBits"

    def describe(self) -> str:
        return (
            f"{self.site} {self.role}: not tapped; tapping {self.tensor!r} changes onnxruntime's integer "
            f"kernels at --opt-level {self.graph_opt} ({self.change})"
        )


def has_quantized_ops(model: ModelProto) -> bool:
    """Whether any node of the model (subgraphs included) is one onnxruntime fuses into an integer kernel:
    (Dynamic)QuantizeLinear, DequantizeLinear, MatMulInteger, ConvInteger. Models made only of fused
    kernels already (QLinear*, MatMulNBits) have nothing a tap could unfuse: they skip the check."""
    return any(n.op_type in _FUSED_FROM for _, _, n in ModelIndex(model).nodes())


def integer_kernels(
    model: ModelLike, runtime: RuntimeConfig, base_dir: str | os.PathLike | None = None
) -> Counter:
    """(domain, op) -> count of the integer kernels in the graph onnxruntime runs for `model` (tap nodes not counted)."""
    with tempfile.TemporaryDirectory(prefix="opscope-kernels-", ignore_cleanup_errors=True) as tmp:
        out = str(Path(tmp) / "optimized.onnx")
        make_session(model, replace(runtime, optimized_model=out), base_dir=base_dir)
        graph = onnx.load(out, load_external_data=False).graph
    return Counter(
        (n.domain, n.op_type)
        for n in graph.node
        if _INTEGER.search(n.op_type) and not n.name.startswith(_TAP_NODES + (TAP_PREFIX,))
    )


def keep_kernels(
    model: ModelLike,
    sites: list[Site],
    runtime: RuntimeConfig,
    base_dir: str | os.PathLike | None = None,
    instrument: Callable[[list[Site]], ModelProto] | None = None,
) -> tuple[list[Site], list[KernelChange]]:
    """`sites` without the taps that change onnxruntime's integer kernels at `runtime`, and what was left out.

    `instrument(sites)` builds the instrumented model (default: `inject` with the default sketches);
    pass the one you will record with, so the same nodes are checked. A model without quantized
    ops, or optimizations off, returns `sites` unchanged without creating a session.
    """
    if runtime.graph_opt == "disable" or not has_quantized_ops(load_model(model)):
        return sites, []
    build = instrument or (lambda chosen: inject(model, chosen, providers=_providers(runtime)).model)
    want = integer_kernels(model, runtime, base_dir)

    def kernels(units: set[Unit]) -> Counter:
        return integer_kernels(build(_only(sites, units)), runtime, base_dir)

    every = {(i, t.role) for i, s in enumerate(sites) for t in s.taps}
    tapped = kernels(every)
    if tapped == want:
        return sites, []
    change = _difference(want, tapped)
    # only taps of sites with quantized operands or ops can change an integer fusion
    suspects = sorted((i, t.role) for i, s in enumerate(sites) for t in s.taps if _near_quantized(s))
    fixed = every - set(suspects)

    def culprits(group: list[Unit]) -> list[Unit]:
        if kernels(fixed | set(group)) == want:
            return []
        if len(group) == 1:
            return group
        half = len(group) // 2
        found = culprits(group[:half]) + culprits(group[half:])
        return found or group  # only together: leave the whole group out

    bad = culprits(suspects)
    if not bad or kernels(every - set(bad)) != want:  # not explained by single taps: leave every suspect out
        bad = suspects
    notes = [
        KernelChange(sites[i].id, role, sites[i].role(role).tensor, runtime.graph_opt, change)
        for i, role in bad
    ]
    return _only(sites, every - set(bad)), notes


def checked_sites(
    model: ModelLike,
    sites: list[Site] | Selection | None,
    runtime: RuntimeConfig,
    base_dir: str | os.PathLike | None,
    instrument: Callable[[list[Site]], ModelProto],
) -> tuple[list[Site] | Selection | None, list[KernelChange]]:
    """`sites` ready for `instrument`, without the taps `keep_kernels` leaves out, each one a warning.
    Models without quantized ops (and optimizations off) pay nothing: `sites` comes back as given."""
    if runtime.graph_opt == "disable" or not has_quantized_ops(load_model(model)):
        return sites, []
    chosen, left_out = keep_kernels(model, sites_of(model, sites), runtime, base_dir, instrument)
    for change in left_out:
        warnings.warn(change.describe(), KernelChangeWarning, stacklevel=3)
    return chosen, left_out


def _providers(runtime: RuntimeConfig) -> list[str]:
    return resolve_providers(runtime.providers, fallback=runtime.fallback)


def _near_quantized(site: Site) -> bool:
    return bool(_INTEGER.search(site.op_type)) or any(t.dequant is not None for t in site.taps)


def _only(sites: list[Site], units: set[Unit]) -> list[Site]:
    """The sites with only the taps in `units` (a site left with none is dropped)."""
    out = []
    for i, s in enumerate(sites):
        taps = tuple(t for t in s.taps if (i, t.role) in units)
        if taps:
            out.append(s.with_taps(taps, s.shape_only))
    return out


def _difference(want: Counter, got: Counter) -> str:
    parts = [
        f"{'+' if got[k] > want[k] else '-'}{abs(got[k] - want[k])} {k[1]}"
        for k in sorted(set(want) | set(got))
    ]
    return ", ".join(p for p in parts if not p[1:].startswith("0 ")) or "different kernels"
