"""Generate: a decoder's autoregressive loop over its KV cache, each step's taps recorded like `record`'s batches.

`record` feeds independent batches, so a decoder would run on a synthetic past; here every step
feeds the `present.*` outputs of the step before back as `past_key_values.*` (`cache_layout` reads
which output feeds which input from the names: the transformers / optimum convention
`past_key_values.{i}.key` -> `present.{i}.key`, and its `past_*` -> `present_*` kin). Step 0 is the
prefill (the whole prompt), steps 1, 2, ... decode one token each; the table gets two columns
beyond record's, `phase` ("prefill" / "decode") and `position` (the sequence position of the
step's first token: 0 for the prefill, then prompt length, prompt length + 1, ...).

The instrumentation, decoding and table code are `record`'s (`inject`, `decode`, `recorder`'s sink
and pipeline, `table`): a step is a batch. The KV tensors stay in onnxruntime OrtValues between steps
(IOBinding: the presents are bound as outputs on the provider's device and rebound as the next
step's pasts), so they never go through numpy; only the logits and the taps' small outputs are
copied to the host. With `out=None` the same loop runs the plain model: the baseline to compare
an instrumented run's tokens and logits with.
"""

from __future__ import annotations

import gc
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow as pa
from onnx import ModelProto

from .. import sketch as sk
from ..compare import DropIn
from ..errors import OpscopeError, listing
from ..files import check_writable
from ..graph.chunks import weight_bytes
from ..graph.io import ModelLike, file_sha256, load_model
from ..instrument import HostValues, Manifest, Rows, decode_many, host_values, inject, sites_of
from ..instrument.rows import arrow_int64, arrow_strings
from ..sites import Selection, Site
from ..sites.kv import cache_views, without_cache_views
from .feeds import InputSpec, describe_feeds, input_signature
from .kernels import checked_sites
from .recorder import (
    LATE_PARITY_BYTES,
    BatchPipeline,
    Decoded,
    _parity_gate,
    _providers_quietly,
    _Sink,
    decode_group,
    in_place_if_big,
)
from .recorder import default_parity_tolerance as _default_tol
from .session import RuntimeConfig, for_tapped, make_session, session_signature
from .session import _one_line as one_line
from .table import TableWriter, batches_table, format_of, is_table_folder, sidecar_paths

PHASES = ("prefill", "decode")
# metadata_props that bound a sequence (scripts/make_decoder.py writes the first, transformers' config name)
MAX_LENGTH_KEYS = ("max_position_embeddings", "max_length", "n_positions")
_PAST = re.compile(r"^(past_key_values|past)(?=[._])")
_IDS = ("input_ids", "ids", "tokens")
_MASK = ("attention_mask",)
_POSITIONS = ("position_ids",)
_DEVICES = {"CUDAExecutionProvider": "cuda", "ROCMExecutionProvider": "rocm", "DmlExecutionProvider": "dml"}


@dataclass(frozen=True)
class CacheLayout:
    """Which inputs a step feeds and which output becomes which past: what `generate` needs of a decoder.

    `cache`: (past input, present output) pairs; `past_shapes`: each past's dims with `None` for the
    batch and 0 on its sequence axis (the empty cache of the prefill); `vocab`: the logits' last dim
    when static."""

    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    logits: str
    cache: tuple[tuple[str, str], ...]
    past_shapes: dict[str, tuple[int | None, ...]]
    dtypes: dict[str, np.dtype]
    vocab: int | None = None

    def empty_cache(self, batch: int) -> dict[str, np.ndarray]:
        return {p: np.zeros([batch if d is None else d for d in self.past_shapes[p]], self.dtypes[p])
                for p, _ in self.cache}  # fmt: skip

    def feeds(self, ids: np.ndarray, total: int) -> dict[str, np.ndarray]:
        """The non-cache inputs of a step feeding `ids` [batch, seq] with `total` tokens in the sequence so far."""
        batch, seq = ids.shape
        out = {self.input_ids: ids.astype(self.dtypes[self.input_ids])}
        if self.attention_mask:
            out[self.attention_mask] = np.ones((batch, total), self.dtypes[self.attention_mask])
        if self.position_ids:
            positions = np.arange(total - seq, total, dtype=self.dtypes[self.position_ids])
            out[self.position_ids] = np.ascontiguousarray(np.broadcast_to(positions, (batch, seq)))
        return out


