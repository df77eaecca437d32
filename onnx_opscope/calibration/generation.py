"""Calibrate a decoder over a generation: ranges folded over its prefill and every decode step.

A decoder's activations depend on the phase: the prefill runs the whole prompt against an empty
cache, a decode step one token against a growing one, and calibrating on prefill-shaped batches alone
misses the decode steps' ranges (and the reverse). `calibrate` takes any re-iterable of feed dicts,
and `GenerationFeeds` is one: each time it is iterated, the decoder's greedy KV loop yields the feeds
of every step (tokens, mask, the cache so far), so calibrate's min / max pass and its histogram pass
fold the prefill and the decode steps into one range per tensor exactly as they fold batches. The
cache crosses to the host here, since calibrate's sessions take numpy feeds; each step costs one plain
run (the loop, which makes the next step's cache and token) and one run of the tapped model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from onnx import ModelProto

from ..graph.io import ModelLike
from ..run import RuntimeConfig, make_session, run_session
from ..run.generate import Decoding, _check_length, _prompt, _session_layout
from .ranges import CalibrationResult, calibrate


@dataclass(frozen=True)
class GenerationFeeds:
    """The feeds of every step of a greedy KV-cache loop: the prefill, then `steps - 1` decode steps.

    The prompt is `generate`'s (`prompt_ids`, or `tokens` random ids seeded by `seed`). Iterating
    again runs the loop again and yields the same feeds (greedy, seeded), as a second pass needs."""

    model: ModelLike
    prompt_ids: Any = None
    tokens: int | None = None
    steps: int = 16
    seed: int = 0
    runtime: RuntimeConfig | None = None
    base_dir: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        Decoding(steps=self.steps)  # the same one-line error as generate's for steps < 1

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        session = make_session(self.model, self.runtime or RuntimeConfig(), base_dir=self.base_dir)
        layout = _session_layout(session)
        prompt = _prompt(self.prompt_ids, self.tokens, self.seed, layout)
        _check_length(session, prompt.shape[1], self.steps)
        names = [layout.logits, *(present for _, present in layout.cache)]
        cache, feed, total = layout.empty_cache(prompt.shape[0]), prompt, prompt.shape[1]
        for _ in range(self.steps):
            feeds = {**layout.feeds(feed, total), **cache}
            yield feeds
            got = dict(zip(names, run_session(session, feeds, names)))
            cache = {past: got[present] for past, present in layout.cache}
            feed, total = got[layout.logits][:, -1].argmax(-1).astype(np.int64)[:, None], total + 1


def calibrate_generation(
    model: ModelLike,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray | None = None,
    *,
    tokens: int | None = None,
    steps: int = 16,
    seed: int = 0,
    runtime: RuntimeConfig | None = None,
    base_dir: str | os.PathLike | None = None,
    **options: Any,
) -> CalibrationResult:
    """`calibrate(model, ...)` over the prefill and the `steps - 1` decode steps of a greedy generation.

    `options` are calibrate's (method, op_types, symmetric, bins, percentile, progress, engine). The
    loop runs on calibrate's session settings (`runtime`, default graph optimizations off), so the cache
    and tokens it feeds are those of the model as calibrated. `result.batches` counts the steps."""
    runtime = runtime or RuntimeConfig(graph_opt="disable")
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    feeds = GenerationFeeds(model, prompt_ids, tokens, steps, seed, runtime, base_dir)
    result = calibrate(model, feeds, runtime=runtime, base_dir=base_dir, **options)
    result.options["generation"] = {"steps": steps, "tokens": tokens, "seed": seed}  # tokens: a random prompt
    return result
