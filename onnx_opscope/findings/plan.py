"""The plan: what a finding is worth. Estimated speed-up, FLOP share and savings, and a measured
speed-up from timing a real implementation of the exploit against dense at the site's shape.

Estimates (fp32 tensors assumed, the table has no dtype):
- sparse GEMM: 1 / max(density, 1e-3);
- delta-compute: deltas below tau x RMS are skipped; with Gaussian deltas of relative RMS r
  (sqrt(adj) for adjacent rows, the step drift across steps) a share keep = erfc(tau / (r sqrt 2))
  survives and the work is keep of dense: 1 / max(keep, 1e-3);
- memoize: the repeated share r of the steps costs a hash only: 1 / (1 - r);
- per-channel int quant and concentrated-value quantization: 4 (fp32 -> int8 bytes, an upper bound);
- few discrete levels: 32 / ceil(log2(levels)) (bytes of a LUT index, an upper bound);
- heavy tails, positional structure, prepack, dense: not estimable from sketches (None).

Savings = the site's FLOP share x the reuse (the share of the site's work the exploit skips:
1 - 1/speed-up for sparse and delta, the repeat share for memoize and prepack). Quantization
saves bytes and cycles per FLOP, not FLOPs, so it has no FLOP savings.

Measurement is bounded (M, K, N capped at `measure_cap`, best of `measure_repeats`) and uses
numpy (BLAS) for dense and scipy.sparse for the sparse side; exploits numpy cannot run
faster (int8, LUT) are left unmeasured with a note rather than timed through a proxy.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import OpscopeError
from ..run.table import sidecar_paths
from .config import MineConfig
from .finding import Finding

LHS_ROLES = ("lhs", "a", "in", "x", "lhs_float")  # the operand that multiplies from the left
RHS_ROLES = ("rhs", "b", "weight", "w", "r")


@dataclass
class Costs:
    """What is known about the cost of the model: site FLOPs and, from the analyzer, per-op records."""

    site_flops: dict[str, float] = field(default_factory=dict)
    total_flops: float | None = None
    ops: list[dict] = field(default_factory=list)  # analyzer records: node, op_type, flops, bytes, intensity
    ridge: float | None = None
    origin: str | None = None  # the cost file they were read from (None: given in memory)
    model: str | None = None  # the model they price, and its sha256, where the costs name it
    model_sha256: str | None = None

    def share(self, site: str) -> float | None:
        f = self.site_flops.get(site)
        if f is None or not math.isfinite(f) or not self.total_flops:
            return None
        return min(f / self.total_flops, 1.0)


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _from_records(records: list[dict], costs: Costs) -> None:
    """Analyzer records (node, flops, bytes, ...) or sidecar rows (site, flops)."""
    analyzer = any("bytes" in r or "intensity" in r for r in records)
    for r in records:
        key = r.get("site") or r.get("node")
        f = _finite(r.get("flops"))
        if key is not None and f is not None:
            costs.site_flops.setdefault(str(key), f)
    if analyzer:
        costs.ops = [r for r in records if r.get("counted", True)]
        total = sum(f for r in costs.ops if (f := _finite(r.get("flops"))) is not None)
        costs.total_flops = total or costs.total_flops


def _read_cost_file(path: Path) -> tuple[list[dict], float | None]:
    records, ridge, _ = _read_costs_and_model(path)
    return records, ridge


def _read_costs_and_model(path: Path) -> tuple[list[dict], float | None, tuple[str | None, str | None]]:
    """(records, ridge, (model, model sha256)) of a cost file; the analyzer writes its model's sha256 as a
    top-level key in JSON and a column in CSV / Parquet."""
    import json

    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if not path.is_file():
        raise OpscopeError(f"--costs {path}: no such file")
    try:
        suffix = path.suffix.lower()
        if suffix == ".json":
            d = json.loads(path.read_text())
            if isinstance(d, dict) and "records" in d:
                model = (d.get("model"), d.get("model_sha256") or None)
                return list(d["records"]), _finite((d.get("device") or {}).get("ridge")), model
            if isinstance(d, dict):
                return [{"site": k, "flops": v} for k, v in d.items()], None, (None, None)
            return list(d), None, (None, None)
        rows = pq.read_table(path).to_pylist() if suffix == ".parquet" else pacsv.read_csv(path).to_pylist()
        return rows, None, (None, (rows[0].get("model_sha256") or None) if rows else None)
    except (OSError, ValueError, pa.ArrowInvalid) as exc:
        raise OpscopeError(f"--costs {path}: not a readable cost table ({type(exc).__name__})") from None


def load_costs(costs: Any = None, table_path: str | os.PathLike | None = None) -> Costs:
    """Normalise every accepted form of costs; the table's `.sites.csv` sidecar fills the gaps.

    Accepted: None, a dict site -> flops, a path (sidecar CSV, or `opscope analyze` output as
    JSON / CSV / Parquet), a pyarrow Table, a list of records, or an analyzer Report.
    """
    out = Costs()
    ridge = None
    if costs is None:
        pass
    elif isinstance(costs, Mapping):
        out.site_flops = {str(k): v for k, v in ((k, _finite(v)) for k, v in costs.items()) if v is not None}
    elif isinstance(costs, str | os.PathLike):
        records, ridge, (out.model, out.model_sha256) = _read_costs_and_model(Path(costs))
        _from_records(records, out)
        out.origin = str(costs)
    elif isinstance(costs, pa.Table):
        _from_records(costs.to_pylist(), out)
        if "model_sha256" in costs.column_names and costs.num_rows:
            out.model_sha256 = costs.column("model_sha256")[0].as_py() or None
    elif hasattr(costs, "to_records"):  # costs.Report
        _from_records(costs.to_records(), out)
        ridge = getattr(costs, "ridge", None)
        out.model = getattr(costs, "model", None)
        out.model_sha256 = getattr(costs, "model_sha256", None) or None
    elif isinstance(costs, list):
        _from_records(costs, out)
    else:
        raise TypeError(f"costs: unsupported type {type(costs).__name__}")
    out.ridge = ridge
    if table_path is not None:
        sidecar = sidecar_paths(table_path)[0]
        if sidecar.is_file():
            try:
                rows, _ = _read_cost_file(sidecar)
            except OpscopeError:
                rows = []
            for r in rows:
                f = _finite(r.get("flops"))
                if r.get("site") is not None and f is not None:
                    out.site_flops.setdefault(str(r["site"]), f)
    if out.total_flops is None and out.site_flops:
        out.total_flops = sum(out.site_flops.values()) or None
    return out


# --------------------------------------------------------------------------------------------
# estimates


def delta_keep(rel_rms: float | None, tau: float) -> float | None:
    """Share of delta entries above tau x RMS when deltas are Gaussian with relative RMS `rel_rms`."""
    if rel_rms is None or not math.isfinite(rel_rms):
        return None
    if rel_rms <= 0:
        return 0.0
    return math.erfc(tau / (rel_rms * math.sqrt(2.0)))


def estimate(f: Finding, cfg: MineConfig) -> tuple[float | None, float | None]:
    """(estimated speed-up, reuse) of the per-batch exploit; reuse is the share of FLOPs skipped."""
    s = f.signals
    if f.rule == "sparse" and s.get("density") is not None:
        est = 1.0 / max(s["density"], 1e-3)
        return est, 1.0 - 1.0 / est
    if f.rule == "coherent" and s.get("adj") is not None:
        keep = delta_keep(math.sqrt(max(s["adj"], 0.0)), cfg.delta_tau)
        est = 1.0 / max(keep, 1e-3)
        return est, 1.0 - 1.0 / est
    if f.rule in ("outlier", "concentrated"):
        return 4.0, None
    if f.rule == "levels" and s.get("levels"):
        bits = max(1, math.ceil(math.log2(max(s["levels"], 2.0))))
        return 32.0 / bits, None
    return None, None


def estimate_temporal(f: Finding, cfg: MineConfig) -> tuple[float | None, float | None]:
    t = f.temporal
    if t is None:
        return None, None
    if t.rule == "memoize" and t.repeat_share is not None:
        r = min(t.repeat_share, 1.0 - 1.0 / max(t.steps, 2))
        return 1.0 / (1.0 - r), r
    if t.rule == "delta":
        keep = delta_keep(t.drift, cfg.delta_tau)
        if keep is None:
            return None, None
        est = 1.0 / max(keep, 1e-3)
        return est, 1.0 - 1.0 / est
    if t.rule == "stationary":
        if f.role in RHS_ROLES:  # a weight: prepacking saves its layout work, not GEMM FLOPs
            return None, None
        return None, t.repeat_share if t.repeat_share is not None else 1.0 - 1.0 / t.steps
    return None, None  # drifting: nothing across steps to save


def annotate(f: Finding, costs: Costs, cfg: MineConfig, measure: bool = False) -> Finding:
    """Fill in the FLOP share, estimates, savings and (optionally) measured speed-ups, in place."""
    f.flop_share = costs.share(f.site)
    f.est_speedup, reuse = estimate(f, cfg)
    f.savings = None if f.flop_share is None or reuse is None else f.flop_share * reuse
    if f.temporal is not None:
        t = f.temporal
        t.est_speedup, t.reuse = estimate_temporal(f, cfg)
        t.savings = None if f.flop_share is None or t.reuse is None else f.flop_share * t.reuse
    if measure:
        f.measured_speedup, f.measure_note = measure_exploit(f, cfg)
        if f.temporal is not None:
            f.temporal.measured_speedup, f.temporal.measure_note = measure_temporal(f, cfg)
    return f


# --------------------------------------------------------------------------------------------
# measurement


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm up
    best = math.inf
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _shape(f: Finding, cfg: MineConfig) -> tuple[int, int, int] | None:
    if None in (f.M, f.K, f.N):
        return None
    cap = max(cfg.measure_cap, 1)
    return min(f.M, cap), min(f.K, cap), min(f.N, cap)


def _sparse_operand(rng: np.random.Generator, shape: tuple[int, int], density: float):
    import scipy.sparse as sp

    dense = rng.standard_normal(shape, dtype=np.float32)
    dense[rng.random(shape) >= density] = 0.0
    return dense, sp.csr_matrix(dense)


def time_sparse_gemm(m: int, k: int, n: int, density: float, side: str = "lhs", repeats: int = 3,
                     seed: int = 0) -> float:  # fmt: skip
    """dense time / sparse time of an (m x k) @ (k x n) GEMM whose `side` operand has `density`.

    The sparse operand is a scipy CSR matrix built from a tensor with that density; dense is
    numpy's BLAS matmul on the same values.
    """
    rng = np.random.default_rng(seed)
    if side == "lhs":
        a_dense, a_sp = _sparse_operand(rng, (m, k), density)
        b = rng.standard_normal((k, n), dtype=np.float32)
        t_dense = _best(lambda: a_dense @ b, repeats)
        t_sparse = _best(lambda: a_sp @ b, repeats)
    else:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b_dense, b_sp = _sparse_operand(rng, (k, n), density)
        b_t = b_sp.T.tocsr()
        t_dense = _best(lambda: a @ b_dense, repeats)
        t_sparse = _best(lambda: (b_t @ a.T).T, repeats)
    return t_dense / t_sparse


def time_delta_gemm(m: int, k: int, n: int, keep: float, repeats: int = 3, seed: int = 0) -> float:
    """dense time / delta time, delta = y_prev + csr(x - x_prev, thresholded to `keep`) @ W."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    y_prev = x @ w
    _, d_sp = _sparse_operand(rng, (m, k), keep)
    t_dense = _best(lambda: x @ w, repeats)
    t_delta = _best(lambda: y_prev + d_sp @ w, repeats)
    return t_dense / t_delta