def cache_layout(inputs: Sequence[InputSpec], outputs: Sequence[str]) -> CacheLayout:
    """The KV-cache layout of a decoder with these inputs and outputs; one-line OpscopeError when unrecognised."""
    names = [s.name for s in inputs]
    expected = (
        "expected input_ids, optionally attention_mask / position_ids, and past_key_values.{i}.key/value "
        "inputs each with a present.{i}.key/value output (or past_* -> present_* names)"
    )

    def unrecognised(why: str) -> OpscopeError:
        return OpscopeError(f"not a decoder with a KV cache generate can drive: {why}; inputs: {listing(names)}",
                            hint=expected)  # fmt: skip

    ids = next((n for n in _IDS if n in names), None)
    if ids is None:
        raise unrecognised("no input_ids input")
    pasts = [s for s in inputs if _PAST.match(s.name)]
    if not pasts:
        raise unrecognised("no past_key_values.* input")
    cache, shapes = [], {}
    dtypes = {s.name: s.dtype or np.dtype(np.int64) for s in inputs}
    for spec in pasts:
        present = _PAST.sub("present", spec.name)
        if present not in outputs:
            raise unrecognised(
                f"input {spec.name!r} has no output {present!r} (outputs: {listing(list(outputs))})"
            )
        cache.append((spec.name, present))
        shapes[spec.name] = _empty_dims(spec, unrecognised)
    mask = next((n for n in _MASK if n in names), None)
    positions = next((n for n in _POSITIONS if n in names), None)
    other = [n for n in names if n not in {ids, mask, positions} and not _PAST.match(n)]
    if other:
        raise unrecognised(f"input {listing(other)} is neither the tokens, a mask, positions nor a cache")
    rest = [o for o in outputs if o not in dict(cache).values()]
    logits = next((o for o in rest if "logits" in o), rest[0] if rest else None)
    if logits is None:
        raise unrecognised("no output beside the presents to take the logits from")
    return CacheLayout(ids, mask, positions, logits, tuple(cache), shapes, dtypes)


def _empty_dims(spec: InputSpec, unrecognised: Callable[[str], OpscopeError]) -> tuple[int | None, ...]:
    """A past's dims for the empty cache: batch (axis 0) left open, its one symbolic axis 0, the rest static."""
    dims = spec.dims or []
    if spec.dtype is None or len(dims) < 3:
        raise unrecognised(
            f"cache input {spec.name!r} is not a float tensor of rank 3 or more ({spec.type_name})"
        )
    open_axes = [a for a in range(1, len(dims)) if not isinstance(dims[a], int)]
    if len(open_axes) != 1:
        raise unrecognised(f"cache input {spec.name!r} has dims {dims}: expected one symbolic sequence axis "
                           "beside the batch, the head and size axes static")  # fmt: skip
    return tuple(None if a == 0 else 0 if a == open_axes[0] else dims[a] for a in range(len(dims)))


def _session_layout(session: ort.InferenceSession, originals: Sequence[str] | None = None) -> CacheLayout:
    """The layout of the session's model (its own outputs `originals` when it is instrumented), with the vocabulary."""
    outputs = list(originals) if originals is not None else [o.name for o in session.get_outputs()]
    layout = cache_layout(session_signature(session), outputs)
    shape = next(o.shape for o in session.get_outputs() if o.name == layout.logits)
    return replace(layout, vocab=shape[-1] if shape and isinstance(shape[-1], int) else None)


