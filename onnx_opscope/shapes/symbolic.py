"""Symbolic dims and the polynomials that costs become when a dim stays a symbol.

A dim is an `int`, a `Poly` (an expression in named symbols such as `batch`, `seq`) or
`None` (nothing is known about it). Costs are products and sums of dims, so they are
polynomials in the symbols: `2*batch*seq*768*3072` evaluates to a number as soon as the
symbols get values, and a cost that depends on a `None` dim stays `None` (unknown). We
never read an unknown dim as 0 or 1.

Dims that are not polynomials (ORT's symbolic inference writes `floor(W/8)`, `Max(a, b)`)
are kept whole as opaque atoms and evaluated once their symbols are given. We avoid a
sympy dependency: the cost model only needs +, *, exact division by a monomial and
substitution.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable, Mapping

Number = int | float
Monomial = tuple[tuple[str, int], ...]  # sorted (atom, power) pairs; () is the constant term

_SAFE_NAME = re.compile(r"[^0-9A-Za-z_]")


def safe_symbol(name: str) -> str:
    """A Python identifier for a dim_param (`p2o.DynamicDimension.0` -> `p2o_DynamicDimension_0`)."""
    s = _SAFE_NAME.sub("_", name.strip())
    if not s or s[0].isdigit():
        s = "s_" + s
    return s


class Poly:
    """An immutable polynomial in named atoms with int or float coefficients.

    Arithmetic with plain numbers returns plain numbers whenever the result is constant,
    so fully static graphs never allocate a Poly.
    """

    __slots__ = ("terms", "_hash", "_syms", "_str")

    def __init__(self, terms: Mapping[Monomial, Number]):
        self.terms = {m: c for m, c in terms.items() if c != 0}
        self._hash: int | None = None
        self._syms: frozenset[str] | None = None
        self._str: str | None = None

    @staticmethod
    def symbol(name: str) -> Poly:
        return Poly({((name, 1),): 1})

    # -- algebra -------------------------------------------------------------------
    def __add__(self, other: object) -> Dimlike:
        # Only the touched terms can become 0: the others are nonzero already (every Poly holds
        # nonzero terms), so no re-filtering; a term that cancels leaves the dict, as `_norm` does.
        if isinstance(other, (int, float)):
            if other == 0:
                return self
            terms = dict(self.terms)
            v = terms.get((), 0) + other
            if v != 0:
                terms[()] = v
            else:
                del terms[()]
            return _norm_trusted(terms)
        if isinstance(other, Poly):
            terms = dict(self.terms)
            _add_terms(terms, other.terms)
            return _norm_trusted(terms)
        return NotImplemented

    __radd__ = __add__

    def __neg__(self) -> Poly:
        return _trusted({m: -c for m, c in self.terms.items()})

    def __sub__(self, other: object) -> Dimlike:
        if isinstance(other, (int, float, Poly)):
            return self + (-other)
        return NotImplemented

    def __rsub__(self, other: object) -> Dimlike:
        if isinstance(other, (int, float)):
            return (-self) + other
        return NotImplemented

    def __mul__(self, other: object) -> Dimlike:
        if isinstance(other, (int, float)):
            if other == 1:
                return self
            return _norm({m: c * other for m, c in self.terms.items()})
        if isinstance(other, Poly):
            terms: dict[Monomial, Number] = {}
            for m1, c1 in self.terms.items():
                for m2, c2 in other.terms.items():
                    m = _mono_mul(m1, m2)
                    terms[m] = terms.get(m, 0) + c1 * c2
            return _norm(terms)
        return NotImplemented

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Dimlike:
        """Exact division by a number or a monomial; anything else is not representable."""
        if isinstance(other, (int, float)):
            if other == 0:
                raise ZeroDivisionError("division of a symbolic dim by 0")
            return _norm({m: _div(c, other) for m, c in self.terms.items()})
        if isinstance(other, Poly) and len(other.terms) == 1:
            ((dm, dc),) = other.terms.items()
            out: dict[Monomial, Number] = {}
            for m, c in self.terms.items():
                q = _mono_div(m, dm)
                if q is None:
                    raise ValueError(f"{self} is not divisible by {other}")
                out[q] = _div(c, dc)
            return _norm(out)
        raise ValueError(f"cannot divide {self} by {other}")

    def __rtruediv__(self, other: object) -> Dimlike:
        if isinstance(other, (int, float)) and other == 0:
            return 0
        raise ValueError(f"cannot divide {other} by {self}")

    # -- inspection ----------------------------------------------------------------
    def atoms(self) -> set[str]:
        return {a for m in self.terms for a, _ in m}

    def symbols(self) -> frozenset[str]:
        """Free symbol names, looking inside opaque atoms such as `floor(W/8)`."""
        if self._syms is None:
            out: set[str] = set()
            for a in self.atoms():
                out |= _names_in(a)
            self._syms = frozenset(out)
        return self._syms

    def degree(self) -> int:
        return max((sum(p for _, p in m) for m in self.terms), default=0)

    def evaluate(self, values: Mapping[str, Number]) -> Dimlike:
        """Substitute the symbols that `values` names; a number once none remain."""
        total: Dimlike = 0
        for m, c in self.terms.items():
            term: Dimlike = c
            for atom, p in m:
                v = _eval_atom(atom, values)
                factor: Dimlike = Poly.symbol(atom) if v is None else v
                for _ in range(p):
                    term = term * factor
            total = total + term
        return total

    def ratio_to(self, other: Poly) -> float | None:
        """c such that self == c * other, or None when they are not proportional."""
        if self.terms.keys() != other.terms.keys():
            return None
        ratios = {c / other.terms[m] for m, c in self.terms.items()}
        return ratios.pop() if len(ratios) == 1 else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Poly) and self.terms == other.terms

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self.terms.items()))
        return self._hash

    def __str__(self) -> str:
        if self._str is None:
            self._str = self._text()
        return self._str

    def _text(self) -> str:
        def key(item: tuple[Monomial, Number]) -> tuple:
            m = item[0]
            return (-sum(p for _, p in m), m)

        parts = []
        for m, c in sorted(self.terms.items(), key=key):
            factors = [(a if a.isidentifier() else f"({a})") + ("" if p == 1 else f"**{p}") for a, p in m]
            coef = _fmt_num(c)
            if not factors:
                parts.append(coef)
            elif c == 1:
                parts.append("*".join(factors))
            else:
                parts.append(coef + "*" + "*".join(factors))
        return " + ".join(parts).replace("+ -", "- ") or "0"

    __repr__ = __str__


Dimlike = int | float | Poly


def _norm(terms: dict[Monomial, Number]) -> Dimlike:
    return _norm_trusted({m: c for m, c in terms.items() if c != 0})


def _norm_trusted(terms: dict[Monomial, Number]) -> Dimlike:
    """`_norm` of terms already free of zeros: a number when nothing symbolic is left."""
    if not terms:
        return 0
    if len(terms) == 1 and () in terms:
        return terms[()]
    return _trusted(terms)


def _trusted(terms: dict[Monomial, Number]) -> Poly:
    """A Poly over `terms` taken as they are (no zero terms, not shared): what arithmetic builds."""
    p = _new_poly(Poly)
    p.terms = terms
    p._hash = p._syms = p._str = None
    return p


_new_poly = object.__new__


def _div(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return _exact(a / b)


def _exact(x: float) -> Number:
    return int(x) if float(x).is_integer() and abs(x) < 2**62 else x


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    if not a:
        return b
    if not b:
        return a
    powers = dict(a)
    for atom, p in b:
        powers[atom] = powers.get(atom, 0) + p
    return tuple(sorted(powers.items()))


def _mono_div(a: Monomial, b: Monomial) -> Monomial | None:
    powers = dict(a)
    for atom, p in b:
        left = powers.get(atom, 0) - p
        if left < 0:
            return None
        if left:
            powers[atom] = left
        else:
            powers.pop(atom, None)
    return tuple(sorted(powers.items()))


def _fmt_num(c: Number) -> str:
    if isinstance(c, float) and not c.is_integer():
        return f"{c:.6g}"
    return str(int(c))


# -- parsing dim_param strings ---------------------------------------------------------

_FUNCS = {
    "floor": math.floor,
    "ceil": math.ceil,
    "Max": max,
    "Min": min,
    "max": max,
    "min": min,
    "Mod": lambda a, b: a % b,
    "Abs": abs,
    "abs": abs,
}
_PARSE_CACHE: dict[str, Dimlike] = {}


def parse_dim(text: str) -> Dimlike:
    """Turn a dim_param into a number, a polynomial or an opaque atom.

    Identifiers become symbols; `+ - *` over identifiers and integers become polynomials;
    anything else (`floor(W/8)`, `W//8`, `Max(a, b)`) becomes one opaque atom that
    `Poly.evaluate` computes once its symbols have values.
    """
    hit = _PARSE_CACHE.get(text)
    if hit is not None:
        return hit
    out: Dimlike
    try:
        out = _to_poly(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        out = Poly.symbol(text.strip() if text.strip().isidentifier() else text.strip())
    _PARSE_CACHE[text] = out
    return out


def _to_poly(node: ast.AST) -> Dimlike:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        return Poly.symbol(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_to_poly(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _to_poly(node.left), _to_poly(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        return a * b
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Pow)
        and isinstance(node.right, ast.Constant)
        and isinstance(node.right.value, int)
        and 0 <= node.right.value <= 8
    ):
        base, out = _to_poly(node.left), 1
        for _ in range(node.right.value):
            out = out * base
        return out
    _check_safe(node)
    return Poly.symbol(ast.unparse(node))


def _check_safe(node: ast.AST) -> None:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            if not (isinstance(sub.func, ast.Name) and sub.func.id in _FUNCS):
                raise ValueError("unsupported call")
        elif not isinstance(
            sub,
            (
                ast.Expression,
                ast.BinOp,
                ast.UnaryOp,
                ast.Name,
                ast.Constant,
                ast.Load,
                ast.Add,
                ast.Sub,
                ast.Mult,
                ast.Div,
                ast.FloorDiv,
                ast.Mod,
                ast.Pow,
                ast.USub,
            ),
        ):
            raise ValueError("unsupported syntax")


def _names_in(atom: str) -> set[str]:
    if atom.isidentifier():
        return {atom}
    try:
        tree = ast.parse(atom, mode="eval")
    except SyntaxError:
        return {atom}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _FUNCS}


def _eval_atom(atom: str, values: Mapping[str, Number]) -> Number | None:
    if atom in values:
        return values[atom]
    if atom.isidentifier():
        return None
    names = _names_in(atom)
    if not names or not names <= values.keys():
        return None
    try:
        tree = ast.parse(atom, mode="eval")
        _check_safe(tree.body)
        env = {n: values[n] for n in names}
        result = eval(compile(tree, "<dim>", "eval"), {"__builtins__": {}, **_FUNCS}, env)  # noqa: S307
    except Exception:  # noqa: BLE001 - a dim we cannot evaluate stays symbolic
        return None
    return _exact(result) if isinstance(result, float) else result


# -- helpers over Dim = int | Poly | None ----------------------------------------------


def prod(dims: Iterable[Dimlike | None]) -> Dimlike | None:
    """Product of dims, None as soon as one is unknown (never read as 0 or 1)."""
    out: Dimlike = 1
    for d in dims:
        if d is None:
            return None
        out = out * d
    return out


def add(*xs: Dimlike | None) -> Dimlike | None:
    """Sum of dims, None as soon as one is unknown."""
    for x in xs:
        if x is None:
            return None
    return add_all(xs)


def _add_terms(terms: dict[Monomial, Number], other: Mapping[Monomial, Number]) -> None:
    """terms += other in place, a term dropped the moment it cancels."""
    get = terms.get
    for m, c in other.items():
        v = get(m, 0) + c
        if v != 0:
            terms[m] = v
        elif m in terms:
            del terms[m]


def add_all(xs: Iterable[Dimlike]) -> Dimlike:
    """The sum of `xs` (no None), equal in value and type to the fold `0 + x1 + x2 + ...`.

    The fold builds a new Poly per term, so summing n symbolic costs copies n dicts (160k
    records: seconds); here one dict accumulates them, adding the same coefficients in the
    same order and dropping a term the moment it cancels, as the fold's normalisation does.
    Relies on every Poly having a symbolic term (a constant alone is always a number).
    """
    num: Number = 0  # the running sum while it is a number
    terms: dict[Monomial, Number] | None = None  # the running sum's terms while it is symbolic
    for x in xs:
        tx = type(x)
        if terms is None:
            if tx is int or tx is float:
                num = num + x
            elif tx is Poly:
                terms = dict(x.terms)
                if num != 0:  # 0 + x is x itself
                    v = terms.get((), 0) + num
                    if v != 0:
                        terms[()] = v
                    else:
                        del terms[()]
            else:  # anything else: the plain operator, then carry on from its result
                num, terms = _split(num + x)
        elif tx is Poly:
            _add_terms(terms, x.terms)
            if not terms or (len(terms) == 1 and () in terms):
                num, terms = terms.get((), 0), None
        elif tx is int or tx is float:
            if x != 0:  # Poly + 0 is the Poly itself
                v = terms.get((), 0) + x
                if v != 0:
                    terms[()] = v
                else:
                    del terms[()]
        else:
            num, terms = _split(_trusted(dict(terms)) + x)
    return num if terms is None else _trusted(terms)


def _split(x: Dimlike) -> tuple[Number, dict[Monomial, Number] | None]:
    return (0, dict(x.terms)) if isinstance(x, Poly) else (x, None)


def evaluate(x: Dimlike | None, values: Mapping[str, Number]) -> Dimlike | None:
    return x.evaluate(values) if isinstance(x, Poly) else x


def to_number(x: Dimlike | None) -> float | None:
    """A plain number for a resolved cost, None for unknown or still symbolic."""
    if x is None or isinstance(x, Poly):
        return None
    return float(x)


def to_text(x: Dimlike | None) -> str:
    """`?` for unknown, the polynomial for symbolic, the number otherwise."""
    if x is None:
        return "?"
    if isinstance(x, Poly):
        return str(x)
    return _fmt_num(x)


def free_symbols(x: Dimlike | None) -> set[str]:
    return x.symbols() if isinstance(x, Poly) else set()