def time_memoize(m: int, k: int, n: int, repeat_share: float, repeats: int = 3, seed: int = 0) -> float:
    """dense time / memoized time: every step hashes its input; misses also run the GEMM."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    t_dense = _best(lambda: x @ w, repeats)
    t_hash = _best(lambda: hashlib.blake2b(memoryview(x).cast("B"), digest_size=16).digest(), repeats)
    return t_dense / ((1.0 - repeat_share) * (t_dense + t_hash) + repeat_share * t_hash)


def _have_scipy() -> bool:
    try:
        import scipy.sparse  # noqa: F401
    except ImportError:
        return False
    return True


NO_SCIPY = "not measured: scipy is not installed (pip install 'onnx-opscope[measure]')"


def measure_exploit(f: Finding, cfg: MineConfig) -> tuple[float | None, str]:
    """Measured speed-up of the per-batch exploit at the site's (capped) shape, with a note."""
    shape = _shape(f, cfg)
    if f.rule not in ("sparse", "coherent"):
        return None, "not measured: numpy has no faster kernel for this exploit; measure on the target EP"
    if shape is None:
        return None, "not measured: the site has no GEMM dims (M, K, N)"
    if not _have_scipy():
        return None, NO_SCIPY
    m, k, n = shape
    capped = f" at {m}x{k}x{n}" + (" (capped)" if (m, k, n) != (f.M, f.K, f.N) else "")
    if f.rule == "sparse":
        side = "lhs" if f.role in LHS_ROLES else "rhs" if f.role in RHS_ROLES else None
        if side is None:
            return None, f"not measured: a sparse {f.role!r} is not a GEMM operand of this site"
        d = max(f.signals["density"] or 0.0, 1e-3)
        return time_sparse_gemm(m, k, n, d, side, cfg.measure_repeats), f"scipy CSR vs numpy dense{capped}"
    keep = delta_keep(math.sqrt(max(f.signals.get("adj") or 0.0, 0.0)), cfg.delta_tau) or 1e-3
    return (time_delta_gemm(m, k, n, max(keep, 1e-3), cfg.measure_repeats),
            f"y_prev + CSR(delta, keep {keep:.2f}) @ W vs dense{capped}")  # fmt: skip


def measure_temporal(f: Finding, cfg: MineConfig) -> tuple[float | None, str]:
    t = f.temporal
    shape = _shape(f, cfg)
    if t is None or t.rule not in ("memoize", "delta"):
        return None, "not measured"
    if shape is None:
        return None, "not measured: the site has no GEMM dims (M, K, N)"
    m, k, n = shape
    if t.rule == "delta" and not _have_scipy():
        return None, NO_SCIPY
    if t.rule == "memoize":
        r = t.repeat_share or 0.0
        return time_memoize(m, k, n, r, cfg.measure_repeats), f"blake2b hash + GEMM on misses at {m}x{k}x{n}"
    keep = max(delta_keep(t.drift, cfg.delta_tau) or 1e-3, 1e-3)
    return time_delta_gemm(m, k, n, keep, cfg.measure_repeats), f"delta GEMM, keep {keep:.2f}, at {m}x{k}x{n}"