@dataclass
class GenerateResult:
    """What `generate` did: every token (prompt first), per-step run times, and the table it wrote (if any).

    `logits`: the next-token logits of every step [steps, batch, vocab] when `keep_logits`."""

    tokens: np.ndarray
    prompt_len: int
    steps: int
    seconds: float
    step_seconds: list[float]
    logits: np.ndarray | None = None
    table: Path | None = None
    sites: Path | None = None
    run: Path | None = None
    manifest: Manifest | None = None
    rows: int = 0
    parity: DropIn | None = None
    runtime: dict = field(default_factory=dict)

    @property
    def generated(self) -> np.ndarray:
        return self.tokens[:, self.prompt_len :]


@dataclass(frozen=True)
class StepDecoder:
    """A step's taps as its table part: `record`'s rows plus the step's `phase` and `position` columns."""

    manifest: Manifest
    host: HostValues
    labels: tuple[str, str, str]
    fmt: str
    prompt_len: int
    online: bool = False  # what `record`'s sink asks a decoder (generate keeps no online sketches yet)

    def __call__(self, step: int, outputs: dict[str, np.ndarray]) -> Decoded:
        return decode_group(self, [(step, outputs)])

    def table(self, batches: list[tuple[int, dict[str, np.ndarray]]]) -> tuple[pa.Table, list[Rows]]:
        many = decode_many(self.manifest, [outputs for _, outputs in batches], self.host)
        steps = [step for step, _ in batches]
        table = batches_table(many, self.labels[0], steps, self.labels[1], self.labels[2])
        sizes = [len(rows) for rows in many]
        phases = [PHASES[0] if step == 0 else PHASES[1] for step in steps]
        used = list(dict.fromkeys(phases))  # one label (every step but a group's prefill): no take
        codes = np.repeat([used.index(p) for p in phases], sizes)
        table = table.append_column("phase", arrow_strings(used, codes))
        positions = [position_of(step, self.prompt_len) for step in steps]
        return table.append_column(
            "position", arrow_int64(np.repeat(np.asarray(positions, np.int64), sizes))
        ), many


def position_of(step: int, prompt_len: int) -> int:
    """The sequence position of the first token fed at `step` (0: the prefill)."""
    return 0 if step == 0 else prompt_len + step - 1


