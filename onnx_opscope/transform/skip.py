"""Skip residual blocks: a residual Add x + f(x) becomes Identity(x), and the dead block f goes.

The Add keeps its output name, so nothing downstream changes; `prune` then removes the
block's nodes and every initializer only it used, so its weights and compute really
disappear (external data is never loaded: removed weights simply stop being referenced).
"""

from __future__ import annotations

import fnmatch

from ..errors import OpscopeError, did_you_mean, listing
from ..graph.index import ModelIndex
from ..graph.io import ModelLike, load_model
from ..sites import Site, find_sites
from .prune import prune
from .result import Rewritten, SkippedBlock, check_rewrite, copy_of


def residual_sites(model: ModelLike) -> list[Site]:
    """The residual Adds `skip_blocks` can remove, in execution order."""
    return [s for s in find_sites(load_model(model)) if s.kind == "residual"]


def resolve_blocks(sites: list[Site], blocks: list[str]) -> list[Site]:
    """Residual sites named by `blocks`: site ids, node names, globs, or N (the N-th, from 0)."""
    chosen: dict[str, Site] = {}
    ids = [s.id for s in sites]
    for spec in blocks:
        spec = spec.strip()
        if spec.lstrip("-").isdigit():
            k = int(spec)
            if not -len(sites) <= k < len(sites):
                raise OpscopeError(
                    f"--blocks {spec}: the model has {len(sites)} residual Adds (0..{len(sites) - 1})"
                )
            matched = [sites[k]]
        else:
            matched = [
                s
                for s in sites
                if fnmatch.fnmatchcase(s.id, spec) or (s.node and fnmatch.fnmatchcase(s.node, spec))
            ]
        if not matched:
            raise OpscopeError(
                f"--blocks {spec!r} matches no residual Add{did_you_mean(spec, ids)}; "
                f"residual Adds: {listing(ids, limit=20) or 'none'}",
                hint="a residual Add is x + f(x) where f holds weights (MatMul, Conv, ...); "
                "`opscope rewrite skip MODEL --list` lists them",
            )
        chosen.update((s.id, s) for s in matched)
    return sorted(chosen.values(), key=lambda s: s.order)


def skip_blocks(model: ModelLike, adds: list[str]) -> Rewritten:
    """A copy of `model` with each chosen residual Add replaced by its residual input, dead code removed.

    `adds`: residual Add site ids, node names, globs or execution-order indices (see `resolve_blocks`).
    """
    source, m = copy_of(model)
    sites = resolve_blocks(residual_sites(m), adds)
    index = ModelIndex(m)
    skipped = []
    for site in sites:
        entry = index[site.graph]
        node = entry.graph.node[entry.ids.index(site.id)]
        keep = int(site.attrs.get("skip", 0))
        kept, dropped = node.input[keep], node.input[1 - keep]
        node.op_type = "Identity"
        del node.input[:]
        node.input.append(kept)
        del node.attribute[:]
        skipped.append(SkippedBlock(site.id, node.name, kept, dropped))
    result = Rewritten(m, "skip_blocks", skipped=skipped, pruned=prune(m))
    check_rewrite(source, m, "skip_blocks")
    return result
