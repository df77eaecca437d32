"""The user's selection: which of the sites found to tap, and which of their roles.

Empty fields select everything. A pattern that matches nothing is an error naming what
exists, with a did-you-mean, so a typo never silently records nothing.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass

from ..errors import OpscopeError, did_you_mean, listing
from .find import TAPPABLE_OPS
from .site import SITE_KINDS, Site


@dataclass(frozen=True)
class Selection:
    """What to tap. Empty fields select everything; an unmatched pattern is an error."""

    op_types: tuple[str, ...] = ()
    names: tuple[str, ...] = ()  # globs over node names and site ids
    roles: tuple[str, ...] = ()
    min_numel: int = 0
    max_sites: int | None = None
    kinds: tuple[str, ...] = ()  # gemm, attn, route, residual, norm, rotary (SITE_KINDS)


def select(sites: list[Site], sel: Selection, numel: dict[str, int] | None = None) -> list[Site]:
    """Apply `sel` to `sites`; `numel` maps tensor -> static element count where known.

    `min_numel` drops roles whose tensor is known to be smaller (unknown sizes stay); a site
    with no role left is dropped. `max_sites` keeps the first N in execution order.
    """
    numel = numel or {}
    chosen = _by_kind(sites, sel.kinds)
    chosen = _by_op(chosen, sites, sel.op_types)
    chosen = _by_name(chosen, sel.names)
    if sel.roles:
        present_roles = {t.role for s in chosen for t in s.taps}
        for r in sel.roles:
            if r not in present_roles:
                raise OpscopeError(
                    f"--role {r!r} matches no tap{did_you_mean(r, present_roles)}; roles here: {listing(present_roles)}"
                )
    result = []
    for s in chosen:
        taps = tuple(
            t
            for t in s.taps
            if (not sel.roles or t.role in sel.roles) and numel.get(t.tensor, sel.min_numel) >= sel.min_numel
        )
        if taps:
            result.append(s.with_taps(taps, tuple(t for t in s.taps if t not in taps)))
    if not result and sites:
        raise OpscopeError(
            f"the selection leaves no tensor to tap (min size {sel.min_numel} elements)",
            hint="lower --min-numel or widen --op/--name/--role",
        )
    return result if sel.max_sites is None else result[: sel.max_sites]


def _by_kind(sites: list[Site], kinds: tuple[str, ...]) -> list[Site]:
    if not kinds:
        return sites
    for k in kinds:
        if k not in SITE_KINDS:
            raise OpscopeError(
                f"--kind {k!r} is not a site kind{did_you_mean(k, SITE_KINDS)}; kinds: {', '.join(SITE_KINDS)}"
            )
    chosen = [s for s in sites if s.kind in kinds]
    if not chosen and sites:
        raise OpscopeError(
            f"--kind {','.join(kinds)} matches no site; the model has: "
            f"{listing(f'{a} ({b})' for a, b in Counter(s.kind for s in sites).items())}"
        )
    return chosen


def _by_op(chosen: list[Site], sites: list[Site], op_types: tuple[str, ...]) -> list[Site]:
    if not op_types:
        return chosen
    present = {s.op_type for s in sites}
    wanted = {o.lower(): o for o in TAPPABLE_OPS}
    for op in op_types:
        canon = wanted.get(op.lower())
        if canon is None:
            raise OpscopeError(
                f"--op {op!r} is not an op we can tap{did_you_mean(op, TAPPABLE_OPS)}; "
                f"tappable: {listing(TAPPABLE_OPS, limit=20)}"
            )
        if canon not in present:
            raise OpscopeError(
                f"--op {op!r} matches no node; the model has: "
                f"{listing(f'{k} ({v})' for k, v in Counter(s.op_type for s in sites).items())}"
            )
    keep = {wanted[o.lower()] for o in op_types}
    return [s for s in chosen if s.op_type in keep]


def _by_name(chosen: list[Site], patterns: tuple[str, ...]) -> list[Site]:
    if not patterns:
        return chosen
    for pat in patterns:
        if not any(_name_match(s, pat) for s in chosen):
            ids = [s.id for s in chosen]
            raise OpscopeError(
                f"--name {pat!r} matches no site{did_you_mean(pat, ids)}; sites: {listing(ids)}"
            )
    return [s for s in chosen if any(_name_match(s, p) for p in patterns)]


def _name_match(site: Site, pattern: str) -> bool:
    return fnmatch.fnmatchcase(site.id, pattern) or (
        bool(site.node) and fnmatch.fnmatchcase(site.node, pattern)
    )