@dataclass(frozen=True)
class Decoding:
    """How the loop picks tokens and which steps it records: `generate`'s settings, checked once."""

    steps: int = 16
    sample: bool = False
    temperature: float = 1.0
    seed: int = 0
    eos_id: int | tuple[int, ...] | None = None  # an id, or several (generation_config.json may list them)
    every: int = 1
    keep_logits: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise OpscopeError(f"steps {self.steps}: expected at least 1 (the tokens to generate)")
        if self.sample and self.temperature <= 0:
            raise OpscopeError(f"temperature {self.temperature}: expected a positive number")
        if self.every < 1:
            raise OpscopeError(f"every {self.every}: expected at least 1 (record one decode step in N)")
        if self.eos_id is not None and any(i < 0 for i in self.eos_ids):
            raise OpscopeError(f"eos_id {self.eos_id}: expected token ids (0 or more); None for no eos")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a row (none: the loop runs all its steps)."""
        e = self.eos_id
        return () if e is None else (int(e),) if isinstance(e, int | np.integer) else tuple(int(i) for i in e)

    def records(self, step: int) -> bool:
        """The prefill and decode steps 1, 1 + every, 1 + 2 * every, ... are recorded."""
        return step == 0 or (step - 1) % self.every == 0


def generate(
    model: ModelLike,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray | None = None,
    *,
    tokens: int | None = None,
    steps: int = 16,
    sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
    every: int = 1,
    out: str | os.PathLike | None = None,
    sites: list[Site] | Selection | None = None,
    sketches: list[str] | None = None,
    options: sk.SketchOptions | None = None,
    placement: str = "producer",
    fmt: str | None = None,
    run_id: str | None = None,
    parity: bool = True,
    parity_tol: tuple[float, float] | None = None,
    runtime: RuntimeConfig | None = None,
    base_dir: str | os.PathLike | None = None,
    keep_logits: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
) -> GenerateResult:
    """Generate `steps` tokens after a prompt, feeding each step's cache to the next; record the taps to `out`.

    The prompt: `prompt_ids` (one sequence, or [batch, seq] of equal lengths), or `tokens=N` random ids
    (seeded). Greedy by default; `sample` draws from softmax(logits / temperature) with `seed`. `eos_id`
    (an id or several) stops when every row has produced one; a row done early is padded with the first.
    None runs all `steps` (`prompt.default_eos(model)` reads the eos a decoder's files name: the CLI's default). `out=None` runs the plain model, nothing recorded. With `out`,
    the sites, sketches and options are `record`'s, and so is the parity gate: the instrumented model's
    own outputs (logits and presents) on the prefill must match the plain model's within `parity_tol`.
    `every`: record the prefill and one decode step in `every` (decoding a step's taps on the host costs
    more than the step on CPU; the others still run the instrumented graph, their taps not copied out).
    `progress(steps_done, steps)` is called after every step.
    """
    started = time.perf_counter()
    runtime = runtime or RuntimeConfig()
    if eos_id is not None and not isinstance(eos_id, int | np.integer):
        eos_id = tuple(int(i) for i in eos_id) or None
    how = Decoding(steps, sample, temperature, seed, eos_id, every, keep_logits)
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    if out is None:
        session = make_session(model, runtime, base_dir=base_dir)
        layout = _session_layout(session)
        prompt = _prompt(prompt_ids, tokens, seed, layout)
        _check_length(session, prompt.shape[1], steps)
        loop = _Loop(session, layout, [], how, progress)
        ids = loop.run(prompt, lambda step, outputs: None)
        return GenerateResult(ids, prompt.shape[1], loop.runs, round(time.perf_counter() - started, 3),
                              loop.seconds, loop.logits(), runtime=runtime.to_record(session))  # fmt: skip
    tap_choice = (sites, sketches, options, placement)
    return _recorded(model, prompt_ids, tokens, how, Path(out), fmt, tap_choice, run_id, (parity_tol or True) if parity else False,
                     runtime, base_dir, progress, started)  # fmt: skip


def _recorded(model: ModelLike, prompt_ids, tokens: int | None, how: Decoding, out: Path, fmt: str | None,
              tap_choice: tuple, run_id: str | None, parity: bool | tuple[float, float], runtime: RuntimeConfig,
              base_dir: str | os.PathLike | None, progress, started: float) -> GenerateResult:  # fmt: skip
    """`generate` with taps: `record`'s injection, sink and pipeline, one recorded step a batch.
    `parity`: False, True (the default tolerance) or the (rtol, atol) to hold the prefill to."""
    sites, sketches, options, placement = tap_choice
    fmt = format_of(out, fmt)
    check_writable(out, inputs=[model], replaces=is_table_folder if fmt == "parquet" else None)
    for path in sidecar_paths(out):
        check_writable(path, inputs=[model])
    light = load_model(model)
    layout = cache_layout(input_signature(light), [o.name for o in light.graph.output])
    views = cache_views(light, [past for past, _ in layout.cache])
    del light
    prompt_len = _prompt_len(
        prompt_ids, tokens
    )  # the ids of a random prompt need the vocabulary: drawn later
    batch = 1 if prompt_ids is None else np.atleast_2d(np.asarray(prompt_ids)).shape[0]
    providers = _providers_quietly(runtime)
    options = sk.for_providers(options or sk.SketchOptions(), providers)
    # sized at the last decode step: decode steps are the many, a prefill's bigger tensors copied out once
    shapes = _step_shapes(layout, batch, 1, prompt_len + how.steps - 1)

    placed = in_place_if_big(model)  # big inline weights read from the file, never parsed
    # the cache's own views are left to the kv taps, unless the caller chose the sites or the roles
    if views and (sites is None or (isinstance(sites, Selection) and not sites.roles)):
        sites = without_cache_views(sites_of(placed, sites), views)

    def build(chosen):
        return inject(placed, chosen, sketches, options, placement, providers, input_shapes=shapes)

    chosen, left_out = checked_sites(placed, sites, runtime, base_dir, lambda c: build(c).model)
    instrumented, manifest = build(chosen)
    if not isinstance(model, ModelProto):
        manifest.source, manifest.source_sha256 = str(model), file_sha256(model)
    manifest.left_out = [asdict(c) for c in left_out]
    host = host_values(manifest, instrumented, base_dir)
    tapped = for_tapped(runtime)
    session = make_session(instrumented, tapped, base_dir=base_dir, take_weights=True)
    del instrumented
    # the proto and the arrays handed to onnxruntime sit in reference cycles: ~1 GB of SmolLM2's 540 MB
    # weights twice over, held through the whole loop until the collector happens to run
    gc.collect()
    layout = _session_layout(session, manifest.original_outputs)
    prompt = _prompt(prompt_ids, tokens, how.seed, layout)
    _check_length(session, prompt.shape[1], how.steps)
    record_rt = tapped.to_record(session)
    run_id = run_id or f"{Path(manifest.source).stem}-generate-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}"
    dist = "prompt" if prompt_ids is not None else "random"
    labels = (run_id, record_rt["providers"][0].removesuffix("ExecutionProvider").lower(), dist)
    meta = {
        "run_id": run_id, "model": manifest.source, "model_sha256": manifest.source_sha256, "runtime": record_rt,
        "generation": {**asdict(how), "prompt_len": prompt.shape[1], "batch": prompt.shape[0]},
        "sketches": manifest.sketches, "options": manifest.options, "placement": manifest.placement,
        "parity": None, "table": out.name, "left_out": manifest.left_out,
    }  # fmt: skip
    decoder = StepDecoder(manifest, host, labels, fmt, prompt.shape[1])
    sink = _Sink(TableWriter(out, fmt), decoder, None, how.steps, meta, started)
    pipeline = BatchPipeline(sink)
    taps = manifest.output_names()
    gate, complete = None, False
    tol = parity if isinstance(parity, tuple) else _default_tol(runtime.graph_opt)

    # as in `record`: a big model's plain session for the gate waits until the tapped one is gone
    late = bool(parity) and weight_bytes(placed) >= LATE_PARITY_BYTES
    at_prefill: dict[str, np.ndarray] = {}
    prefill_feeds = {**layout.feeds(prompt, prompt.shape[1]), **layout.empty_cache(prompt.shape[0])}

    def on_step(step: int, outputs: dict[str, np.ndarray]) -> None:
        nonlocal gate
        if step == 0 and parity:
            if late:
                at_prefill.update({n: outputs[n] for n in manifest.original_outputs})
            else:
                gate = _parity_gate(model, runtime, base_dir, prefill_feeds, manifest, outputs, tol)
                meta["parity"] = asdict(gate)
        pipeline.submit(step, {n: outputs[n] for n in taps})

    loop = _Loop(session, layout, taps, how, progress, originals_at_0=bool(parity))
    try:
        ids = loop.run(prompt, on_step)
        meta["generated"] = ids[:, prompt.shape[1] :].tolist()
        pipeline.close()
        if late and at_prefill:
            loop.session = None  # the tapped session (and its KV cache) goes before the plain one loads
            del session
            gc.collect()
            gate = _parity_gate(model, runtime, base_dir, prefill_feeds, manifest, at_prefill, tol, late=True)
            meta["parity"] = asdict(gate)
        complete = True
    except KeyboardInterrupt:
        pipeline.close(quiet=True)
        kept = (
            f"kept {sink.steps} recorded steps in {out}"
            if sink.steps
            else f"kept 0 steps: nothing written, {out} is as it was"
        )
        raise KeyboardInterrupt(kept) from None
    finally:
        pipeline.close(quiet=True)
        try:
            sink.finish(complete)
        except OpscopeError:
            if complete:
                raise
    sites_path, run_path = sidecar_paths(out)
    return GenerateResult(ids, prompt.shape[1], loop.runs, round(time.perf_counter() - started, 3), loop.seconds,
                          loop.logits(), out, sites_path, run_path, manifest, sink.rows, gate, record_rt)  # fmt: skip


class _Loop:
    """The autoregressive loop on one session, the KV cache kept in OrtValues on the provider's device.

    Taps are bound (and copied to the host) on the steps `how` records only. State is real (the
    cache, the rng, the logits kept, the step times), hence a class."""

    def __init__(self, session: ort.InferenceSession, layout: CacheLayout, taps: list[str], how: Decoding,
                 progress: Callable[[int, int | None], None] | None = None, originals_at_0: bool = False):  # fmt: skip
        self.session, self.layout, self.taps, self.how, self.progress = session, layout, taps, how, progress
        self.rng = np.random.default_rng([how.seed, 1])  # the prompt's draw uses (seed, 0)
        self.kept: list[np.ndarray] = []
        self.originals_at_0 = originals_at_0
        self.seconds: list[float] = []
        self.runs = 0
        self.device = _DEVICES.get(session.get_providers()[0], "cpu")

    def run(self, prompt: np.ndarray, on_step: Callable[[int, dict[str, np.ndarray]], None]) -> np.ndarray:
        """Every token, the prompt's first; `on_step(step, outputs)` gets each recorded step's tap outputs
        (and at step 0, with `originals_at_0`, the model's own outputs too)."""
        layout, how, binding = self.layout, self.how, self.session.io_binding()
        batch, total = prompt.shape
        cache = {
            p: ort.OrtValue.ortvalue_from_numpy(a, self.device, 0)
            for p, a in layout.empty_cache(batch).items()
        }
        presents = tuple(present for _, present in layout.cache)
        ids, feed = [prompt], prompt
        done, eos = np.zeros(batch, bool), how.eos_ids
        for step in range(how.steps):
            fed = layout.feeds(feed, total)  # held until the run: the binding points at these arrays
            taps = self.taps if how.records(step) else []
            names = [layout.logits, *presents, *taps]
            got = self._run(binding, fed, cache, names, step)
            logits = got[layout.logits].numpy()[:, -1]
            if how.keep_logits:
                self.kept.append(logits.copy())
            if taps:
                outputs = {n: got[n].numpy() for n in taps}
                if step == 0 and self.originals_at_0:
                    outputs |= {n: got[n].numpy() for n in (layout.logits, *presents)}
                on_step(step, outputs)
            cache = {past: got[present] for past, present in layout.cache}
            nxt = self._pick(logits)
            if eos:
                nxt = np.where(done, eos[0], nxt)
                done |= np.isin(nxt, eos)
            ids.append(nxt[:, None])
            feed, total = nxt[:, None], total + 1
            if self.progress:
                self.progress(step + 1, how.steps)
            if eos and done.all():
                break
        return np.concatenate(ids, axis=1)

    def _run(self, binding: ort.IOBinding, fed: dict[str, np.ndarray], cache: dict[str, ort.OrtValue],
             names: list[str], step: int) -> dict:  # fmt: skip
        """One step: `names` -> their OrtValues. On the CPU one `run_with_ort_values` call: binding a recorded
        step's ~1,200 outputs one by one (an OrtDevice made per call) cost ~7 ms of CPU a step on 30 layers.
        On another device the IOBinding, which keeps the presents there."""
        t0 = time.perf_counter()
        try:
            if self.device == "cpu":
                inputs = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in fed.items()}
                got = dict(zip(names, self.session.run_with_ort_values(names, inputs | cache)))
            else:
                got = self._bound(binding, fed, cache, names)
        except Exception as exc:  # onnxruntime's own error types
            raise OpscopeError(
                f"the decoder failed at step {step} ({describe_feeds(fed)}): {one_line(exc)}"
            ) from None
        self.seconds.append(time.perf_counter() - t0)
        self.runs += 1
        return got

    def _bound(self, binding: ort.IOBinding, fed: dict[str, np.ndarray], cache: dict[str, ort.OrtValue],
               names: list[str]) -> dict:  # fmt: skip
        for name, value in fed.items():
            binding.bind_cpu_input(name, value)
        for past, value in cache.items():
            binding.bind_ortvalue_input(past, value)
        presents = {present for _, present in self.layout.cache}
        for name in names:
            binding.bind_output(name, self.device if name in presents else "cpu")
        try:
            self.session.run_with_iobinding(binding)
            return dict(zip(names, binding.get_outputs()))
        finally:  # the next step binds anew (its taps differ when it is not recorded)
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()

    def _pick(self, logits: np.ndarray) -> np.ndarray:
        if not self.how.sample:
            return logits.argmax(-1).astype(np.int64)
        z = logits.astype(np.float64) / self.how.temperature  # Gumbel-max: a draw from softmax(z)
        return (z + self.rng.gumbel(size=z.shape)).argmax(-1).astype(np.int64)

    def logits(self) -> np.ndarray | None:
        return np.stack(self.kept) if self.kept else None


