"""Live sampling: sketches of a serving session's tensors on 1 call in N, in memory that does not grow.

`LiveRecorder(session_or_model, every=N)` stands in for the session a service already runs (the
same `.run`). N - 1 calls in N go straight to the plain session: a counter (`itertools.count`,
atomic under the GIL, so threads may share the recorder) and a branch. The N-th runs the
instrumented model instead, tapped with `elemsig` only (each tensor's 4,096-element sample, a
gather and no reduction: the cheapest tap there is), and updates bounded online sketches
(`sketch.online`):

- per tapped tensor: KLL quantiles of up to `values_per_tap` evenly strided values of its sample.
  Values go into a window sketch; every `window` sampled calls the window is closed: the first is
  the baseline, each later one is compared with it (`shift`: the KS distance of the value
  distributions, noise ~0.03 at k = 200) and merged into the all-time sketch. A KLL update costs
  ~50-70 ns a value: 256 values of each of ppocrv4_det's 131 sampled tensors are ~2.5 ms, their
  whole 4,096-value samples would be ~35 ms a sampled call;
- per site: an HLL of fingerprints of its live inputs (the samples of its roles other than `out`,
  the 4,096 values `elemsig` picks its 16 from: as cheap to hash, and far fewer false repeats
  than 16 values), so repeat share = 1 - distinct / seen: what a memo of the site would hit. A
  sample of zeros only says nothing (the miner's rule): it is left out;
- the model's inputs: an HLL of fingerprints of the whole feeds, exact: what `GuardedMemo` on the
  session would hit;
- per tapped tensor, `step_change`: the mean relative L2 distance of elemsig between consecutive
  sampled calls (what the miner calls drift, `findings.signals.temporal_signals`).

Memory is fixed by the sites once built: per tensor four KLL sketches (2-2.5 KB each, at most
`online.KLL_MAX_BYTES`), per site one HLL (4 KB at most), per tensor one elemsig; nothing is kept
per call, no table (ppocrv4_det: 251 KB after 1,500 calls, `max_memory_bytes` 2.5 MB).

Measured (scripts/bench_live.py, ppocrv4_det, 1 thread, a loaded 2-core machine): an unsampled
call 1.003x a plain one (the wrapper alone: +0.2-0.6 us a call); a sampled call ~5-7x (the tapped
session 2.7x, the plain one again since the tapped outputs are not bit-identical at `all`, the
sketch updates ~10 ms: ~75 us a tensor, its KLL update, hash and elemsig); every=100 amortized 1.05x.

Outputs: every call returns what the plain session returns, bit for bit. The first sampled call
also runs the plain session and compares each output's bytes; when they match, later sampled calls
return the tapped session's outputs (they run instead of the plain one); when not (a tap stopped a
fusion at `graph_opt="all"`, see `record`'s parity gate), every sampled call also runs the plain
session for the outputs, and `summary()` says so. `check="always"` runs both on every sampled call.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import ModelProto

from .. import sketch as sk
from ..errors import OpscopeError
from ..graph.io import ModelLike
from ..instrument import Manifest, SiteRecord, TapRecord, inject
from ..instrument.packing import unpacked
from ..sites import Selection, Site
from ..sketch import online
from .kernels import checked_sites
from .session import GRAPH_OPT_LEVELS, RuntimeConfig, for_tapped, make_session, resolve_providers

CHECKS = ("first", "always")


@dataclass(frozen=True)
class LiveFinding:
    """One opportunity or warning from live traffic: `rule` fired on `signal` = `value` (vs `threshold`)
    over `evidence` sampled calls; `guard` is what must hold before acting on it."""

    site: str
    op_type: str
    rule: str  # "memoize" or "drift"
    signal: str
    value: float
    threshold: float
    evidence: int
    guard: str


class _Tensor:
    """The quantile sketches of one tapped tensor. State is real: the open window and its count."""

    __slots__ = ("all", "base", "last", "window", "calls")

    def __init__(self) -> None:
        self.all = online.quantile_sketch()  # every closed window
        self.base: Any = None  # the first closed window
        self.last: Any = None  # the latest closed window after the baseline
        self.window = online.quantile_sketch()
        self.calls = 0  # sampled calls in the open window

    def add(self, values: np.ndarray, window: int) -> None:
        online.add_values(self.window, values)
        self.calls += 1
        if self.calls == window:
            self.all.merge(self.window)
            if self.base is None:
                self.base = self.window
            else:
                self.last = self.window
            self.window, self.calls = online.quantile_sketch(), 0

    def quantiles(self) -> Any:
        return online.merge_quantiles([self.all, self.window])

    def shift(self) -> float:
        return online.ks_distance(self.base, self.last) if self.last is not None else math.nan

    def sketches(self) -> list[Any]:
        return [s for s in (self.all, self.base, self.last, self.window) if s is not None]


class _Site:
    """A site's input fingerprints: an HLL and how many sampled calls gave one."""

    __slots__ = ("record", "inputs", "distinct", "seen")

    def __init__(self, record: SiteRecord, inputs: list[str]) -> None:
        self.record, self.inputs = record, inputs  # inputs: the tap ids of its live input roles
        self.distinct = online.distinct_sketch()
        self.seen = 0


