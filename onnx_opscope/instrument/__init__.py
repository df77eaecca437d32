"""Instrumentation: the tapped model, its manifest, and turning a run's outputs back into rows.

- `plan`: sites x sketches -> one tap per tensor;
- `inject`: the pipeline plan -> build -> expose -> splice -> manifest (`inject`, `inject_file`);
- `templates`: tap subgraphs built once per signature and copied by renaming their bytes;
- `samples`: one sample index for all the taps of one shape, not one per tap;
- `folded`: tensors made from weights alone, tapped as weights;
- `shadow`: the softmax a fused attention op keeps inside its kernel, rebuilt next to it;
- `manifest`: what every extra output means (saved as JSON beside the model);
- `packing`: the main graph's small raws joined into four outputs (each output costs ~2 µs a
  run), and `unpacked`, which reads them back by name;
- `decode` and `rows`: outputs -> sketch values -> tidy rows (Arrow);
- `host`: the sketches of weights, computed once on the host instead of in the graph.
"""

from .decode import HostValues, decode, decode_many, decode_tap, decode_taps, gemm_dims
from .host import host_values
from .inject import PLACEMENTS, Instrumented, inject, inject_file, sites_of
from .manifest import Manifest, SiteRecord, TapRecord, load_manifest, manifest_path_for
from .packing import unpacked
from .rows import Rows

__all__ = [
    "PLACEMENTS",
    "HostValues",
    "Instrumented",
    "Manifest",
    "Rows",
    "SiteRecord",
    "TapRecord",
    "decode",
    "decode_many",
    "decode_tap",
    "decode_taps",
    "gemm_dims",
    "host_values",
    "inject",
    "inject_file",
    "sites_of",
    "unpacked",
    "load_manifest",
    "manifest_path_for",
]