def _prompt_len(prompt_ids, tokens: int | None) -> int:
    if (prompt_ids is None) == (tokens is None):
        raise OpscopeError("give the prompt as prompt_ids or as tokens=N (random ids), not both or neither")
    if tokens is not None:
        if tokens < 1:
            raise OpscopeError(f"tokens {tokens}: expected at least 1")
        return tokens
    return int(np.atleast_2d(np.asarray(prompt_ids)).shape[1])


def _prompt(prompt_ids, tokens: int | None, seed: int, layout: CacheLayout) -> np.ndarray:
    """The prompt as int64 [batch, seq], checked against the vocabulary."""
    length = _prompt_len(prompt_ids, tokens)
    if tokens is not None:
        high = layout.vocab or 1000
        return np.random.default_rng([seed, 0]).integers(0, high, (1, length), dtype=np.int64)
    try:
        ids = np.asarray(prompt_ids, dtype=np.int64)
    except (ValueError, TypeError):
        raise OpscopeError("prompt_ids: expected token ids, one sequence or rows of equal length") from None
    ids = np.atleast_2d(ids)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise OpscopeError(f"prompt_ids of shape {list(ids.shape)}: expected [seq] or [batch, seq] token ids")
    if layout.vocab and (ids.min() < 0 or ids.max() >= layout.vocab):
        raise OpscopeError(
            f"prompt_ids hold {int(ids.min())}..{int(ids.max())}: the vocabulary has ids 0..{layout.vocab - 1}"
        )
    return ids


def _check_length(session: ort.InferenceSession, prompt_len: int, steps: int) -> None:
    """A prompt plus its tokens past the model's maximum sequence (its metadata, when it says) is an error."""
    meta = session.get_modelmeta().custom_metadata_map
    limit = next((int(meta[k]) for k in MAX_LENGTH_KEYS if meta.get(k, "").isdigit()), None)
    if limit is not None and prompt_len + steps - 1 > limit:
        raise OpscopeError(
            f"a prompt of {prompt_len} tokens plus {steps} generated needs {prompt_len + steps - 1} positions; "
            f"the model has {limit}",
            hint="shorten the prompt or generate fewer steps",
        )


def _step_shapes(layout: CacheLayout, batch: int, seq: int, total: int) -> dict[str, list[int]]:
    """Input shapes of a step feeding `seq` tokens with `total` in the sequence: what taps are sized by."""
    shapes = {
        name: list(a.shape) for name, a in layout.feeds(np.zeros((batch, seq), np.int64), total).items()
    }
    for past, dims in layout.past_shapes.items():
        shapes[past] = [batch if d is None else (total - seq if d == 0 else d) for d in dims]
    return shapes
