"""The fast paths of `find_motifs` held to plain references: both branches of each helper (the counting or
marking one that 160k-node graphs take, the sorting one that large values take), and the cost columns on
mixed, unknown and symbolic costs against the sums written out term by term."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_opscope.analysis import motifs as M
from onnx_opscope.shapes.symbolic import Poly

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("groups", [3, 1 << 12])  # a small table is marked, a large one sorted
def test_distinct_pairs_are_the_sorted_unique_pairs(groups):
    n = 500
    g = RNG.integers(0, groups, 4000)
    nodes = RNG.integers(0, n, 4000)
    got_g, got_n = M._distinct_pairs(g, nodes, groups, n)
    want = np.unique(g * n + nodes)
    np.testing.assert_array_equal(got_g, want // n)
    np.testing.assert_array_equal(got_n, want % n)


@pytest.mark.parametrize("high", [50, 1 << 40])  # counted, sorted
def test_dense_matches_np_unique(high):
    code = RNG.integers(0, high, 3000)
    inv, counts = M._dense(code)
    _, want_inv, want_counts = np.unique(code, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(inv, want_inv.reshape(-1))
    np.testing.assert_array_equal(counts, want_counts)


@pytest.mark.parametrize("high", [6, 1 << 30])  # one int64 key; column by column when it would overflow
def test_dense_rows_number_rows_lexicographically(high):
    rows = RNG.integers(0, 4, (2000, 3)) * (high // 4 + 1)
    inv, first = M._dense_rows(rows)
    _, want_first, want_inv = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    np.testing.assert_array_equal(inv, want_inv.reshape(-1))
    np.testing.assert_array_equal(first, want_first)


def _reference_column(parts: list[list]) -> tuple[np.ndarray, list, np.ndarray]:
    """Per node the sum of its parts term by term, monomials numbered in the order the known nodes give them."""
    n = len(parts[0])
    unknown = np.array([any(p[i] is None for p in parts) for i in range(n)])
    monos: dict = {(): 0}
    cells = []
    for i in range(n):
        if unknown[i]:
            continue
        for p in parts:
            x = p[i]
            for m, c in x.terms.items() if isinstance(x, Poly) else (((), x),):
                cells.append((i, monos.setdefault(m, len(monos)), float(c)))
    mat = np.zeros((n, len(monos)))
    for i, j, c in cells:
        mat[i, j] += c
    return mat, list(monos), unknown


def test_cost_columns_match_the_term_by_term_sums():
    b, s = Poly.symbol("batch"), Poly.symbol("seq")
    pool = [0, 7, 2.5, None, 3 * b, b * s * 2 + 5, 64 * b, 3 * b, s * 1.5, 11 * b * b]
    parts = [[pool[k] for k in RNG.integers(0, len(pool), 400)] for _ in range(3)]
    col = M._column(parts)
    mat, monos, unknown = _reference_column(parts)
    assert col.monos == monos
    np.testing.assert_array_equal(col.unknown, unknown)
    np.testing.assert_array_equal(col.values, mat)
    numbers = [[1 if isinstance(x, Poly) else x for x in p] for p in parts]
    plain = M._column(numbers)  # numbers only: one column, summed as Python numbers
    ref = [
        0.0 if any(p[i] is None for p in numbers) else float(sum(p[i] for p in numbers)) for i in range(400)
    ]
    np.testing.assert_array_equal(plain.values[:, 0], ref)
