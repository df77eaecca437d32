"""From a model to its per-layer menus and the allocators' choices at several byte budgets.

`weight_menus` reads each weight once (one tensor in memory at a time) and keeps only its menu;
`frontier` runs both allocators at each budget and keeps, per budget, the choice with the least
Σ error within the budget (DADO starts from greedy, so it is never worse). What the choices do to
the model's outputs is measured one layer up (`run.weights.plan_weights`), as a plan is only
recommended after that end-to-end check.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..graph.io import ModelLike
from .allocate import Allocation, allocate, plan_dict
from .matrix import WeightView, iter_weights
from .menu import Option, layer_menu

DEFAULT_BUDGETS = (0.5, 0.35, 0.2)
DEFAULT_SVD_CAP = 1024  # an exact SVD of a 4096² weight takes 35-90 s on 2 cores; randomized above this


@dataclass(frozen=True)
class LayerMenu:
    view: WeightView
    options: list[Option]


def _channels_first(view: WeightView) -> tuple[int, ...]:
    """The weight's shape with its output-channel axis first (what Tucker factors: [M, C, kh, kw])."""
    rest = [d for i, d in enumerate(view.shape) if i != view.out_axis]
    return (view.shape[view.out_axis], *rest)


def weight_menus(
    model: ModelLike,
    *,
    base_dir: str | os.PathLike | None = None,
    svd_cap: int | None = DEFAULT_SVD_CAP,
    min_elements: int = 1024,
    progress: Callable[[int, int | None, str], None] | None = None,
) -> list[LayerMenu]:
    """The decomposition menu (`menu.layer_menu`) of every float weight of at least `min_elements`
    (smaller ones, biases and norms, are left dense: they cost nothing worth a choice)."""
    out = []
    for k, (view, w) in enumerate(iter_weights(model, base_dir=base_dir, min_elements=min_elements)):
        if len(view.shape) < 2:
            continue
        options = layer_menu(w, itemsize=view.itemsize, shape=_channels_first(view), svd_cap=svd_cap)
        out.append(LayerMenu(view, options))
        if progress is not None:
            progress(k + 1, None, view.name)
    return out


@dataclass(frozen=True)
class BudgetChoice:
    """Both allocators at one budget, and the one kept (least Σ error within the budget)."""

    budget: float
    greedy: Allocation
    dado: Allocation

    @property
    def best(self) -> Allocation:
        ok = [a for a in (self.dado, self.greedy) if a.within_budget] or [self.greedy]
        return min(ok, key=lambda a: a.error)


def frontier(
    menus: Sequence[LayerMenu], budgets: Sequence[float] = DEFAULT_BUDGETS, seed: int = 0
) -> list[BudgetChoice]:
    """Greedy and DADO at each budget (a fraction of the dense bytes)."""
    options = [m.options for m in menus]
    return [
        BudgetChoice(b, allocate(options, b, "greedy", seed), allocate(options, b, "dado", seed))
        for b in budgets
    ]


def plan_for(menus: Sequence[LayerMenu], allocation: Allocation) -> dict:
    """The plan JSON (`allocate.plan_dict`) of one allocation over these menus."""
    return plan_dict([m.view for m in menus], [m.options for m in menus], allocation)
