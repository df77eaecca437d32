"""What a parity check found: per-output metrics, per-statistic layer divergences, the verdict."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .outputs import within

DEFAULT_TOL = 1e-3


@dataclass
class ParityReport:
    """What `run.parity` found; `passed` is the verdict (every output within `tol` of A's), `format()` prints it."""

    a: str
    b: str
    tol: float
    layer_tol: float
    batches: int = 0
    outputs: dict[str, dict] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)  # one per (site, role, stat), execution order
    first_divergent: dict | None = None
    sites_compared: int = 0
    sites_only_in_a: list[str] = field(default_factory=list)
    runtime: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(within(m, self.tol, 0.0) for m in self.outputs.values())

    def summary(self) -> dict:
        """The worst output: max_abs, max_rel, cosine, top1 and top5 (min over the logits-like outputs),
        kl (max)."""
        ms = list(self.outputs.values())

        def worst(key: str, pick=min):
            got = [m[key] for m in ms if m.get(key) is not None]
            return pick(got) if got else None

        return {
            "max_abs": max((m["max_abs"] for m in ms), default=float("nan")),
            "max_rel": max((m["max_rel"] for m in ms), default=float("nan")),
            "cosine": min((m["cosine"] for m in ms), default=float("nan")),
            "top1": worst("top1"),
            "top5": worst("top5"),
            "kl": worst("kl", max),
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        d["summary"] = self.summary()
        d["outputs"] = {
            k: {a: b for a, b in v.items() if not a.startswith("_")} for k, v in self.outputs.items()
        }
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=float)

    def format(self, top: int = 5) -> str:
        lines = [f"parity: {self.a}  vs  {self.b}  ({self.batches} batches, tol {self.tol:g})"]
        lines.append(f"  {'output':<28} {'max abs':>10} {'max rel':>10} {'cosine':>10} {'top-1':>7}  status")
        for name, m in self.outputs.items():
            ok = within(m, self.tol, 0.0)
            top1 = "-" if m["top1"] is None else f"{m['top1']:.1%}"
            extra = f"  ({m['nonfinite_mismatch']} NaN/Inf mismatches)" if m["nonfinite_mismatch"] else ""
            shape = f"  (shapes {m['shape_a']} vs {m['shape_b']})" if "shape_a" in m else ""
            lines.append(
                f"  {name[:28]:<28} {m['max_abs']:>10.3g} {m['max_rel']:>10.3g} {m['cosine']:>10.6f} "
                f"{top1:>7}  {'ok' if ok else 'DIFF'}{extra}{shape}"
            )
        if self.layers or self.sites_compared:
            lines.append(
                f"  layers: {self.sites_compared} sites, {len(self.layers)} statistics compared "
                f"(layer tol {self.layer_tol:g})"
            )
            if self.first_divergent:
                f = self.first_divergent
                lines.append(
                    f"  first divergent site: {f['site']} ({f['op_type']}, {f['role']}, {f['stat']}): "
                    f"divergence {f['divergence']:.3g}"
                )
                worst = sorted(self.layers, key=lambda r: -r["divergence"])[:top]
                lines.append("  largest divergences: " + ", ".join(
                    f"{r['site']}:{r['role']}:{r['stat']} {r['divergence']:.3g}" for r in worst))  # fmt: skip
            else:
                lines.append("  no site diverges beyond the layer tolerance")
        if self.sites_only_in_a:
            lines.append(f"  sites removed in B: {', '.join(self.sites_only_in_a[:top])}"
                         + (f", ...and {len(self.sites_only_in_a) - top} more" if len(self.sites_only_in_a) > top else ""))  # fmt: skip
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)
