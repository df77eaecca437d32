"""A per-layer choice of menu options under a byte budget, and the plan it gives.

The objective is additive: minimise Σ_l error_l(choice_l) subject to Σ_l bytes_l(choice_l) ≤ B,
with B = budget · Σ_l dense bytes (each layer's "dense" option; its largest option if it has
none). A multiple-choice knapsack, so two heuristics:

- `greedy`: from the largest option of every layer, repeatedly take the one swap (any layer, any
  smaller option) with the smallest Δerror / Δbytes saved, until within B. When even the smallest
  option of every layer exceeds B, that choice is returned with `within_budget` False.
- `dado`: a DADO-style cross-entropy search over a factorised (per-layer) categorical: population
  200, 60 iterations, the best 20 % by score Σ error + 50·max(0, (bytes − B)/B) refit each layer's
  categorical with Laplace smoothing ((count + 1) / (elite + options)). It starts from the
  smoothed one-hot of the greedy choice and the best choice within budget so far (greedy first) is
  always one of the population, so it never returns worse than greedy.

The population is scored at once on [layers, options] tables padded to the longest menu.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import OpscopeError, did_you_mean
from .menu import Option

METHODS = ("greedy", "dado")
POPULATION = 200
ITERATIONS = 60
ELITE = 0.2
PENALTY = 50.0


@dataclass(frozen=True)
class Allocation:
    """One option index per layer (into that layer's menu), and what the choice costs."""

    method: str
    budget: float  # fraction of the dense bytes
    choice: tuple[int, ...]
    bytes: int
    error: float  # Σ of the chosen options' errors
    within_budget: bool


@dataclass(frozen=True)
class _Tables:
    error: np.ndarray  # [layers, options] float64, 0 past a menu's end
    bytes: np.ndarray  # [layers, options] float64, 0 past a menu's end
    valid: np.ndarray  # [layers, options] bool
    count: np.ndarray  # [layers] options per menu
    dense: float  # Σ dense bytes


def allocate(
    menus: Sequence[Sequence[Option]], budget: float, method: str = "greedy", seed: int = 0
) -> Allocation:
    """The choice of one option per menu minimising Σ error within `budget` · Σ dense bytes."""
    if method not in METHODS:
        raise OpscopeError(
            f"unknown allocation method {method!r}{did_you_mean(method, METHODS)}; methods: greedy, dado"
        )
    t = _tables(menus)
    limit = _limit(t, budget)
    choice = _greedy(t, limit)
    if method == "dado" and _bytes(t, choice) <= limit:
        choice = _dado(t, limit, choice, np.random.default_rng(seed))
    return _allocation(t, method, budget, limit, choice)


def allocate_budgets(
    menus: Sequence[Sequence[Option]], budgets: Sequence[float] = (0.5, 0.35, 0.2), seed: int = 0
) -> list[Allocation]:
    """Greedy then DADO at each budget, in that order (DADO reuses the greedy choice)."""
    t = _tables(menus)
    out = []
    for budget in budgets:
        limit = _limit(t, budget)
        greedy = _greedy(t, limit)
        out.append(_allocation(t, "greedy", budget, limit, greedy))
        dado = _dado(t, limit, greedy, np.random.default_rng(seed)) if _bytes(t, greedy) <= limit else greedy
        out.append(_allocation(t, "dado", budget, limit, dado))
    return out


def plan_dict(views: Sequence, menus: Sequence[Sequence[Option]], allocation: Allocation) -> dict:
    """The JSON plan `transform.weight_plan.apply_weight_plan` reads: one chosen option per weight.

    `views`: the weights' `matrix.WeightView`s (name, graph, node, op, shape, out_axis), in menu order.
    """
    if not len(views) == len(menus) == len(allocation.choice):
        raise OpscopeError(
            f"plan_dict: {len(views)} weights, {len(menus)} menus and {len(allocation.choice)} choices do not match"
        )
    layers = [
        {
            "weight": v.name,
            "graph": v.graph,
            "node": v.node,
            "op": v.op,
            "shape": [int(d) for d in v.shape],
            "out_axis": int(v.out_axis),
            "option": menu[k].to_dict(),
        }
        for v, menu, k in zip(views, menus, allocation.choice)
    ]
    return {
        "budget": allocation.budget,
        "method": allocation.method,
        "dense_bytes": int(_tables(menus).dense),
        "bytes": allocation.bytes,
        "error": allocation.error,
        "layers": layers,
    }


# --- the searches --------------------------------------------------------------------------------


def _greedy(t: _Tables, limit: float) -> np.ndarray:
    smallest = _extreme(t, largest=False)
    if _bytes(t, smallest) > limit:
        return smallest
    choice = _extreme(t, largest=True)
    total = _bytes(t, choice)
    ratio, saved, best = _best_swaps(t, choice, np.arange(len(choice)))
    while total > limit:  # each step changes one layer, so only its best swap is recomputed
        layer = int(np.argmax(np.where(ratio == ratio.min(), saved, -1)))  # ties: the bigger saving
        if saved[layer] <= 0:
            break  # unreachable: the smallest choice fits, so some layer can still shrink
        choice[layer] = best[layer]
        total -= saved[layer]
        ratio[layer], saved[layer], best[layer] = (x[0] for x in _best_swaps(t, choice, np.array([layer])))
    return choice


def _best_swaps(
    t: _Tables, choice: np.ndarray, layers: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer, the swap to a smaller option with the smallest Δerror / Δbytes: (ratio, saved, option)."""
    current = choice[layers]
    saved = t.bytes[layers, current][:, None] - t.bytes[layers]
    smaller = t.valid[layers] & (saved > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(smaller, (t.error[layers] - t.error[layers, current][:, None]) / saved, np.inf)
    tied = smaller & (ratio == ratio.min(axis=1, keepdims=True))
    k = np.argmax(np.where(tied, saved, -1), axis=1)
    rows = np.arange(len(layers))
    return ratio[rows, k], np.where(tied[rows, k], saved[rows, k], 0), k


def _dado(t: _Tables, limit: float, start: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    layers = np.arange(len(t.count))
    elite = max(1, int(round(ELITE * POPULATION)))
    probs = _refit(t, np.repeat(start[None], elite, axis=0))
    best, best_error = start.copy(), float(t.error[layers, start].sum())
    for _ in range(ITERATIONS):
        cdf = np.cumsum(probs, axis=1)
        pop = (rng.random((POPULATION, len(layers)))[..., None] >= cdf[None]).sum(axis=2)
        pop = np.minimum(pop, t.count - 1)
        pop[0] = best
        error = t.error[layers, pop].sum(axis=1)
        nbytes = t.bytes[layers, pop].sum(axis=1)
        score = error + PENALTY * np.maximum(0.0, (nbytes - limit) / limit)
        feasible = np.flatnonzero(nbytes <= limit)
        i = feasible[np.argmin(error[feasible])]  # pop[0] is feasible, so never empty
        if error[i] < best_error:
            best, best_error = pop[i].copy(), float(error[i])
        probs = _refit(t, pop[np.argsort(score, kind="stable")[:elite]])
    return best


def _refit(t: _Tables, elite: np.ndarray) -> np.ndarray:
    """Laplace-smoothed per-layer frequencies of the elite's choices: (count + 1) / (elite + options)."""
    layers, width = t.valid.shape
    flat = (np.arange(layers)[None] * width + elite).ravel()
    counts = np.bincount(flat, minlength=layers * width).reshape(layers, width)
    return np.where(t.valid, counts + 1.0, 0.0) / (len(elite) + t.count)[:, None]


# --- tables --------------------------------------------------------------------------------------


def _tables(menus: Sequence[Sequence[Option]]) -> _Tables:
    if not menus:
        raise OpscopeError("nothing to allocate: no weight menus")
    empty = [i for i, m in enumerate(menus) if not m]
    if empty:
        raise OpscopeError(f"weight menu {empty[0]} has no options")
    width = max(len(m) for m in menus)
    error = np.zeros((len(menus), width))
    nbytes = np.zeros((len(menus), width))
    valid = np.zeros((len(menus), width), dtype=bool)
    dense = 0.0
    for i, menu in enumerate(menus):
        if not all(math.isfinite(o.error) and o.error >= 0 and o.bytes >= 0 for o in menu):
            raise OpscopeError(f"weight menu {i} has an option with a negative or non-finite error or bytes")
        error[i, : len(menu)] = [o.error for o in menu]
        nbytes[i, : len(menu)] = [o.bytes for o in menu]
        valid[i, : len(menu)] = True
        dense += next((o.bytes for o in menu if o.kind == "dense"), max(o.bytes for o in menu))
    return _Tables(error, nbytes, valid, valid.sum(axis=1), dense)


def _limit(t: _Tables, budget: float) -> float:
    if not budget > 0:
        raise OpscopeError(f"the byte budget is a fraction of the dense bytes (e.g. 0.35), got {budget}")
    return budget * t.dense


def _extreme(t: _Tables, *, largest: bool) -> np.ndarray:
    """Per layer, the option with the most (or fewest) bytes; ties to the smaller error."""
    key = np.where(t.valid, -t.bytes if largest else t.bytes, np.inf)
    low = key == key.min(axis=1, keepdims=True)
    return np.argmin(np.where(low, t.error, np.inf), axis=1)


def _bytes(t: _Tables, choice: np.ndarray) -> float:
    return float(t.bytes[np.arange(len(choice)), choice].sum())


def _allocation(t: _Tables, method: str, budget: float, limit: float, choice: np.ndarray) -> Allocation:
    layers = np.arange(len(choice))
    nbytes = int(t.bytes[layers, choice].sum())
    return Allocation(
        method=method,
        budget=float(budget),
        choice=tuple(int(k) for k in choice),
        bytes=nbytes,
        error=float(t.error[layers, choice].sum()),
        within_budget=nbytes <= limit,
    )
