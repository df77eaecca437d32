"""`add_all` and the Poly fast paths against plain references: same value, coefficient types and term order."""

from __future__ import annotations

import random

from onnx_opscope.shapes.symbolic import Poly, add, add_all


def _random_dim(rng: random.Random):
    if rng.random() < 0.3:
        return rng.choice([0, 0.0, 1, -1, 2, 0.5, -0.5, 3.25, 1e16, 7])
    out = 0
    for _ in range(rng.randint(1, 3)):
        term = rng.choice([1, 2, -1, 0.5, -2, 0.1])
        for _ in range(rng.randint(0, 2)):
            term = term * Poly.symbol(rng.choice("abc"))
        out = out + term
    return out


def _signature(x):
    if isinstance(x, Poly):
        return [(m, c, type(c)) for m, c in x.terms.items()]
    if isinstance(x, dict):
        return [(m, c, type(c)) for m, c in x.items()]
    return (type(x), x)


def test_add_all_equals_the_fold_of_plus():
    rng = random.Random(0)
    for _ in range(3000):
        xs = [_random_dim(rng) for _ in range(rng.randint(0, 6))]
        if xs and rng.random() < 0.3:
            xs.append(-xs[rng.randrange(len(xs))])  # exact cancellations
        fold = 0
        for x in xs:
            fold = fold + x
        assert _signature(add_all(xs)) == _signature(fold)
        assert _signature(add(*xs)) == _signature(fold)


def test_cancelled_terms_leave_and_order_is_first_insertion():
    """2a + 3 + ab - 2a + 0.5 + a^2 - 3 - 0.5: a and the constant cancel, ab then a^2 remain, int coefficients."""
    a, b = Poly.symbol("a"), Poly.symbol("b")
    got = add_all([2 * a, 3, b * a, -2 * a, 0.5, a * a, -3, -0.5])
    assert isinstance(got, Poly)
    assert _signature(got) == [((("a", 1), ("b", 1)), 1, int), ((("a", 2),), 1, int)]
    assert str(got) == "a*b + a**2"
    assert add_all([a, -a]) == 0 and type(add_all([a, -a])) is int
    assert add(a, None) is None
