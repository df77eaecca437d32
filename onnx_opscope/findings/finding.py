"""One kind of finding: what the miner says about one (site, role) of one run, and its JSON form.

Every rule of every site kind (the cascade over gemm operands, attention concentration,
expert load, residual-block influence) produces a `Finding`; `save_findings` writes them as
`{"format": "onnx-opscope/findings", "version": 1, "config": ..., "source": ..., "findings": [...]}`
with non-finite numbers as null, `load_findings` reads them back. `source` names the table,
runs and model (sha256) they were mined from, so `report` can refuse another table's findings.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OpscopeError
from .config import MineConfig

FORMAT = "onnx-opscope/findings"
VERSION = 1
ACTIONABLE_TEMPORAL = ("stationary", "memoize", "delta")


@dataclass
class Temporal:
    """What the steps of a run say about one (site, role)."""

    steps: int
    l1_cv: float | None
    stationary: bool
    repeat_share: float | None
    drift: float | None  # mean relative L2 distance of elemsig between consecutive steps
    drift_sigma: float | None
    rule: str  # stationary | memoize | delta | drifting
    condition: str
    exploit: str
    score: float
    guard: str
    reuse: float | None = None  # share of the site's work that reuse skips
    savings: float | None = None  # flop_share x reuse
    est_speedup: float | None = None
    measured_speedup: float | None = None
    measure_note: str = ""


@dataclass
class Finding:
    """One (site, role) of one run: the signals used, the rule that fired and what it is worth."""

    site: str
    op_type: str
    role: str
    run_id: str
    provider: str
    dist: str
    M: int | None
    K: int | None
    N: int | None
    numel: int | None
    steps: int
    signals: dict[str, Any]  # means over steps (kind rules add lists: load shares, cold experts)
    sigma: dict[str, float | None]  # standard deviation over steps (None with one step)
    rule: str
    condition: str
    exploit: str
    score: float
    guard: str
    guard_held: float | None  # share of steps on which the guard held
    stability: str  # stable | watch drift | single step | n/a
    stability_sigma: float | None  # sigma over steps of the rule's score
    est_speedup: float | None = None
    measured_speedup: float | None = None
    measure_note: str = ""
    flop_share: float | None = None
    savings: float | None = None  # share of the known FLOPs the exploit saves
    temporal: Temporal | None = None
    note: str = ""
    kind: str = "gemm"  # the site kind whose rules made it: gemm, attn, route, residual
    action: str = ""  # the command that acts on it, when opscope has one (e.g. `opscope rewrite skip ...`)
    validation: dict | None = None  # the action checked on real feeds (skip candidates: cosine, top1, passed)
    impact: float | None = None  # what `mine` ranks by: rank_score x flop_share (None: the share is unknown)

    @property
    def rank_score(self) -> float:
        """The finding's score: the better of the per-batch and the across-steps score."""
        return max(self.score, self.temporal.score if self.temporal else 0.0)

    @property
    def actionable(self) -> bool:
        """Whether it names something to do: dense, too small and 'none: ...' verdicts do not, nor a
        stationary weight (constant by nature: prepacking it is what runtimes already do)."""
        per_batch = self.rule not in ("dense", "small") and not self.exploit.startswith("none")
        t = self.temporal
        across = (
            t is not None
            and t.rule in ACTIONABLE_TEMPORAL
            and not (t.rule == "stationary" and t.reuse is None)
        )
        return per_batch or across

    @property
    def saves(self) -> float | None:
        """The estimated saving as a share of the model's FLOPs: the larger of the per-batch and the
        across-steps one (None: not a FLOP saving, or the site's FLOPs are unknown)."""
        got = [v for v in (self.savings, self.temporal.savings if self.temporal else None) if v is not None]
        return max(got) if got else None


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        return _clean(x.item())
    return x


def findings_to_dict(
    findings: Sequence[Finding], config: MineConfig | None = None, source: Mapping[str, Any] | None = None
) -> dict:
    """The JSON form; `source` (the table's name, run ids, model and its sha256, see
    `identity.findings_source`) says what the findings were mined from: the run ids default to the findings'."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": asdict(config or MineConfig()),
        "source": {"run_ids": sorted({f.run_id for f in findings}), **(source or {})},
        "findings": [_clean(asdict(f)) for f in findings],
    }


def save_findings(
    findings: Sequence[Finding],
    path: str | os.PathLike,
    config: MineConfig | None = None,
    source: Mapping[str, Any] | None = None,
) -> Path:
    """Write the findings as JSON (non-finite numbers become null), with what they were mined from."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(findings_to_dict(findings, config, source), indent=1, allow_nan=False))
    return p


def load_findings(path: str | os.PathLike) -> list[Finding]:
    """Read findings saved by `save_findings`; a wrong file is an OpscopeError."""
    return read_findings(path)[0]


def read_findings(path: str | os.PathLike) -> tuple[list[Finding], dict | None]:
    """The findings of a saved file and its `source` block (None in files written before it existed)."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise OpscopeError(f"{p}: no such findings file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpscopeError(f"{p}: not a findings file ({type(exc).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise OpscopeError(
            f"{p}: not an onnx-opscope findings file", hint="write one with `opscope mine --json`"
        )
    if d.get("version") != VERSION:
        raise OpscopeError(f"{p}: findings version {d.get('version')} is not {VERSION}")
    names = {f.name for f in fields(Finding)}
    tnames = {f.name for f in fields(Temporal)}
    out = []
    try:
        for item in d["findings"]:
            item = {k: v for k, v in item.items() if k in names}
            t = item.get("temporal")
            item["temporal"] = Temporal(**{k: v for k, v in t.items() if k in tnames}) if t else None
            out.append(Finding(**item))
    except (KeyError, TypeError) as exc:
        raise OpscopeError(f"{p}: malformed findings ({exc})") from None
    source = d.get("source")
    return out, source if isinstance(source, dict) else None
