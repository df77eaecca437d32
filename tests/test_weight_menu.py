"""The weight menu and the allocators on constructed weights with known answers, and on real ones.

Each structured kind is fed a matrix built to have exactly that structure (error ~0) and a
random one (error clearly > 0); errors are recomputed here from `reconstruct`, bytes and MACs
from the formulas, and the allocators are held against brute force on tiny instances.
"""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from conftest import real_model_path
from onnx import numpy_helper

from onnx_opscope.errors import OpscopeError
from onnx_opscope.weights.allocate import allocate, allocate_budgets, plan_dict
from onnx_opscope.weights.menu import (
    Option,
    layer_menu,
    lowrank_factors,
    menu_seconds,
    option_from_dict,
    reconstruct,
)
from onnx_opscope.weights.probes import quant_error


def _rel(w: np.ndarray, approx: np.ndarray) -> float:
    return float(np.linalg.norm((w - approx).astype(np.float64)) / np.linalg.norm(w.astype(np.float64)))


def _by_kind(menu: list[Option], kind: str) -> list[Option]:
    return [o for o in menu if o.kind == kind]


def _orthonormal(rng: np.random.Generator, n: int, r: int) -> np.ndarray:
    return np.linalg.qr(rng.standard_normal((n, r)))[0]


def _tucker_tensor(rng: np.random.Generator, shape: tuple[int, ...], ranks: tuple[int, int]):
    """[M, C, kh, kw] of exact multilinear rank `ranks` on its M and C modes, as ([M, rest], shape)."""
    core = rng.standard_normal((*ranks, *shape[2:]))
    t = np.einsum(
        "rqhw,mr,cq->mchw", core, _orthonormal(rng, shape[0], ranks[0]), _orthonormal(rng, shape[1], ranks[1])
    )
    return t.reshape(shape[0], -1).astype(np.float32), shape


def _tt_matrix(rng: np.random.Generator, ranks: tuple[int, int]) -> np.ndarray:
    """A 64×48 TT-matrix: rows 4·4·4, cols 4·4·3, TT ranks (1, *ranks, 1), built from random cores."""
    g1 = rng.standard_normal((4, 4, ranks[0]))
    g2 = rng.standard_normal((ranks[0], 4, 4, ranks[1]))
    g3 = rng.standard_normal((ranks[1], 4, 3))
    return np.einsum("iax,xjby,ykc->ijkabc", g1, g2, g3).reshape(64, 48).astype(np.float32)


def _real_matrices(limit: int = 6) -> list[tuple[np.ndarray, tuple[int, ...]]]:
    """Float weights of captcha_crnn with ≤ 200k values, as [out channels, rest] plus their shape."""
    model = onnx.load(real_model_path("captcha_crnn"))
    out = []
    for t in model.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 2 and 256 <= math.prod(t.dims) <= 200_000:
            a = numpy_helper.to_array(t)
            out.append((a.reshape(a.shape[0], -1), tuple(a.shape)))
    assert len(out) >= limit
    return out[:limit]


# --- menu: known answers -------------------------------------------------------------------------


def test_rank4_matrix_has_a_cheap_exact_low_rank_option():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 4)) @ rng.standard_normal((4, 64))).astype(np.float32)
    menu = layer_menu(w)
    dense = _by_kind(menu, "dense")[0]
    good = [o for o in _by_kind(menu, "lowrank") if o.error < 0.05 and o.bytes < dense.bytes]
    assert good and min(o.params["rank"] for o in good) <= 4
    a, b = lowrank_factors(w, good[0])
    np.testing.assert_allclose(a @ b, reconstruct(w, good[0]), atol=1e-4)
    noise = rng.standard_normal((64, 64)).astype(np.float32)  # full rank: every kept rank loses a lot
    assert all(o.error > 0.2 for o in _by_kind(layer_menu(noise), "lowrank"))


def test_2_4_sparse_weights_lose_nothing_to_2_4():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 40)).astype(np.float32)
    drop = np.argsort(rng.random((16, 10, 4)), axis=2)[..., :2]
    sparse = w.reshape(16, 10, 4).copy()
    np.put_along_axis(sparse, drop, 0.0, axis=2)
    sparse = sparse.reshape(16, 40)
    assert _by_kind(layer_menu(sparse), "sparse_2_4")[0].error == 0.0
    assert _by_kind(layer_menu(w), "sparse_2_4")[0].error > 0.1


