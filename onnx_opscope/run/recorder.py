"""Record: run batches through an instrumented model and write the tidy sketch table.

`record` injects the sketches (`instrument.inject`), takes the weights' sketches once on the
host (`instrument.host_values`), opens one onnxruntime session, checks on the first batch
that the model's own outputs did not move (the parity gate, `compare.check_drop_in`), then
runs every batch, decodes the extra outputs through the manifest and appends the rows to the
table (`table`): nothing is held back until the end. Decoding a batch and writing its part
run on a worker thread while the next batch runs (`BatchPipeline`); batches that pile up while
it works (a model faster than its decode) are decoded together and written as one part.

Every output is checked before any work (`files.check_writable`) and nothing is written
before the first batch is decoded, so a mistake leaves an earlier table and its sidecars as
they were; the first batch replaces them, and each later one is added whole (`table`).

`online=True` also keeps mergeable online sketches (`sketch.online`) per (site, role): a KLL of up
to `VALUES_PER_TAP` values a batch of the tensor's sample (evenly strided, as `LiveRecorder` takes
them) and an HLL of its elemsig fingerprints (all-zero ones left out, as the miner leaves them),
made per batch where the batch is decoded (a Ray worker's travel back with its part) and merged
here, written beside the table (`<stem>.online.json`) with run.json, so a killed run keeps them too.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
from datasketches import HLL_8, hll_union
from onnx import ModelProto

from .. import sketch as sk
from ..compare import DropIn, check_drop_in
from ..errors import OpscopeError
from ..files import atomic_path, check_writable, write_text
from ..graph.chunks import weight_bytes
from ..graph.inplace import load_in_place
from ..graph.io import ModelLike, external_files, file_sha256
from ..instrument import HostValues, Manifest, Rows, decode_many, host_values, inject
from ..instrument.decode import tap_samples
from ..sites import Selection, Site
from ..sketch import online as sk_online
from .engine import Engine, run_batches, sessions_for
from .feeds import DEFAULT_BATCHES, FeedSpec, describe_feeds, first_batch_shapes, iter_feeds
from .kernels import checked_sites
from .session import RuntimeConfig, for_tapped, make_session, resolve_providers, run
from .table import (
    TableWriter,
    batches_table,
    encode_part,
    format_of,
    is_table_folder,
    sidecar_paths,
    write_sites,
)

RUN_JSON_EVERY = 1.0
"""Seconds between rewrites of a running record's run.json: each costs ~2 ms on ext4, which flushes a
file replaced by a rename, as much as a small batch's run; so a killed run's count lags by at most this."""
# Weights from which the parity gate runs after the last batch, not at the first: two sessions at
# once would hold them twice (a 2 GiB model peaked at 5.2 GB against plain inference's 3.2 GB).
LATE_PARITY_BYTES = 256 * 2**20
IN_PLACE_BYTES = (
    64 * 2**20
)  # model files from which inline weights are referenced in place (`in_place_if_big`)
VALUES_PER_TAP = 256  # a batch's values per tensor in its KLL, as `LiveRecorder`: ~15 us of update each


@dataclass
class RecordResult:
    table: Path
    sites: Path
    run: Path
    manifest: Manifest
    batches: int
    rows: int
    seconds: float
    parity: DropIn | None = None
    runtime: dict = field(default_factory=dict)
    online: Path | None = None  # the online sketches beside the table, with `online=True`


def default_parity_tolerance(graph_opt: str) -> tuple[float, float]:
    """(rtol, atol): bit-exact without graph optimizations; with them, tapping blocks some fusions and
    outputs may move (about 1e-4 relative seen on real CNNs), so allow 1e-3 relative."""
    return (0.0, 0.0) if graph_opt == "disable" else (1e-3, 1e-4)


Batch = tuple[int, Any]  # (step, its tap outputs, or what a Ray worker made of them)


class BatchPipeline:
    """Runs `work(batches)` on a worker thread while the next batches run.

    onnxruntime releases the GIL while it runs, so decoding and writing (numpy, pyarrow, Python:
    ~6 ms a batch on bert_like with the default set, against ~20 ms of run on one thread)
    overlap the next run instead of adding to it. Batches submitted while the worker is busy wait
    and go to it together, as one group: a model that runs faster than its batches are decoded and
    written (silero_vad_v6: ~0.1 ms a run, ~1 ms of decode and Parquet a batch) then pays the fixed
    part of that once a group, and the table gets a part a group, not a file a batch. A model
    whose decode keeps up sends groups of one. At most `MAX_BATCHES` batches, or `MAX_BYTES` of
    outputs, wait; then `submit` waits for the worker. An error in `work` is raised by the next
    `submit` that waits or by `close`. State is real (the worker, the group in flight, the waiting
    batches), hence a class.
    """

    MAX_BATCHES = 64
    MAX_BYTES = 16 << 20

    def __init__(self, work: Callable[[list[Batch]], None]):
        self._work = work
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="opscope-decode")
        self._pending: Future | None = None
        self._waiting: list[Batch] = []
        self._bytes = 0

    def submit(self, step: int, outputs: Any) -> None:
        self._waiting.append((step, outputs))
        self._bytes += _nbytes(outputs)
        busy = self._pending is not None and not self._pending.done()
        if busy and len(self._waiting) < self.MAX_BATCHES and self._bytes < self.MAX_BYTES:
            return
        self._wait()
        self._launch()

    def _launch(self) -> None:
        group, self._waiting, self._bytes = self._waiting, [], 0
        if group:
            self._pending = self._pool.submit(self._work, group)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self, quiet: bool = False) -> None:
        """Finish the group in flight and the batches waiting; `quiet` drops an error (another one is
        already being raised), and then what waits is dropped too."""
        try:
            self._wait()
            self._launch()
            self._wait()
        except Exception:
            if not quiet:
                raise
        finally:
            self._waiting, self._bytes = [], 0
            self._pool.shutdown(wait=True)


def _nbytes(outputs: Any) -> int:
    if isinstance(outputs, dict):
        return sum(getattr(a, "nbytes", 0) for a in outputs.values())
    return len(getattr(outputs, "part", b""))


@dataclass(frozen=True)
class BatchOnline:
    """One batch's online sketches, per tap that ran: its KLL (serialized, `online.to_bytes`) and its
    elemsig fingerprint (None when the elemsig is all zeros: it says nothing)."""

    taps: tuple[str, ...]
    quantiles: tuple[bytes, ...]
    prints: tuple[int | None, ...]


def batch_online(
    manifest: Manifest, outputs: dict[str, np.ndarray], values_per_tap: int = VALUES_PER_TAP
) -> BatchOnline:
    """The online sketches of one batch's tap outputs (`instrument.decode.tap_samples`): ~40 us a tensor."""
    k = manifest.sketch_options().elemsig_k
    taps, quantiles, prints = [], [], []
    for tid, x in tap_samples(manifest, outputs).items():
        q = sk_online.quantile_sketch()
        v = x[:: max(1, x.size // values_per_tap)][:values_per_tap].astype(np.float32)
        v = v[np.isfinite(v)]  # as `online.add_values`
        if v.size:
            q.update(v)
        e = x[_elemsig_positions(x.size, k)]  # histogram.elemsig_of
        taps.append(tid)
        quantiles.append(sk_online.to_bytes(q))
        # all zeros (NaN as zero, as the miner reads them) say nothing: no fingerprint
        prints.append(sk_online.fingerprint([e]) if (np.abs(e) > 0).any() else None)
    return BatchOnline(tuple(taps), tuple(quantiles), tuple(prints))


@functools.lru_cache(maxsize=256)
def _elemsig_positions(m: int, k: int) -> np.ndarray:
    """Where `histogram.elemsig_of` reads a sample of m values: min(k, m) positions j * m / k."""
    k = min(m, k)
    return (np.arange(k, dtype=np.int64) * m) // max(k, 1)


class OnlineSketches:
    """The merged online sketches of a run: per tap a KLL and an HLL union, and how many batches gave a
    fingerprint. State is real (the sketches), hence a class."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.kll: dict[str, Any] = {}
        self.hll: dict[str, Any] = {}
        self.seen: dict[str, int] = {}

    def add(self, batch: BatchOnline) -> None:
        for tid, q, f in zip(batch.taps, batch.quantiles, batch.prints):
            if tid not in self.kll:
                self.kll[tid] = sk_online.quantile_sketch()
                self.hll[tid] = hll_union(sk_online.HLL_LG_K)
                self.seen[tid] = 0
            self.kll[tid].merge(sk_online.from_bytes("kll", q))
            if f is not None:
                self.hll[tid].update(f)
                self.seen[tid] += 1

    def entries(self) -> list[dict]:
        """`online.save_sketches` entries: per (site, role) that ran its KLL and its HLL (`canonical_distinct`,
        so the estimate does not depend on how the batches were split or ordered)."""
        out = []
        for site in self.manifest.sites:
            for role, tid in site.roles.items():
                if tid not in self.kll:
                    continue
                label = {"site": site.id, "op_type": site.op_type, "role": role}
                kll = self.kll[tid]
                hll = sk_online.canonical_distinct(self.hll[tid].get_result(HLL_8))
                out.append({**label, "stat": "kll", "seen": kll.n, "sketch": kll})
                out.append({**label, "stat": "hll", "seen": self.seen[tid], "sketch": hll})
        return out

    def save(self, path: str | os.PathLike, meta: dict) -> Path:
        return sk_online.save_sketches(path, self.entries(), {**meta, "values_per_tap": VALUES_PER_TAP})


@dataclass(frozen=True)
class Decoded:
    """One or more batches as rows: their table part (encoded, `table.encode_part`), row count, (when
    step 0 is among them) the GEMM dims of its sites, with `online` each batch's online sketches, and
    how many batches it holds."""

    part: bytes
    rows: int
    site_dims: dict[str, tuple] | None
    online: tuple[BatchOnline, ...] = ()
    steps: int = 1


@dataclass(frozen=True)
class BatchDecoder:
    """Turns batches' tap outputs into one table part, encoded in the table's format `fmt`: on the
    pipeline's thread here, or on the Ray worker that ran the batch (`DecodeOnWorker`), so the driver
    only writes bytes."""

    manifest: Manifest
    host: HostValues
    labels: tuple[str, str, str]
    fmt: str
    online: bool = False

    def __call__(self, step: int, outputs: dict[str, np.ndarray]) -> Decoded:
        return decode_group(self, [(step, outputs)])

    def table(self, batches: list[tuple[int, dict[str, np.ndarray]]]) -> tuple[pa.Table, list[Rows]]:
        """The batches' rows (decoded together: `decode_many`), and as one table."""
        run_id, provider, dist = self.labels
        many = decode_many(self.manifest, [outputs for _, outputs in batches], self.host)
        return batches_table(many, run_id, [step for step, _ in batches], provider, dist), many


class TableDecoder(Protocol):
    """What `decode_group` asks of a decoder (`BatchDecoder`, `generate.StepDecoder`)."""

    manifest: Manifest
    fmt: str
    online: bool

    def table(self, batches: list[tuple[int, dict[str, np.ndarray]]]) -> tuple[pa.Table, list[Rows]]: ...


def decode_group(decoder: TableDecoder, batches: list[tuple[int, dict[str, np.ndarray]]]) -> Decoded:
    """Batches in step order as one part: decoded together into one table, encoded once (a Parquet file
    costs ~0.5 ms however few its rows)."""
    table, many = decoder.table(batches)
    dims = next((_site_dims(rows) for (step, _), rows in zip(batches, many) if step == 0), None)
    online = tuple(batch_online(decoder.manifest, o) for _, o in batches) if decoder.online else ()
    part = encode_part(table, decoder.fmt, first=batches[0][0] == 0)
    return Decoded(part, table.num_rows, dims, online, len(batches))


PART_ROWS = 1 << 17
"""Rows a part of grouped batches holds at most (~10 MB of table while it is built): silero_vad_v6's
1,173-row batches share parts by the dozen, while a batch of more rows stays alone (captcha_crnn with
--sketch all: 335k rows a batch), so a group never holds more than a part's tables at once."""


class PartMaker:
    """Cuts the groups of batches the pipeline hands over into parts of at most `PART_ROWS` rows (one
    batch at least), in step order, each decoded and encoded by `decode_group`. State is real: the rows
    a batch had in the last part, which sizes the next one (the first batch of a run goes alone)."""

    def __init__(self, decoder: TableDecoder):
        self.decoder = decoder
        self.rows_per_batch: float | None = None

    def __call__(self, batches: list[tuple[int, dict[str, np.ndarray]]]) -> Iterator[tuple[int, Decoded]]:
        """(the part's first step, the part), one part at a time."""
        i = 0
        while i < len(batches):
            per = self.rows_per_batch
            k = 1 if per is None else max(1, int(PART_ROWS // max(per, 1.0)))
            done = decode_group(self.decoder, batches[i : i + k])
            self.rows_per_batch = done.rows / done.steps
            yield batches[i][0], done
            i += k


@dataclass(frozen=True)
class DecodeOnWorker:
    """A Ray worker's `post`: the batch decoded where it ran, plus the model's own outputs at step 0
    when the parity gate needs them."""

    decoder: BatchDecoder
    originals: list[str]

    def __call__(self, step: int, outputs: dict[str, np.ndarray]) -> tuple[Decoded, dict[str, np.ndarray]]:
        plain = {n: outputs[n] for n in self.originals} if step == 0 else {}
        return self.decoder(step, outputs), plain


class _Sink:
    """Appends each batch's rows to the table (decoding them first unless a worker did), keeping the
    sidecars in step. State is real: the writer, the counts, the first batch's GEMM dims and the run's record."""

    def __init__(self, writer: TableWriter, decoder: TableDecoder,
                 progress: Callable[[int, int | None], None] | None, total: int | None, meta: dict,
                 started: float):  # fmt: skip
        self.writer, self.decoder, self.manifest = writer, decoder, decoder.manifest
        self.parts = PartMaker(decoder)
        self.progress, self.total, self.meta, self.started = progress, total, meta, started
        self.rows = self.steps = 0
        self.site_dims: dict[str, tuple] = {}
        self.saved = started  # when run.json was last written
        self.online = OnlineSketches(self.manifest) if decoder.online else None
        self.online_path = sk_online.online_path(writer.out)

    def __call__(self, batches: list[Batch]) -> None:  # on the pipeline's thread
        """A group of batches: decoded here into parts (`PartMaker`), or parts a worker decoded."""
        parts = batches if isinstance(batches[0][1], Decoded) else self.parts(batches)
        for step, done in parts:
            self.add(step, done)

    def add(self, step: int, done: Decoded) -> None:
        """Write one part, whose first batch is `step`."""
        sites_path, run_path = sidecar_paths(self.writer.out)
        if self.online is not None:
            for batch in done.online:
                self.online.add(batch)
        if step == 0:  # the commit: the table and its sidecars replace the earlier ones together
            self.site_dims = done.site_dims or {}
            with atomic_path(sites_path) as sites_tmp, atomic_path(run_path) as run_tmp:
                write_sites(sites_tmp, self.manifest, self.site_dims)
                run_tmp.write_text(self.run_json(done.steps, done.rows, interrupted=True))
                if self.online is not None:
                    self.save_online(done.steps, interrupted=True)
                else:  # an earlier run's sketches would pass for this table's
                    self.online_path.unlink(missing_ok=True)
                self.writer.write(done.part)
        else:
            self.writer.write(done.part)
        self.rows += done.rows
        self.steps += done.steps
        if time.perf_counter() - self.saved > RUN_JSON_EVERY:
            write_text(run_path, self.run_json(self.steps, self.rows, interrupted=True))
            if self.online is not None:
                self.save_online(self.steps, interrupted=True)
        if self.progress:  # once a batch, as documented; the part holds them all already
            for done_steps in range(self.steps - done.steps + 1, self.steps + 1):
                self.progress(done_steps, self.total)

    def run_json(self, batches: int, rows: int, interrupted: bool) -> str:
        """`<stem>.run.json`: what ran and how; until the run ends it says `interrupted`, which a kill leaves.
        Notes the time, for the next rewrite."""
        self.saved = time.perf_counter()
        seconds = round(self.saved - self.started, 3)
        meta = {**self.meta, "batches": batches, "rows": rows, "seconds": seconds, "interrupted": interrupted}
        return json.dumps(meta, indent=1, default=str)

    def save_online(self, batches: int, interrupted: bool) -> None:
        """`<stem>.online.json`, whole or not at all: the sketches merged so far, and what they cover."""
        keep = ("run_id", "model", "model_sha256", "table")
        meta = {k: self.meta[k] for k in keep} | {"batches": batches, "interrupted": interrupted}
        self.online.save(self.online_path, meta)

    def finish(self, complete: bool) -> None:
        """Close the table (`_SUCCESS` when `complete`) and write the run's final record, if it kept a batch."""
        self.writer.close(complete)
        if self.steps:
            if self.online is not None:
                self.save_online(self.steps, not complete)
            write_text(sidecar_paths(self.writer.out)[1], self.run_json(self.steps, self.rows, not complete))


def record(
    model: ModelLike,
    *,
    out: str | os.PathLike = "sketches.parquet",
    feeds: FeedSpec | None = None,
    runtime: RuntimeConfig | None = None,
    sites: list[Site] | Selection | None = None,
    sketches: list[str] | None = None,
    options: sk.SketchOptions | None = None,
    placement: str = "producer",
    fmt: str | None = None,
    run_id: str | None = None,
    parity: bool = True,
    parity_tol: tuple[float, float] | None = None,
    base_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    engine: Engine | None = None,
    weight_cache: bool = True,
    online: bool = False,
) -> RecordResult:
    """Record sketches of `model` over the batches of `feeds` into the table at `out`.

    `engine`: where the batches run (`run.engine`: this process, or Ray workers each holding a
    session; the table's rows are the same either way, written here in step order).
    `weight_cache`: reuse the sketches of big weights from an earlier run (`instrument.weight_cache`).
    `online`: also write mergeable online sketches beside the table (module doc; `sketch.online.read_online`).
    A model with `LATE_PARITY_BYTES` of weights or more gets its parity gate after the last batch,
    once the instrumented session is gone, so the weights are never held twice.

    Returns paths and counts; raises OpscopeError for user mistakes and for a failed parity
    gate (the instrumented model's own outputs differ from the plain model's on batch 0 by
    more than `parity_tol` = (rtol, atol), default `default_parity_tolerance`).
    `progress(step_done, total_or_None)` is called after every batch.
    """
    started = time.perf_counter()
    feeds, runtime, out = feeds or FeedSpec(), runtime or RuntimeConfig(), Path(out)
    fmt = format_of(out, fmt)
    table_folder = is_table_folder if fmt == "parquet" else None  # an earlier table there may be replaced
    check_writable(out, inputs=[model, feeds.data], replaces=table_folder)
    for path in [*sidecar_paths(out), *([sk_online.online_path(out)] if online else [])]:
        check_writable(path, inputs=[model, feeds.data])
    if base_dir is None and not isinstance(model, ModelProto):
        base_dir = Path(model).parent
    providers = _providers_quietly(runtime)
    options = sk.for_providers(options or sk.SketchOptions(), providers)
    instrumented, manifest = _instrument(
        in_place_if_big(model), sites, sketches, options, placement, providers, runtime, base_dir, feeds
    )
    if not isinstance(model, ModelProto):  # the file it came from, even when loaded in place
        manifest.source, manifest.source_sha256 = str(model), file_sha256(model)
    batches = iter_feeds(instrumented, feeds)  # the feed options, checked against the model before any run
    # One copy of the model in memory: the instrumented one also gives the feeds' signature and
    # the weights; the plain parity session reads the file itself when there is one.
    tapped_runtime = for_tapped(runtime)
    engine = engine or Engine()
    want_taps = manifest.output_names()
    want = manifest.original_outputs + want_taps if parity else want_taps
    # The weight taps' sketches, once, before any batch: while onnxruntime builds the session when
    # the weights are in external data (it reads the files, the sketches read them too); first when
    # they are inline, since the session takes their bytes out of the proto.
    with ThreadPoolExecutor(1, thread_name_prefix="opscope-weights") as pool:
        host_future = pool.submit(host_values, manifest, instrumented, base_dir, cache=weight_cache)
        if not external_files(instrumented):
            host_future.result()
        # locally the weights go into the session; the proto keeps the graph (the feeds' signature) only
        model_bytes, factory = sessions_for(engine, instrumented, tapped_runtime, base_dir)
        session = factory(None) if engine.kind == "local" else None  # on Ray each worker holds its own
        host = host_future.result()
    record_rt = tapped_runtime.to_record(session) | {"engine": asdict(engine)}
    run_id = run_id or f"{Path(manifest.source).stem}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}"
    labels = (run_id, record_rt["providers"][0].removesuffix("ExecutionProvider").lower(),
              "data" if feeds.data is not None else feeds.dist)  # fmt: skip
    total = feeds.batches if feeds.batches is not None else (None if feeds.data else DEFAULT_BATCHES)
    tol = parity_tol or default_parity_tolerance(runtime.graph_opt)
    meta = {
        "run_id": run_id, "model": manifest.source, "model_sha256": manifest.source_sha256, "runtime": record_rt,
        "feeds": _feed_record(feeds), "sketches": manifest.sketches, "options": manifest.options,
        "placement": manifest.placement, "parity": None, "table": out.name,
        "left_out": manifest.left_out,
    }  # fmt: skip
    decoder = BatchDecoder(manifest, host, labels, fmt, online)
    sink = _Sink(TableWriter(out, fmt), decoder, progress, total, meta, started)
    pipeline = BatchPipeline(sink)
    gate, complete = None, False
    first: list = []  # batch 0, for the plain model's parity run
    # A big model's plain session would hold a second copy of the weights beside the instrumented one:
    # its parity run waits until the last batch is in and the instrumented session is gone.
    late = parity and engine.kind == "local" and weight_bytes(instrumented) >= LATE_PARITY_BYTES
    tapped_out: dict[str, np.ndarray] = {}
    try:
        kept = _remember_first(batches, first)
        originals = manifest.original_outputs if parity else []
        # locally the pipeline's thread decodes while the next batch runs; on Ray the workers decode
        post = (
            TapsOnly(want_taps, bool(originals))
            if engine.kind == "local"
            else DecodeOnWorker(decoder, originals)
        )
        for step, got in run_batches(engine, model_bytes, factory, kept, want, post):
            batch, plain = (got, got) if engine.kind == "local" else got
            if parity and step == 0:
                if late:
                    tapped_out = {n: plain[n] for n in originals}
                else:
                    gate = _parity_gate(model, runtime, base_dir, first[0], manifest, plain, tol)
                    meta["parity"] = asdict(gate)
            pipeline.submit(step, batch if isinstance(batch, Decoded) else {n: batch[n] for n in want_taps})
        pipeline.close()
        if late and first:
            del session, factory  # the instrumented session's weights go before the plain one loads its own
            gc.collect()  # the session sits in reference cycles (the pipeline's closures): free it now
            gate = _parity_gate(model, runtime, base_dir, first[0], manifest, tapped_out, tol, late=True)
            meta["parity"] = asdict(gate)
        complete = True
    except KeyboardInterrupt:
        pipeline.close(quiet=True)  # the batch already run is still written
        raise KeyboardInterrupt(_kept(sink.steps, total, out)) from None
    finally:
        pipeline.close(quiet=True)  # after an error: the batch already run is still written
        try:
            sink.finish(complete)
        except OpscopeError:
            if complete:  # else an error is already being raised, and it is the one to report
                raise
    seconds = round(time.perf_counter() - started, 3)
    sites_path, run_path = sidecar_paths(out)
    online_out = sink.online_path if online and sink.steps else None
    return RecordResult(
        out, sites_path, run_path, manifest, sink.steps, sink.rows, seconds, gate, record_rt, online_out
    )


@dataclass(frozen=True)
class TapsOnly:
    """A local batch's `post`: the tap outputs, and at step 0 (for the parity gate) the model's own."""

    taps: list[str]
    keep_all_at_step0: bool

    def __call__(self, step: int, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if step == 0 and self.keep_all_at_step0:
            return outputs
        return {name: outputs[name] for name in self.taps}


def _remember_first(batches: Iterable[dict[str, np.ndarray]], first: list) -> Iterator[dict[str, np.ndarray]]:
    for step, batch in enumerate(batches):
        if step == 0:
            first.append(batch)
        yield batch


def _kept(steps: int, total: int | None, out: Path) -> str:
    """What an interrupted run kept, for its one line."""
    of = f" of {total}" if total else ""
    if not steps:
        return f"kept 0{of} batches: nothing written, {out} is as it was"
    return f"kept {steps}{of} batches in {out}"


def _parity_gate(model: ModelLike, runtime: RuntimeConfig, base_dir: str | os.PathLike | None,
                 batch: dict[str, np.ndarray], manifest: Manifest, outputs: dict[str, np.ndarray],
                 tol: tuple[float, float], late: bool = False) -> DropIn:  # fmt: skip
    """Run the plain model on `batch` and compare its outputs with the instrumented model's (exit 3 when off).
    `late`: the check ran after the last batch (a big model), so the table is already written."""
    originals = manifest.original_outputs
    plain = make_session(model, runtime, base_dir=base_dir)
    plain_out = run(plain, batch, originals)
    del plain
    gate = check_drop_in(originals, plain_out, [outputs[n] for n in originals], *tol)
    if not gate.ok:
        when = "; checked after the last batch (a big model), so the table is written but not marked complete"
        raise OpscopeError(
            f"parity failed on batch 0 ({describe_feeds(batch)}): output {gate.worst_output!r} moved by "
            f"{gate.max_abs:.3g} ({gate.max_rel:.3g} of its max) with the taps in place (rtol {tol[0]}, atol {tol[1]})"
            + (when if late else ""),
            hint="a tap stopped an onnxruntime fusion that changes numerics: leave its site out (--name, --op, "
            "--role), or loosen --parity-tol; --no-parity skips the check (--opt-level disable would measure "
            "another model than the one onnxruntime runs)",
            exit_code=3,
        )
    return gate


def _instrument(model: ModelLike, sites: list[Site] | Selection | None, sketches: list[str] | None,
                options: sk.SketchOptions, placement: str, providers: list[str], runtime: RuntimeConfig,
                base_dir: str | os.PathLike | None, feeds: FeedSpec) -> tuple[ModelProto, Manifest]:  # fmt: skip
    """`inject`, without the taps that would change onnxruntime's integer kernels (`run.kernels`): each
    one left out is a warning and an entry of the manifest's (and run.json's) `left_out`. Taps are
    sized at the first batch's shapes (small tensors are copied out whole, `SketchOptions.copy_out_max`)."""

    def build(chosen: list[Site] | Selection | None) -> tuple[ModelProto, Manifest]:
        shapes = partial(first_batch_shapes, spec=feeds)
        return inject(model, chosen, sketches, options, placement, providers, input_shapes=shapes)

    sites, left_out = checked_sites(model, sites, runtime, base_dir, lambda chosen: build(chosen).model)
    instrumented, manifest = build(sites)
    manifest.left_out = [asdict(c) for c in left_out]
    return instrumented, manifest


def in_place_if_big(model: ModelLike) -> ModelLike:
    """A big model file with inline weights, loaded with them referenced in place (`graph.inplace`):
    onnxruntime and the host sketches read them from the file, and Python never holds them. A
    540 MB decoder recorded at 2.3 GB peak against plain inference's 0.8 GB with them parsed."""
    if isinstance(model, ModelProto):
        return model
    path = Path(model)
    return load_in_place(path) if path.is_file() and path.stat().st_size >= IN_PLACE_BYTES else model


def _providers_quietly(runtime: RuntimeConfig) -> list[str]:
    """The providers the session will get; its own creation warns about any fallback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_providers(runtime.providers, fallback=runtime.fallback)


def _feed_record(spec: FeedSpec) -> dict:
    d = asdict(spec)
    d["data"] = str(spec.data) if spec.data is not None else None
    return d


def _site_dims(rows: Rows) -> dict[str, tuple]:
    dims: dict[str, tuple] = {}
    for site, _, _, _, _, m, k, n in rows.chunks():
        if site not in dims:
            dims[site] = (m, k, n)
    return dims