class LiveRecorder:
    """A session stand-in that records bounded online sketches on every `every`-th call (see module doc).

    `session_or_model`: an InferenceSession-like object (`.run(output_names, input_feed,
    run_options=None)`) or a model (path or ModelProto: a plain session is made on `runtime`).
    `model`: the model of a given session, when the session cannot say (onnxruntime's keeps its
    path, or bytes). `runtime`: how the tapped session runs (default: the session's providers,
    optimization level and threads). `sites`: which sites to tap (None: all). `window`: sampled
    calls per quantile window. `input_shapes`: the shapes the service feeds, so that small tensors
    are copied out whole instead of tapped (`inject`). State is real (counters, sketches): a class.
    """

    def __init__(
        self,
        session_or_model: Any,
        every: int = 100,
        *,
        model: ModelLike | None = None,
        runtime: RuntimeConfig | None = None,
        sites: list[Site] | Selection | None = None,
        window: int = 32,
        values_per_tap: int = 256,
        check: str = "first",
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        base_dir: str | os.PathLike | None = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise OpscopeError(f"every {every!r}: expected a positive integer (1 samples every call)")
        if not isinstance(window, int) or window < 1:
            raise OpscopeError(f"window {window!r}: expected a positive integer")
        if check not in CHECKS:
            raise OpscopeError(f"check {check!r}: choose one of {', '.join(CHECKS)}")
        if hasattr(session_or_model, "run"):
            self.session = session_or_model
            model = model if model is not None else _model_of(session_or_model)
            runtime = runtime or _runtime_of(session_or_model)
        else:
            model = session_or_model
            runtime = runtime or RuntimeConfig()
            self.session = make_session(model, runtime, base_dir=base_dir)
        if base_dir is None and isinstance(model, str | os.PathLike):
            base_dir = Path(model).parent
        self.every, self.window, self.values_per_tap, self.check = every, window, values_per_tap, check
        self.manifest, self.tapped = _tapped_session(model, sites, runtime, base_dir, input_shapes)
        self.options = self.manifest.sketch_options()
        self._taps = [t for t in self.manifest.taps if _sample_output(t) is not None]
        self._tensors = {t.id: _Tensor() for t in self._taps}
        self._sites = [
            _Site(s, [tid for role, tid in s.roles.items() if role != "out" and tid in self._tensors])
            for s in self.manifest.sites
        ]
        self._inputs = online.distinct_sketch()
        self._tap_names = [_sample_output(t) for t in self._taps]
        # what a sampled call fetches: the samples' own outputs, or the packs they are in (all of them:
        # a packed sample's length comes from its shape, in the shapes pack)
        members = self.manifest.layout.members if self.manifest.packed else set()
        packs = [o for p in self.manifest.packed for o in (p["output"], p.get("shapes")) if o]
        self._fetch = [n for n in dict.fromkeys(self._tap_names) if n not in members] + packs
        # elemsig of each tapped tensor at the last sampled call (zero-padded to elemsig_k), and the
        # running sum and count of its step-to-step distances: one vectorized pass a sampled call
        k = self.options.elemsig_k
        self._sigs = np.zeros((len(self._taps), k))
        self._sig_seen = np.zeros(len(self._taps), bool)
        self._step_sum = np.zeros(len(self._taps))
        self._steps = np.zeros(len(self._taps), np.int64)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self.sampled = 0  # calls that ran the tapped session: every-th, 2 x every-th, ...
        self.outputs_match: bool | None = None  # None until the first sampled call compared them

    # ------------------------------------------------------------------------------------------
    # the session's interface

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None):
        if next(self._counter) % self.every:
            return self.session.run(output_names, input_feed, run_options)
        return self._sampled(output_names, input_feed, run_options)

    def __getattr__(self, name: str) -> Any:  # get_inputs, get_outputs, get_providers, ...
        if name == "session":  # not set yet: __init__ failed before it
            raise AttributeError(name)
        return getattr(self.session, name)

    def _sampled(self, output_names: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any):
        names = list(output_names) if output_names is not None else list(self.manifest.original_outputs)
        got = self.tapped.run(names + self._fetch, dict(feed), run_options)
        outputs = got[: len(names)]
        fetched = unpacked(self.manifest, dict(zip(self._fetch, got[len(names) :])))
        taps = [fetched[n] for n in self._tap_names]
        with self._lock:
            if self.check == "always" or self.outputs_match is not True:
                plain = self.session.run(output_names, feed, run_options)
                if self.outputs_match is None:
                    self.outputs_match = all(_same_bits(a, b) for a, b in zip(plain, outputs))
                outputs = plain
            self.sampled += 1
            self._update(dict(zip((t.id for t in self._taps), taps)), feed)
        return outputs

    def _update(self, raw: dict[str, np.ndarray], feed: Mapping[str, Any]) -> None:
        prints: dict[
            str, int
        ] = {}  # tap id -> fingerprint of its sample, for those that ran and were not all zero
        sigs = np.zeros_like(self._sigs)
        ran = np.zeros(len(self._taps), bool)
        for i, tap in enumerate(self._taps):
            x = _sample_of(tap, raw[tap.id], self.options)
            if x is None:  # an If branch that did not run
                continue
            stride = max(1, x.size // self.values_per_tap)
            self._tensors[tap.id].add(x[::stride][: self.values_per_tap], self.window)
            e = x[_elemsig_positions(x.size, self.options.elemsig_k)]  # histogram.elemsig_of
            sigs[i, : e.size] = e
            ran[i] = True
            if x.any():
                prints[tap.id] = online.fingerprint([x])
        self._step_changes(sigs, ran)
        for site in self._sites:
            parts = [prints[t] for t in site.inputs if t in prints]
            if parts:  # one tensor often feeds several sites: its sample is hashed once
                site.distinct.update(parts[0] if len(parts) == 1 else online.fingerprint([np.array(parts)]))
                site.seen += 1
        self._inputs.update(online.fingerprint([np.asarray(feed[k]) for k in sorted(feed)]))

    def _step_changes(self, sigs: np.ndarray, ran: np.ndarray) -> None:
        """Add each tensor's ||e_t - e_t-1|| / max(||e_t||, ||e_t-1||) (non-finite entries as 0, 0 for two
        zero vectors: `findings.signals.rel_dist`), for the tensors that ran now and before."""
        sigs = np.where(np.isfinite(sigs), sigs, 0.0)
        both = ran & self._sig_seen
        scale = np.maximum(np.linalg.norm(sigs, axis=1), np.linalg.norm(self._sigs, axis=1))
        dist = np.linalg.norm(sigs - self._sigs, axis=1)
        step = np.divide(dist, scale, out=np.zeros_like(dist), where=scale > 0)
        self._step_sum[both] += step[both]
        self._steps[both] += 1
        self._sigs[ran] = sigs[ran]
        self._sig_seen |= ran

    # ------------------------------------------------------------------------------------------
    # reports

    def summary(self) -> dict:
        """What the sampled calls showed: per site and role the quantiles (p1, p50, p99), shift and
        step change of the tensor; per site the repeat share of its inputs; the model inputs' repeat
        share; the memory the sketches hold."""
        with self._lock:
            rows = []
            index = {t.id: i for i, t in enumerate(self._taps)}
            for site in self._sites:
                rec = site.record
                repeat = _repeat_share(site.distinct, site.seen)
                for role, tid in rec.roles.items():
                    t = self._tensors.get(tid)
                    if t is None:
                        continue
                    q = t.quantiles()
                    p01, p50, p99 = q.get_quantiles([0.01, 0.5, 0.99]) if not q.is_empty() else [math.nan] * 3
                    rows.append({
                        "site": rec.id, "op_type": rec.op_type, "role": role, "values": q.n,
                        "p01": float(p01), "p50": float(p50), "p99": float(p99), "shift": t.shift(),
                        "step_change": self._step_change(index[tid]),
                        "repeat_share": repeat, "seen": site.seen,
                    })  # fmt: skip
            return {
                "every": self.every,
                "sampled": self.sampled,
                "window": self.window,
                "outputs_match": self.outputs_match,
                "inputs_seen": self.sampled,
                "inputs_repeat_share": _repeat_share(self._inputs, self.sampled),
                "kll_rank_error": online.rank_error(),
                "memory_bytes": self.memory_bytes(),
                "sites": rows,
            }

    def findings(self, memo_min: float = 0.2, shift_max: float = 0.1, min_seen: int = 8) -> list[LiveFinding]:
        """Memoize where the model's inputs, or a site's, repeat on at least `memo_min` of the sampled
        calls (seen on `min_seen` or more); a site only where it repeats more often than the model's
        inputs by `memo_min / 4` (when the whole input repeats, every site does: the model-level memo
        covers them). Drift where a window's values moved from the baseline's by a KS distance above
        `shift_max` (the noise of two k = 200 sketches is ~0.03)."""
        s = self.summary()
        out = []
        whole = s["inputs_repeat_share"] if s["inputs_seen"] >= min_seen else math.nan
        if whole >= memo_min:
            guard = "BLAKE2b of every input, then np.array_equal of their bytes (run.memo.GuardedMemo)"
            out.append(LiveFinding("<inputs>", "model", "memoize", "repeat_share", whole, memo_min,
                                   s["inputs_seen"], guard))  # fmt: skip
        floor = max(memo_min, whole + memo_min / 4) if math.isfinite(whole) else memo_min
        done = set()
        for r in s["sites"]:
            if r["site"] not in done and r["seen"] >= min_seen and r["repeat_share"] >= floor:
                done.add(r["site"])
                guard = "hash and exact equality of the site's inputs before reusing its output"
                out.append(LiveFinding(r["site"], r["op_type"], "memoize", "repeat_share", r["repeat_share"],
                                       memo_min, r["seen"], guard))  # fmt: skip
            if r["shift"] > shift_max:
                guard = (
                    f"re-check calibrated ranges of {r['role']}: p1..p99 now {r['p01']:.3g}..{r['p99']:.3g}"
                )
                out.append(LiveFinding(r["site"], r["op_type"], "drift", f"shift({r['role']})", r["shift"],
                                       shift_max, self.sampled, guard))  # fmt: skip
        return sorted(out, key=lambda f: (f.rule, -f.value, f.site))

    def _step_change(self, i: int) -> float:
        return float(self._step_sum[i] / self._steps[i]) if self._steps[i] else math.nan

    def memory_bytes(self) -> int:
        """Bytes the sketches hold (their serialized sizes): fixed by the sites, log n for KLL."""
        kll = sum(len(s.serialize()) for t in self._tensors.values() for s in t.sketches())
        hll = sum(s.distinct.get_updatable_serialization_bytes() for s in self._sites)
        arrays = self._sigs.nbytes + self._sig_seen.nbytes + self._step_sum.nbytes + self._steps.nbytes
        return kll + hll + self._inputs.get_updatable_serialization_bytes() + arrays

    def max_memory_bytes(self) -> int:
        """What `memory_bytes` can reach, however many calls: four KLL sketches a tensor at their bound,
        an HLL a site and one for the inputs at theirs. Fixed when the recorder is built."""
        arrays = self._sigs.nbytes + self._sig_seen.nbytes + self._step_sum.nbytes + self._steps.nbytes
        return (
            4 * len(self._tensors) * online.KLL_MAX_BYTES
            + (len(self._sites) + 1) * online.hll_max_bytes()
            + arrays
        )

    def sketches(self) -> list[dict]:
        """Entries for `online.save_sketches`: per site and role its all-time KLL, per site its HLL."""
        with self._lock:
            out = [
                {"site": "<inputs>", "role": "", "stat": "hll", "seen": self.sampled, "sketch": self._inputs}
            ]
            for site in self._sites:
                rec = site.record
                if site.inputs:
                    out.append(
                        {
                            "site": rec.id,
                            "role": "",
                            "stat": "hll",
                            "seen": site.seen,
                            "sketch": site.distinct,
                        }
                    )
                for role, tid in rec.roles.items():
                    if tid in self._tensors:
                        q = self._tensors[tid].quantiles()
                        out.append({"site": rec.id, "role": role, "stat": "kll", "seen": q.n, "sketch": q})
            return out

    def save(self, path: str | os.PathLike) -> Path:
        """The sketches as a JSON file (`online.save_sketches`), whole or not at all."""
        meta = {"every": self.every, "sampled": self.sampled, "window": self.window,
                "model": self.manifest.source, "model_sha256": self.manifest.source_sha256}  # fmt: skip
        return online.save_sketches(path, self.sketches(), meta)


# ----------------------------------------------------------------------------------------------


def _tapped_session(
    model: ModelLike, sites: list[Site] | Selection | None, runtime: RuntimeConfig,
    base_dir: str | os.PathLike | None, input_shapes: Mapping[str, Sequence[int]] | None,
) -> tuple[Manifest, Any]:  # fmt: skip
    """The model tapped with `elemsig` (its sample) at every chosen site, less the taps that would change
    onnxruntime's integer kernels (`run.kernels`), and its session (priority order, `for_tapped`)."""
    providers = resolve_providers(runtime.providers, fallback=runtime.fallback)
    options = sk.for_providers(sk.SketchOptions(), providers)

    def build(chosen):
        return inject(model, chosen, ["elemsig"], options, providers=providers, input_shapes=input_shapes)

    chosen, _ = checked_sites(model, sites, runtime, base_dir, lambda c: build(c).model)
    instrumented, manifest = build(chosen)
    session = make_session(instrumented, for_tapped(runtime), base_dir=base_dir, take_weights=True)
    return manifest, session


def _model_of(session: Any) -> ModelLike:
    """An onnxruntime session's model: the path it was made from, or its bytes."""
    path = getattr(session, "_model_path", None)
    if path:
        return path
    data = getattr(session, "_model_bytes", None)
    if data:
        model = ModelProto()
        model.ParseFromString(data)
        return model
    raise OpscopeError(
        f"cannot tell which model this {type(session).__name__} runs",
        hint="pass it as LiveRecorder(session, model=<path or ModelProto>)",
    )


def _runtime_of(session: Any) -> RuntimeConfig:
    """The providers, optimization level and threads of an onnxruntime session (defaults otherwise)."""
    if not isinstance(session, ort.InferenceSession):
        return RuntimeConfig()
    so = session.get_session_options()
    level = next((k for k, v in GRAPH_OPT_LEVELS.items() if v == so.graph_optimization_level), "all")
    return RuntimeConfig(session.get_providers(), level, so.intra_op_num_threads or None)


def _sample_output(tap: TapRecord) -> str | None:
    """The graph output holding the tap's sample (or the whole tensor, copied out); None for a weight."""
    if tap.constant:
        return None
    return tap.outputs.get("tensor" if tap.copied else "samples")


def _sample_of(tap: TapRecord, raw: np.ndarray, options: sk.SketchOptions) -> np.ndarray | None:
    """The tensor's sample as float32 (`histogram.sample_positions` of a copied tensor); None if it did
    not run. Loop / Scan iterations (stacked on leading axes) are taken together."""
    x = np.asarray(raw)
    if x.size == 0:
        return None
    flat = x.astype(np.float32, copy=False).ravel()
    if not tap.copied or flat.size <= options.sample_size:  # a sample, or a tensor that is its own sample
        return flat
    return flat[sk.sample_positions(flat.size, options.sample_size)]


@functools.lru_cache(maxsize=64)
def _elemsig_positions(m: int, k: int) -> np.ndarray:
    """Where `histogram.elemsig_of` reads a sample of m values: min(k, m) positions j * m / k."""
    k = min(m, k)
    return (np.arange(k, dtype=np.int64) * m) // max(k, 1)


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _repeat_share(distinct: Any, seen: int) -> float:
    """1 - distinct / seen, the HLL's estimate clipped to [1, seen]; NaN before anything was seen."""
    if not seen:
        return math.nan
    return 1.0 - min(max(distinct.get_estimate(), 1.0), seen) / seen
