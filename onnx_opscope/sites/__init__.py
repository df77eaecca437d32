"""Which tensors to tap: sites of the kinds we know, their roles, and the user's selection.

One module per site family (`gemm`, `attention`, `routing`, `residual`), each a finder
`(node, view) -> taps` over the model index (`graph.index`) and the shape table
(`shapes`); `find` runs them over every graph, `select` applies the user's `Selection`.
Adding a site kind: a finder module, one line in `find._FINDERS`, and its default sketches
in `site.KIND_SKETCHES`.
"""

from .attention import SHADOW_SUFFIX
from .find import TAPPABLE_OPS, find_sites, subgraphs_not_tappable
from .select import Selection, select
from .site import KIND_SKETCHES, SITE_KINDS, Dequant, Site, Tap, all_roles

__all__ = [
    "KIND_SKETCHES",
    "Dequant",
    "SHADOW_SUFFIX",
    "SITE_KINDS",
    "TAPPABLE_OPS",
    "Selection",
    "Site",
    "Tap",
    "all_roles",
    "find_sites",
    "select",
    "subgraphs_not_tappable",
]
