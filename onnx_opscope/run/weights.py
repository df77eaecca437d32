"""Weight plans checked end to end: menus, both allocators per budget, each plan applied and scored.

Per-layer error is a proxy: what decides a precision is the model's outputs. So every budget's
plan is applied (`transform.apply_weight_plan`), saved beside the source's weights and compared
with the source on the same feeds (`parity`: cosine, max relative error, top-1 / top-5
agreement and KL for logits-like outputs). The recommended budget is the smallest whose plan
keeps the worst output's cosine at or above `min_cosine` and, for logits-like outputs, top-1
agreement at or above `min_top1`; none, when none does.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from onnx import ModelProto

from ..errors import OpscopeError
from ..graph.io import ModelLike, load_model
from ..transform import Rewritten, apply_weight_plan, stored_menus
from ..weights.menu import menu_seconds
from ..weights.plan import DEFAULT_BUDGETS, DEFAULT_SVD_CAP, LayerMenu, frontier, plan_for, weight_menus
from .feeds import FeedSpec
from .rewrite import write_rewrite
from .session import RuntimeConfig

DEFAULT_MIN_COSINE = 0.99
DEFAULT_MIN_TOP1 = 0.95  # a cosine of 0.99 still let a tiny LM's top-1 fall to 80%


@dataclass
class BudgetResult:
    """One budget: both allocators' Σ error and bytes, the plan kept, what it stores and does."""

    budget: float
    greedy: dict
    dado: dict
    method: str  # the allocator whose choice was kept
    plan: dict
    stored_bytes: int | None = None  # as apply_weight_plan stored it (None: not applied)
    quality: dict | None = None  # the parity summary (None: not checked)


@dataclass
class WeightPlans:
    model: str
    dense_bytes: int
    storable: bool
    min_cosine: float
    min_top1: float
    budgets: list[BudgetResult]
    menus: list[dict] = field(default_factory=list)  # per layer: weight, op, shape, options (for plots)
    seconds: dict = field(default_factory=dict)

    @property
    def recommended(self) -> BudgetResult | None:
        """The smallest budget whose plan keeps the outputs (`passes`); None if none was checked or passed."""
        ok = [b for b in self.budgets if self.passes(b)]
        return min(ok, key=lambda b: b.budget) if ok else None

    def passes(self, b: BudgetResult) -> bool:
        q = b.quality
        if not q:
            return False
        return q["cosine"] >= self.min_cosine and (q.get("top1") is None or q["top1"] >= self.min_top1)

    def to_dict(self) -> dict:
        """The plan of the recommended budget (or the largest one) at the top level, as
        `apply_weight_plan` reads it, with the frontier, the menus and the checks beside it."""
        chosen = self.recommended or (max(self.budgets, key=lambda b: b.budget) if self.budgets else None)
        top = dict(chosen.plan) if chosen else {"layers": []}
        return {
            **top,
            "model": self.model,
            "recommended_budget": self.recommended.budget if self.recommended else None,
            "min_cosine": self.min_cosine,
            "min_top1": self.min_top1,
            "storable": self.storable,
            "frontier": [
                {k: v for k, v in b.__dict__.items() if k != "plan"}
                | {"plan_bytes": b.plan["bytes"], "passes": self.passes(b)}
                for b in self.budgets
            ],
            "menus": self.menus,
            "seconds": self.seconds,
        }

    def write(self, path: str | os.PathLike) -> Path:
        from ..files import write_text

        return write_text(path, json.dumps(self.to_dict(), indent=1, default=float) + "\n")


def _menu_rows(menus: Sequence[LayerMenu]) -> list[dict]:
    return [
        {
            "weight": m.view.name,
            "op": m.view.op,
            "shape": list(m.view.shape),
            "dense_bytes": m.view.dense_bytes,
            "seconds": menu_seconds(m.options),  # the layer's menu, SVDs included
            "options": [
                {"kind": o.kind, "label": o.label, "error": o.error, "bytes": o.bytes} for o in m.options
            ],
        }
        for m in menus
    ]


def plan_weights(
    model: ModelLike,
    *,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    storable: bool = False,
    check: bool = True,
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    min_cosine: float = DEFAULT_MIN_COSINE,
    min_top1: float = DEFAULT_MIN_TOP1,
    svd_cap: int | None = DEFAULT_SVD_CAP,
    min_elements: int = 1024,
    progress: Callable[[int, int | None, str], None] | None = None,
) -> WeightPlans:
    """Menus of every weight, greedy and DADO at each budget, and (with `check`) each budget's plan
    applied and scored against the model on `feeds`.

    `storable`: plan only options this model can store as such (bytes as `apply_weight_plan` stores
    them; int4 blocks need opset 21 or a MatMul, ...), so the file shrinks as planned; otherwise
    bytes are the options' own (what a runtime with a kernel for each would hold).
    """
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise OpscopeError(f"budgets {list(budgets)}: expected fractions of the dense bytes in (0, 1]")
    if check and isinstance(model, ModelProto):
        raise OpscopeError("checking a plan needs the model's path (its outputs are compared on disk)")
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    menus = weight_menus(model, svd_cap=svd_cap, min_elements=min_elements, progress=progress)
    if not menus:
        raise OpscopeError(f"no float weight of {min_elements} elements or more to plan")
    proto = load_model(model, check_external=False)
    if storable:
        menus = stored_menus(proto, menus)
    seconds["menus"] = time.perf_counter() - t
    t = time.perf_counter()
    choices = frontier(menus, budgets)
    seconds["allocate"] = time.perf_counter() - t
    results = []
    for c in choices:
        best = c.best
        results.append(
            BudgetResult(c.budget, _summary(c.greedy), _summary(c.dado), best.method, plan_for(menus, best))
        )
    t = time.perf_counter()
    if check:
        for r in results:
            r.stored_bytes, r.quality = _check(model, r.plan, feeds, runtime)
    seconds["check"] = time.perf_counter() - t
    dense = int(sum(m.view.dense_bytes for m in menus))
    name = str(model) if not isinstance(model, ModelProto) else (model.graph.name or "model")
    return WeightPlans(name, dense, storable, min_cosine, min_top1, results, _menu_rows(menus), seconds)


def _summary(a) -> dict:
    return {"error": a.error, "bytes": a.bytes, "within_budget": a.within_budget}


def _check(
    model: ModelLike, plan: dict, feeds: FeedSpec | None, runtime: RuntimeConfig | None
) -> tuple[int, dict]:
    """Apply `plan`, save it beside the model's weights in a temporary folder, score it (parity summary)."""
    rewritten, applied = apply_weight_plan(model, plan)
    with tempfile.TemporaryDirectory(prefix="opscope-plan-") as tmp:
        written = write_rewrite(
            model,
            Rewritten(rewritten, "weight_plan", options={"applied": applied.to_dict()}),
            Path(tmp) / "planned.onnx",
            feeds=feeds,
            runtime=runtime,
        )
    stored = sum(a.bytes_after for a in applied.layers)
    return stored, written.quality.summary() if written.quality else {}