def test_ternary_of_a_ternary_matrix_is_exact():
    rng = np.random.default_rng(2)
    w = (0.37 * rng.choice([-1.0, 0.0, 1.0], size=(24, 48))).astype(np.float32)
    option = _by_kind(layer_menu(w), "ternary")[0]
    assert option.error < 1e-6
    np.testing.assert_allclose(reconstruct(w, option), w, atol=1e-7)
    noise = rng.standard_normal((24, 48)).astype(np.float32)
    delta = 0.7 * np.abs(noise).mean()  # TWN (Li et al. 2016)
    alpha = np.abs(noise)[np.abs(noise) > delta].mean()
    expected = np.where(np.abs(noise) > delta, alpha * np.sign(noise), 0)
    np.testing.assert_allclose(
        reconstruct(noise, _by_kind(layer_menu(noise), "ternary")[0]), expected, rtol=1e-6
    )
    assert _by_kind(layer_menu(noise), "ternary")[0].error > 0.2


def test_int8_per_channel_and_int4_grouped_match_numpy_references():
    rng = np.random.default_rng(3)
    real = _real_matrices(1)[0][0]
    for w in (real, rng.standard_normal((20, 70)).astype(np.float32) * rng.uniform(0.01, 3, (20, 1))):
        w = np.ascontiguousarray(w, dtype=np.float32)
        menu = layer_menu(w, svd_cap=16)
        scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
        expected = np.clip(np.rint(w / scale), -127, 127) * scale
        int8 = _by_kind(menu, "int8_channel")[0]
        np.testing.assert_array_equal(reconstruct(w, int8), expected)
        assert int8.error == pytest.approx(_rel(w, expected), rel=1e-5)
        assert int8.error == pytest.approx(quant_error(w, 8, "channel"), rel=1e-5)

        g = 32
        n = -(-w.shape[1] // g)
        padded = np.zeros((w.shape[0], n * g), np.float32)
        padded[:, : w.shape[1]] = w
        blocks = padded.reshape(w.shape[0], n, g)
        gscale = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(7)
        gexp = (np.clip(np.rint(blocks / gscale), -7, 7) * gscale).reshape(w.shape[0], -1)[:, : w.shape[1]]
        int4 = next(o for o in _by_kind(menu, "int4_group") if o.params["group"] == 32)
        np.testing.assert_array_equal(reconstruct(w, int4), gexp)
        assert int4.error == pytest.approx(quant_error(w, 4, "group", group=32), rel=1e-5)


def test_every_error_is_the_relative_l2_of_its_reconstruction():
    rng = np.random.default_rng(4)
    u, v = _orthonormal(rng, 64, 64), _orthonormal(rng, 64, 64)
    decaying = ((u * 0.85 ** np.arange(64)) @ v.T).astype(np.float32)  # square (Monarch) and TT-able
    cases = [(decaying, None), (rng.standard_normal((30, 50)).astype(np.float32), None)]
    cases += [(w, shape) for w, shape in _real_matrices(3)]
    cases += [_tucker_tensor(rng, (24, 16, 3, 3), (4, 3)), (_tt_matrix(rng, (2, 3)), None)]
    kinds = set()
    for w, shape in cases:
        menu = layer_menu(w, shape=shape)
        assert menu[0].kind == "dense" and menu_seconds(menu) > 0
        for option in menu:
            approx = reconstruct(w, option)
            assert approx.shape == w.shape and approx.dtype == np.float32
            assert option.error == pytest.approx(_rel(w, approx), rel=1e-4, abs=1e-6), option.label
            assert option.params["seconds"] >= 0
            kinds.add(option.kind)
    assert {"lowrank", "monarch", "tucker", "tt", "int4_group", "sparse_2_4"} <= kinds


def test_bytes_and_macs_follow_the_formulas():
    rng = np.random.default_rng(5)
    rows, c, kh, kw, itemsize = 6, 10, 4, 4, 2
    cols = c * kh * kw
    core = rng.standard_normal((2, 3, kh, kw))
    t = np.einsum("rqhw,mr,cq->mchw", core, rng.standard_normal((rows, 2)), rng.standard_normal((c, 3)))
    w = t.reshape(rows, cols).astype(np.float32)
    menu = layer_menu(w, itemsize=itemsize, shape=(rows, c, kh, kw))
    values = rows * cols
    stored_2_4 = rows * 2 * (cols // 4)
    seen = set()
    for o in menu:
        p = o.params
        if o.kind == "dense":
            want = (values * itemsize, values)
        elif o.kind.endswith("_channel"):
            want = (math.ceil(values * p["bits"] / 8) + 4 * rows, values)
        elif o.kind.endswith("_group"):
            want = (math.ceil(values * p["bits"] / 8) + 4 * rows * math.ceil(cols / p["group"]), values)
        elif o.kind == "ternary":
            want = (math.ceil(values * 2 / 8) + 4, values)
        elif o.kind == "sparse_2_4":
            want = (stored_2_4 * itemsize + math.ceil(stored_2_4 * 2 / 8), stored_2_4)
        elif o.kind == "lowrank":
            want = ((rows + cols) * p["rank"] * itemsize, (rows + cols) * p["rank"])
        elif o.kind == "tucker":
            r1, r2 = p["ranks"]
            want = (
                (rows * r1 + c * r2 + r1 * r2 * kh * kw) * itemsize,
                c * r2 + r2 * r1 * kh * kw + r1 * rows,
            )
        else:
            assert o.kind == "tt", o.kind
            rf, cf, rk = p["row_factors"], p["col_factors"], p["ranks"]
            n = sum(rk[k] * rf[k] * cf[k] * rk[k + 1] for k in range(len(rf)))
            macs = sum(math.prod(cf[: k + 1]) * math.prod(rf[k:]) * rk[k] * rk[k + 1] for k in range(len(rf)))
            want = (n * itemsize, macs)
        assert (o.bytes, o.macs) == want, o.label
        seen.add(o.label)
    assert {"int8 g32", "int8 g128", "int4 g32", "int4 g128", "int8 per-channel", "ternary", "2:4"} <= seen
    assert _by_kind(menu, "tucker")[0].params["ranks"] == [2, 3]
    assert {o.params["rank"] for o in _by_kind(menu, "lowrank")} <= {1, 2, 3, 4, 5}  # 166·r < 960

    tt = _by_kind(layer_menu(_tt_matrix(rng, (2, 3)), itemsize=itemsize), "tt")[0]
    # cores [1, 4·4, 2], [2, 4·4, 3], [3, 4·3, 1]; y = W x contracted last core first (menu docstring)
    macs = 4 * (4 * 4 * 4) * 1 * 2 + (4 * 4) * (4 * 4) * 2 * 3 + (4 * 4 * 3) * 4 * 3 * 1
    assert (tt.bytes, tt.macs) == ((16 * 2 + 2 * 16 * 3 + 3 * 12) * itemsize, macs)

    square = rng.standard_normal((16, 16)).astype(np.float32)
    monarch = _by_kind(layer_menu(square, itemsize=itemsize), "monarch")[0]
    assert (monarch.bytes, monarch.macs) == (2 * 4**3 * itemsize, 2 * 4**3)


def test_randomized_svd_is_close_to_the_exact_truncation():
    rng = np.random.default_rng(6)
    u, v = _orthonormal(rng, 96, 80), _orthonormal(rng, 80, 80)
    s = 0.8 ** np.arange(80)
    w = ((u * s) @ v.T + 1e-3 * rng.standard_normal((96, 80))).astype(np.float32)
    exact_s = np.linalg.svd(w.astype(np.float64), compute_uv=False)
    exact = {o.params["rank"]: o for o in _by_kind(layer_menu(w), "lowrank")}
    randomized = _by_kind(layer_menu(w, svd_cap=30), "lowrank")
    assert randomized and all(o.params["svd"] == "randomized" for o in randomized)
    assert all(o.params["svd"] == "exact" for o in exact.values())
    for o in randomized:
        r = o.params["rank"]
        best = math.sqrt((exact_s[r:] ** 2).sum() / (exact_s**2).sum())  # Eckart–Young
        assert best * (1 - 1e-5) <= o.error <= 1.03 * best + 1e-6
        if r in exact:
            assert o.error == pytest.approx(exact[r].error, rel=0.03)
    assert {o.params["rank"] for o in randomized} == set(exact)


def test_monarch_matrix_is_recovered_exactly():
    rng = np.random.default_rng(7)
    m = 5
    n = m * m
    block_l = np.zeros((n, n))
    block_r = np.zeros((n, n))
    for b in range(m):
        block_l[b * m : (b + 1) * m, b * m : (b + 1) * m] = rng.standard_normal((m, m))
        block_r[b * m : (b + 1) * m, b * m : (b + 1) * m] = rng.standard_normal((m, m))
    perm = np.eye(n)[np.arange(n).reshape(m, m).T.ravel()]  # transposes the m×m grid of indices
    w = (perm @ block_l @ perm.T @ block_r).astype(np.float32)  # M = P L Pᵀ R (Dao et al. 2022)
    option = _by_kind(layer_menu(w), "monarch")[0]
    assert option.error < 1e-5
    assert option.bytes == 2 * m**3 * 4 < w.nbytes
    assert _by_kind(layer_menu(rng.standard_normal((n, n)).astype(np.float32)), "monarch")[0].error > 0.3


def test_tucker_and_tt_recover_exact_low_rank_tensors():
    rng = np.random.default_rng(8)
    w, shape = _tucker_tensor(rng, (24, 16, 3, 3), (4, 3))
    t = w.reshape(shape)
    tucker = _by_kind(layer_menu(w, shape=t.shape), "tucker")
    assert tucker and tucker[0].params["ranks"] == [4, 3] and tucker[0].error < 1e-5
    np.testing.assert_allclose(reconstruct(w, tucker[0]).reshape(t.shape), t, atol=1e-5)
    assert not _by_kind(layer_menu(w), "tucker")  # no tensor shape, no Tucker

    g1, g2, g3 = (
        rng.standard_normal((4, 4, 2)),
        rng.standard_normal((2, 4, 4, 3)),
        rng.standard_normal((3, 4, 3)),
    )
    w = np.einsum("iax,xjby,ykc->ijkabc", g1, g2, g3).reshape(64, 48).astype(np.float32)
    tt = _by_kind(layer_menu(w), "tt")
    assert tt and tt[0].params["row_factors"] == [4, 4, 4] and tt[0].params["col_factors"] == [4, 4, 3]
    assert tt[0].params["ranks"] == [1, 2, 3, 1] and tt[0].error < 1e-5
    noise = rng.standard_normal((64, 48)).astype(np.float32)
    assert all(o.error > 0.05 for o in _by_kind(layer_menu(noise), "tt"))


def test_options_round_trip_and_bad_input_is_one_clear_error():
    w = np.random.default_rng(9).standard_normal((32, 32)).astype(np.float32)
    for option in layer_menu(w):
        assert option_from_dict(json.loads(json.dumps(option.to_dict()))) == option
    with pytest.raises(OpscopeError, match="kind"):
        option_from_dict({"kind": "lowrnak", "label": "", "error": 0, "bytes": 1, "macs": 1})
    with pytest.raises(OpscopeError, match="NaN"):
        layer_menu(np.full((4, 4), np.nan, np.float32))
    with pytest.raises(OpscopeError, match="rows, cols"):
        layer_menu(np.ones(8, np.float32))
    with pytest.raises(OpscopeError, match="output channels first"):
        layer_menu(w, shape=(16, 2, 32))


# --- allocators ----------------------------------------------------------------------------------


def _random_menus(rng: np.random.Generator, layers: int, most: int = 10) -> list[list[Option]]:
    menus = []
    for _ in range(layers):
        k = int(rng.integers(2, most + 1))
        nbytes = np.sort(rng.choice(np.arange(100, 20_000), size=k, replace=False))[::-1]
        error = np.concatenate([[0.0], np.sort(rng.random(k - 1))])
        menus.append(
            [
                Option("dense" if i == 0 else "lowrank", f"o{i}", float(error[i]), int(nbytes[i]), 1)
                for i in range(k)
            ]
        )
    return menus


def _brute_force(menus: list[list[Option]], budget: float) -> float:
    limit = budget * sum(m[0].bytes for m in menus)
    return min(
        sum(o.error for o in combo)
        for combo in itertools.product(*menus)
        if sum(o.bytes for o in combo) <= limit
    )


def test_dado_is_never_worse_than_greedy_at_40_percent():
    rng = np.random.default_rng(10)
    real = [layer_menu(w, shape=shape) for w, shape in _real_matrices(6)]
    improved = 0
    for menus in [_random_menus(rng, n) for n in (8, 30, 120)] + [real]:
        greedy, dado = allocate(menus, 0.4, "greedy"), allocate(menus, 0.4, "dado")
        assert greedy.within_budget and dado.within_budget
        assert dado.error <= greedy.error + 1e-6
        assert dado.bytes <= 0.4 * sum(m[0].bytes for m in menus)
        assert dado.error == pytest.approx(sum(m[k].error for m, k in zip(menus, dado.choice)))
        improved += dado.error < greedy.error - 1e-9
    assert improved >= 1  # the search does more than return its seed


def test_allocators_against_brute_force_on_tiny_instances():
    rng = np.random.default_rng(11)
    for _ in range(5):
        menus = _random_menus(rng, 4, most=4)
        optimum = _brute_force(menus, 0.5)
        greedy, dado = allocate(menus, 0.5, "greedy"), allocate(menus, 0.5, "dado", seed=3)
        assert optimum - 1e-9 <= dado.error <= greedy.error + 1e-9
        assert dado.error == pytest.approx(optimum)

    # the greedy rule itself: the smallest Δerror per byte saved first, even where that is not optimal
    menus = [
        [Option("dense", "", 0.0, 1000, 1), Option("tt", "", 0.1, 100, 1)],
        [Option("dense", "", 0.0, 1000, 1), Option("tt", "", 0.05, 900, 1)],
    ]
    assert allocate(menus, 0.95, "greedy").choice == (1, 0)
    assert allocate(menus, 0.95, "dado").choice == (0, 1)

    # convex menus (each a lower hull: slopes increase) at a budget where greedy stops exactly on it:
    # greedy is then a Lagrangian optimum, hence the exact optimum
    for budget in (0.8, 0.6, 0.4):
        menus = []
        for _ in range(4):
            saved = rng.integers(10, 1500, size=3)
            slopes = np.sort(rng.random(3))
            nbytes = 5000 - np.concatenate([[0], np.cumsum(saved)])
            error = np.concatenate([[0.0], np.cumsum(slopes * saved)])
            menus.append(
                [
                    Option("dense" if i == 0 else "tt", "", float(error[i]), int(nbytes[i]), 1)
                    for i in range(4)
                ]
            )
        first = allocate(menus, budget, "greedy")
        exact_budget = first.bytes / sum(m[0].bytes for m in menus)
        greedy = allocate(menus, exact_budget, "greedy")
        assert greedy.choice == first.choice
        assert greedy.error == pytest.approx(_brute_force(menus, exact_budget))


def test_unreachable_budget_gives_the_smallest_choice_and_says_so():
    menus = _random_menus(np.random.default_rng(12), 5)
    for method in ("greedy", "dado"):
        a = allocate(menus, 0.001, method)
        assert not a.within_budget
        assert a.choice == tuple(int(np.argmin([o.bytes for o in m])) for m in menus)
    with pytest.raises(OpscopeError, match="budget"):
        allocate(menus, 0.0)
    with pytest.raises(OpscopeError, match="did you mean"):
        allocate(menus, 0.5, "dadoo")


def test_allocate_budgets_and_plan_dict():
    rng = np.random.default_rng(13)
    weights = [
        rng.standard_normal((32, 48)).astype(np.float32),
        rng.standard_normal((16, 16)).astype(np.float32),
    ]
    menus = [layer_menu(w) for w in weights]
    runs = allocate_budgets(menus)
    assert [(a.budget, a.method) for a in runs] == [
        (b, m) for b in (0.5, 0.35, 0.2) for m in ("greedy", "dado")
    ]
    assert all(a.error == allocate(menus, a.budget, a.method).error for a in runs)
    views = [
        SimpleNamespace(name=f"W{i}", graph="", node=f"MatMul_{i}", op="MatMul", shape=w.T.shape, out_axis=1)
        for i, w in enumerate(weights)
    ]
    plan = json.loads(json.dumps(plan_dict(views, menus, runs[3])))
    assert plan["budget"] == 0.35 and plan["method"] == "dado"
    assert plan["dense_bytes"] == sum(w.nbytes for w in weights)
    assert (
        plan["bytes"]
        == sum(layer["option"]["bytes"] for layer in plan["layers"])
        <= 0.35 * plan["dense_bytes"]
    )
    assert [layer["weight"] for layer in plan["layers"]] == ["W0", "W1"]
    assert plan["layers"][0]["shape"] == [48, 32] and plan["layers"][0]["out_axis"] == 1
    chosen = option_from_dict(plan["layers"][0]["option"])
    assert chosen == menus[0][runs[3].choice[0]]
    with pytest.raises(OpscopeError, match="do not match"):
        plan_dict(views[:1], menus, runs[3])
