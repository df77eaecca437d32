"""Running models: feeds, sessions and providers, the recorder and its table, parity runs.

- `feeds`: seeded synthetic distributions or real data files, checked against the model;
- `session`: execution providers by short name, session options, one-line failures;
- `kernels`: `keep_kernels`, the taps that would change onnxruntime's integer kernels, left out;
- `recorder`: `record` (inject, run every batch, decode, append to the table, parity gate);
- `generate`: a decoder's KV-cache loop, each prefill / decode step recorded like one of `record`'s batches;
- `table`: the tidy sketch table, written batch by batch, and `read_table`;
- `parity`: a model against its rewrite or against itself on another provider;
- `parity_generate`: two decoders over one generated sequence, B fed A's tokens, step by step;
- `rewrite`: a rewrite saved beside its source's weights, and scored against it;
- `weights`: weight plans per byte budget, each applied and scored end to end;
- `engine`: where batches run (this process, or Ray workers);
- `live`: `LiveRecorder`, a serving session sampled on 1 call in N into bounded online sketches;
- `memo`: `GuardedMemo`, a session whose outputs are cached under a hash and an exact-bytes guard.
"""

from .engine import Engine
from .feeds import (
    DISTRIBUTIONS,
    FeedSpec,
    first_batch_shapes,
    input_signature,
    iter_feeds,
    load_data,
    synthetic_feeds,
)
from .generate import CacheLayout, GenerateResult, cache_layout, generate
from .kernels import KernelChange, KernelChangeWarning, keep_kernels
from .live import LiveFinding, LiveRecorder
from .memo import GuardedMemo
from .parity import parity, parity_models, parity_providers, validate_skips
from .parity_generate import GenerationParity, parity_generation
from .recorder import RecordResult, record
from .rewrite import WrittenRewrite, write_rewrite
from .session import RuntimeConfig, make_session, resolve_providers
from .session import run as run_session
from .table import SCHEMA, read_table, sidecar_paths
from .weights import WeightPlans, plan_weights

__all__ = [
    "DISTRIBUTIONS",
    "SCHEMA",
    "FeedSpec",
    "KernelChange",
    "KernelChangeWarning",
    "RecordResult",
    "RuntimeConfig",
    "input_signature",
    "iter_feeds",
    "first_batch_shapes",
    "keep_kernels",
    "load_data",
    "make_session",
    "parity",
    "parity_models",
    "parity_providers",
    "parity_generation",
    "GenerationParity",
    "read_table",
    "record",
    "resolve_providers",
    "run_session",
    "sidecar_paths",
    "synthetic_feeds",
    "validate_skips",
    "write_rewrite",
    "WrittenRewrite",
    "WeightPlans",
    "plan_weights",
    "Engine",
    "LiveRecorder",
    "LiveFinding",
    "GuardedMemo",
    "CacheLayout",
    "GenerateResult",
    "cache_layout",
    "generate",
]
