"""Decoder findings: per layer and phase, what a `generate` table says about LLM-specific patterns.

A `generate` table has `phase` (prefill / decode) and `position` columns; these rules read the
series of one run split by phase (thresholds in `MineConfig`):

- `massive_activation`: a residual-stream tensor (a norm's `in` / `skip`, a residual Add's inputs)
  with channels whose max|x| is far above the median channel's: max(chan_maxabs) / median(chan_maxabs)
  > massive_ratio_min, the channels named. The default sketch set has no per-channel sketch: then
  the rule reads max|x| over the RMS of the other values (min, max, sumsq, numel: the RMS without
  the peak, since one value dominates a small tensor's own RMS) > massive_rest_min, and says that
  `--sketch chan_maxabs` names the channels. A plain export's residual Add taps its skip input with
  sumsq only (`sites.KIND_SKETCHES`), so there the rule sees the block outputs it adds, not the stream.
- `attention_sink`: the share of decode-step attention mass (attn_krecv) the first sink_keys keys
  receive, > sink_share_min and 4x their uniform share. A step's total mass is the sum of
  attn_krecv, or numel / keys when it is strided (keys = position + 1 on a decode step). The
  prefill is compared by its excess over uniform attention, (share - u) / (1 - u): under a
  causal mask uniform attention already gives key 0 H(S)/S of the mass (`causal_uniform`), not 1/S.
- `windowed_attention`: the first sink_keys and the last attn_window keys together hold more than
  window_mass_min of the decode mass, judged on the decode steps with at least twice as many keys
  as the window keeps (on fewer it would save little; a short run says nothing). It needs
  attn_krecv unstrided (keys <= SketchOptions.max_rows, 509 by default): past that the strided
  entries are not the last keys and the step is not judged.
- `kv_outlier_channels` and `kv_range`: a KV-cache tensor (`sites.kv`, roles key / value):
  max / median of head_chan_maxabs (per (head, head_dim channel), `sketch.heads`; chan_maxabs in
  older tables) > kv_outlier_min names the (head, channel)s to keep out of a per-tensor scale; the
  range is min / max / absmax / RMS, and the crest absmax / RMS says whether per-tensor int8 keeps
  the bulk (crest <= kv_crest_max) or finer scales are needed. Per head (head_min / head_max /
  head_sumsq): absmax and RMS per head, their spread (max / median), the dominant heads, and the RMS
  in int8 steps with one scale per tensor, per head and per (head, channel) (`_heads`): per-head
  scales are the verdict when they get at least kv_head_recovers of per-channel's gain in bits. The
  tap is what each step writes into the cache (`sites.kv`), so a phase's figures are those of the
  entries it wrote and the cache's range is that over every step (the verdict's).
- `phase_drift`: decode / prefill of each of those figures (max|x| and the massive ratio of a
  stream tensor; the sink excess, where either phase has a sink; a cache's absmax and outlier
  ratio and head spread) beyond (1 + phase_drift_min)x either way: a scale or a kernel choice made on one phase
  does not hold on the other. Maxima over the decode steps are over more steps than the prefill's one.

Scores, for the ranking: 1 - threshold / ratio (massive activations, KV outlier channels), the
share (sinks, windows), crest / (2 kv_crest_max) (KV range), |log10 of the ratio| / 3 (drift).

The layer of a site is read from its name: `/layers.{i}/` (transformers and optimum exports),
also `layer.{i}`, `h.{i}` (GPT-2), `blocks.{i}`, `block_{i}`, and `present.{i}.key` /
`present_key_{i}` for the caches (`layer_of`); an exporter that names nodes otherwise gets layer
None (the finding still names its site).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import OpscopeError
from .config import MineConfig
from .finding import Finding
from .rules import fmt_num
from .series import Series, TableLike, collect, read_sketch_table
from .signals import finite_or_none

KIND = "decoder"
RULES = ("massive_activation", "attention_sink", "windowed_attention", "kv_outlier_channels", "kv_range",
         "phase_drift")  # fmt: skip
KV_ROLES = ("key", "value", "kv")
STREAM_ROLES = ("residual_a", "residual_b")
NORM_ROLES = ("in", "skip")
NORM_OPS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
            "LayerNormalization", "RMSNormalization")  # fmt: skip
PHASES = ("prefill", "decode")
READ_ROLES = (*KV_ROLES, *STREAM_ROLES, *NORM_ROLES, "attn")  # the roles the rules read
TOP_CHANNELS = 8  # channels named in a finding's exploit (all of them are in its signals)
_LAYER = re.compile(r"(?:^|[/._])(?:layers?|h|blocks?|decoder_layers?)[._](\d+)(?=[/._]|$)")
_KV_LAYER = re.compile(r"^present[._](?:(?:key|value|k|v)[._])?(\d+)(?=[/._]|$)")

Steps = Mapping[tuple[str, int], tuple[str, int]]  # (run_id, step) -> (phase, position)


def layer_of(site: str) -> int | None:
    """The layer index in a site's name (`/layers.3/mlp/...`, `h.3`, `present.3.key`), None when it has none."""
    m = _KV_LAYER.match(site) or _LAYER.search(site)
    return int(m.group(1)) if m else None


def step_phases(table: pa.Table) -> dict[tuple[str, int], tuple[str, int]]:
    """(run_id, step) -> (phase, position) of a `generate` table ({} when it has no `phase` column)."""
    if "phase" not in table.column_names:
        return {}
    cols = [c for c in ("run_id", "step", "phase", "position") if c in table.column_names]
    t = table.select(cols).group_by(cols).aggregate([])
    get = {c: t.column(c).to_pylist() for c in cols}
    n = t.num_rows
    runs, positions = get.get("run_id", [""] * n), get.get("position", [-1] * n)
    return {(str(r), int(s)): (str(p), -1 if q is None else int(q))
            for r, s, p, q in zip(runs, get["step"], get["phase"], positions) if p is not None}  # fmt: skip


def mine_decoder(table: TableLike, config: MineConfig | None = None) -> list[Finding]:
    """Only the decoder findings of a `generate` table, best first (what `opscope mine --decoder` prints). The rows of
    the roles they read are kept before the series are collected: on a 30-layer, 16-step table with
    chan_maxabs (10.6 M rows) `mine` took 76 s and 12 GB of RSS, this 14 s and 3.4 GB, the same findings."""
    t, path = read_sketch_table(table)
    if "phase" not in t.column_names:
        raise OpscopeError(
            f"{path or 'table'}: no phase column, so no decoder findings",
            hint="record a decoder with `opscope generate MODEL -o TABLE`",
        )
    t = t.filter(pc.is_in(t.column("role"), value_set=pa.array(READ_ROLES)))
    found = decoder_findings(collect(t), step_phases(t), config)
    return sorted(found, key=lambda f: -f.score)  # best first, layer order among equals (a stable sort)


@dataclass
class _Phased:
    """One series' steps by phase, and the (phase, position) of each step."""

    series: Series
    by_phase: dict[str, list[int]]
    where: dict[int, tuple[str, int]]

    def stats(self, step: int, name: str) -> np.ndarray:
        return np.asarray(self.series.stat(step, name), np.float64)


def _phased(series: Series, steps: Steps) -> _Phased | None:
    where = {s: steps[(series.run_id, s)] for s in series.steps if (series.run_id, s) in steps}
    by_phase = {p: sorted(s for s, (q, _) in where.items() if q == p) for p in PHASES}
    by_phase = {p: v for p, v in by_phase.items() if v}
    return _Phased(series, by_phase, where) if by_phase else None


def decoder_findings(series: Sequence[Series], steps: Steps, cfg: MineConfig | None = None) -> list[Finding]:
    """The decoder findings of every series whose run has phases (`step_phases`), by layer then site."""
    cfg = cfg or MineConfig()
    out: list[Finding] = []
    for s in series:
        p = _phased(s, steps)
        if p is None:
            continue
        if s.role in KV_ROLES:
            figures = _kv(p, cfg, out)
        elif s.role == "attn":
            figures = _attention(p, cfg, out)
        elif s.role in STREAM_ROLES or (s.role in NORM_ROLES and s.op_type in NORM_OPS):
            figures = _stream(p, cfg, out)
        else:
            continue
        drift = _drift(p, figures, cfg)
        if drift is not None:
            out.append(drift)
    return sorted(out, key=lambda f: (f.signals["layer"] is None, f.signals["layer"] or 0, f.site, f.role,
                                      RULES.index(f.rule)))  # fmt: skip


# --------------------------------------------------------------------------------------------
# per-phase figures


def _chan_max(p: _Phased, phase: str, stat: str = "chan_maxabs") -> np.ndarray:
    """Element-wise max over the phase's steps of chan_maxabs (empty when not recorded or sizes differ)."""
    return _chan_over(p, p.by_phase.get(phase, []), stat)


def _chan_over(p: _Phased, steps: Sequence[int], stat: str = "chan_maxabs") -> np.ndarray:
    """Element-wise max over `steps` of a per-channel stat (empty when not recorded or sizes differ)."""
    got = [p.stats(s, stat) for s in steps]
    got = [g for g in got if g.size]
    if not got or len({g.size for g in got}) != 1:
        return np.zeros(0)
    return np.nanmax(np.stack(got), axis=0)


def _spread(cm: np.ndarray, least: float) -> dict | None:
    """max / median of per-channel maxima, and the channels at least `least` x the median, largest first."""
    ok = np.isfinite(cm)
    if ok.sum() < 2:
        return None
    med = float(np.median(cm[ok]))
    if med <= 0:
        return None
    ratio = float(np.nanmax(cm) / med)
    big = np.flatnonzero(ok & (cm >= least * med))
    big = big[np.argsort(-cm[big], kind="stable")]
    return {"ratio": ratio, "max": float(np.nanmax(cm)), "median": med, "channels": [int(c) for c in big]}


def _named(channels: list[int]) -> str:
    more = " ..." if len(channels) > TOP_CHANNELS else ""
    return ", ".join(map(str, channels[:TOP_CHANNELS])) + more


def _peak_over_rest(p: _Phased, step: int) -> tuple[float, float, float]:
    """(max|x|, RMS of the other values, their ratio) of one step from min, max, sumsq and numel."""
    lo, hi, ss = (p.stats(step, k) for k in ("min", "max", "sumsq"))
    n = p.series.numel.get(step)
    if not (lo.size and hi.size and ss.size and n and n > 1):
        return math.nan, math.nan, math.nan
    peak = max(abs(float(lo[0])), abs(float(hi[0])))
    rest = math.sqrt(max(float(ss[0]) - peak * peak, 0.0) / (n - 1))
    return peak, rest, (peak / rest if rest > 0 else math.inf if peak > 0 else math.nan)


def _stream(p: _Phased, cfg: MineConfig, out: list[Finding]) -> dict[str, dict[str, float]]:
    """massive_activation on a residual-stream tensor; returns its figures per phase for the drift."""
    phases, fired, held, per_step = {}, [], [], []
    basis = "chan_maxabs" if any(_chan_max(p, ph).size for ph in p.by_phase) else "max/rms"
    for ph, steps in p.by_phase.items():
        if basis == "chan_maxabs":
            got = _spread(_chan_max(p, ph), cfg.massive_ratio_min)
            if got is None:
                continue
            ratios = [(_spread(p.stats(s, "chan_maxabs"), cfg.massive_ratio_min) or {}).get("ratio", math.nan)
                      for s in steps]  # fmt: skip
            fires = got["ratio"] > cfg.massive_ratio_min
        else:
            peaks = [_peak_over_rest(p, s) for s in steps]
            ratios = [r for _, _, r in peaks]
            if not any(math.isfinite(r) for r in ratios):
                continue
            i = int(np.nanargmax(np.where(np.isfinite(ratios), ratios, -np.inf)))
            got = {"ratio": ratios[i], "max": max(pk for pk, _, _ in peaks), "rest_rms": peaks[i][1]}
            fires = got["ratio"] > cfg.massive_rest_min
        phases[ph] = got
        per_step += ratios
        limit = cfg.massive_ratio_min if basis == "chan_maxabs" else cfg.massive_rest_min
        held += [r > limit for r in ratios if math.isfinite(r)]
        if fires:
            fired.append(ph)
    if fired:
        out.append(_massive(p, phases, fired, basis, held, per_step, cfg))
    return {ph: {"max|x|": f["max"], "massive_ratio": f["ratio"]} for ph, f in phases.items()}


def _massive(p: _Phased, phases: dict, fired: list[str], basis: str, held: list[bool], per_step: list[float],
             cfg: MineConfig) -> Finding:  # fmt: skip
    worst = max(fired, key=lambda ph: phases[ph]["ratio"])
    ratio = phases[worst]["ratio"]
    where = " and ".join(fired)
    if basis == "chan_maxabs":
        limit = cfg.massive_ratio_min
        channels = list(dict.fromkeys(c for ph in fired for c in phases[ph]["channels"]))
        named = _named(channels)
        exploit = f"keep channel(s) {named} in fp16 (split out), quantize the rest: {ratio:.0f}x the median ({where})"
        condition = f"max/median of chan_maxabs {ratio:.1f} > {fmt_num(limit)} ({worst})"
        guard = f"max(chan_maxabs)/median(chan_maxabs) > {fmt_num(limit)} on deployment prompts"
        note = ""
    else:
        limit = cfg.massive_rest_min
        channels = []
        exploit = (
            f"outlier-aware quant, their channels in fp16: values {ratio:.0f}x the RMS of the rest ({where})"
        )
        condition = f"max|x| / RMS of the rest {ratio:.1f} > {fmt_num(limit)} ({worst})"
        guard = f"max|x| / RMS of the other values > {fmt_num(limit)} on deployment prompts"
        note = "no chan_maxabs recorded: max vs the RMS of the rest, channels not named; record with --sketch chan_maxabs"
    return _finding(p, "massive_activation", condition, exploit, 1.0 - limit / ratio if ratio > 0 else 0.0,
                    guard, {"basis": basis, "phases": phases, "channels": channels, "fired": fired},
                    held, per_step, cfg, note)  # fmt: skip


def _keys(p: _Phased, step: int, kept: int) -> int:
    """How many keys a step's queries attend to: position + 1 on a decode step (one token), the prompt
    length at the prefill (the first decode step's position), else the kept entries of attn_krecv."""
    phase, pos = p.where[step]
    if phase == "decode" and pos >= 0:
        return pos + 1
    decode = [q for s, (ph, q) in p.where.items() if ph == "decode" and q >= 0]
    return min(decode) if decode else kept


def _attention(p: _Phased, cfg: MineConfig, out: list[Finding]) -> dict[str, dict[str, float]]:
    """attention_sink and windowed_attention on one attention site; returns its sink share per phase."""
    k, w = max(int(cfg.sink_keys), 1), max(int(cfg.attn_window), 1)
    sink: dict[str, list[float]] = {}
    excess: dict[str, list[float]] = {}
    window, judged, keys_seen, strided = [], [], [], 0
    for ph, steps in p.by_phase.items():
        for s in steps:
            v = p.stats(s, "attn_krecv")
            n, numel = _keys(p, s, v.size), p.series.numel.get(s)
            full = v.size == n
            total = float(v.sum()) if full else (numel / n if numel and n else math.nan)
            if not v.size or not total > 0:
                continue
            kk = k if full else 1  # strided: entry 0 is key 0, entry 1 is not key 1
            first = float(v[:kk].sum())
            share = first / total
            base = kk / n if ph == "decode" else causal_uniform(kk, n)
            sink.setdefault(ph, []).append(share)
            excess.setdefault(ph, []).append(
                max((share - base) / (1.0 - base), 0.0) if base < 1 else math.nan
            )
            if ph == "decode":
                keys_seen.append(n)
                if not full:
                    strided += 1
                elif n >= 2 * (k + w):
                    window.append((first + float(v[-w:].sum())) / total)
                    judged.append(n)
    shares = {ph: float(np.mean(v)) for ph, v in sink.items()}
    lifted = {ph: float(np.nanmean(v)) for ph, v in excess.items() if np.isfinite(v).any()}
    dec = sink.get("decode", [])
    if dec:
        share = shares["decode"]
        uniform = k / float(np.mean(keys_seen))
        limit = max(cfg.sink_share_min, 4.0 * uniform)
        if share > limit:
            cond = f"first {k} key(s) take {share:.1%} of decode attention > {limit:.1%} (sink_share_min, 4x uniform)"
            exploit = (f"keep key(s) 0..{k - 1} in every window / KV eviction: a sink, {share:.0%} of decode mass "
                       f"({share / uniform:.0f}x uniform)")  # fmt: skip
            out.append(_finding(
                p, "attention_sink", cond, exploit, share, f"sink share > {limit:.2g} on deployment prompts",
                {"sink_keys": k, "share": shares, "excess": lifted, "uniform": uniform,
                 "keys": [min(keys_seen), max(keys_seen)]},
                [x > limit for x in dec], dec, cfg))  # fmt: skip
    if window:
        kept = float(np.mean(window))
        if kept > cfg.window_mass_min:
            cond = (f"first {k} + last {w} keys hold {kept:.1%} of decode attention > "
                    f"{fmt_num(cfg.window_mass_min)} ({len(window)} steps of {min(judged)}..{max(judged)} keys)")  # fmt: skip
            exploit = (f"sliding-window attention, {k} sink + the last {w} keys: keeps {kept:.1%} of the mass, reads "
                       f"{(k + w) / max(judged):.0%} of the cache at {max(judged)} keys")  # fmt: skip
            note = f"{strided} decode step(s) with strided attn_krecv not judged" if strided else ""
            out.append(_finding(
                p, "windowed_attention", cond, exploit, kept,
                f"sink + window share > {fmt_num(cfg.window_mass_min)} at the deployment's context lengths",
                {"sink_keys": k, "window": w, "kept_share": kept, "sink_share": shares, "keys": [min(judged), max(judged)]},
                [x > cfg.window_mass_min for x in window], window, cfg, note))  # fmt: skip
    if max(lifted.values(), default=0.0) < cfg.sink_share_min:
        return {}  # no sink in either phase: the ratio of two small excesses is noise
    return {ph: {"sink_excess": v} for ph, v in lifted.items()}


def causal_uniform(k: int, s: int) -> float:
    """The share of attention mass the first `k` of `s` keys get from `s` causal queries attending
    uniformly (query i spreads 1/(i+1) over keys 0..i): what the prefill's sink share is measured against."""
    i = np.arange(1, s + 1, dtype=np.float64)
    tail = np.cumsum((1.0 / i)[::-1])[::-1]  # tail[j] = sum over queries i >= j of 1/(i+1)
    return float(tail[: min(k, s)].sum() / s)


def _kv_chan_stat(p: _Phased) -> str:
    """The per-channel stat of a cache: head_chan_maxabs (per (head, head_dim channel), `sketch.heads`),
    else chan_maxabs (tables recorded before it: pooled over the heads on a plain export)."""
    return "head_chan_maxabs" if any(p.stats(s, "head_chan_maxabs").size for s in p.where) else "chan_maxabs"


def _heads(
    p: _Phased, steps: list[int], rms: float, absmax: float, chan: np.ndarray, dominant_at: float
) -> dict:
    """Per-head figures of the entries `steps` wrote (head_min / head_max / head_sumsq), {} when not recorded.

    int8 resolution: the RMS in int8 steps, 127·RMS / sqrt(mean of scale²) with each element's scale
    absmax / 127 of its group (rounding noise is scale² / 12 an element, every head and channel holds
    as many elements): per tensor 127·RMS / absmax, per head over the heads' absmax, per channel over
    the (head, channel) maxima. `head_recovers`: the share of per-channel's gain over per-tensor, in
    bits, that per-head scales get."""
    got = {k: [v for s in steps if (v := p.stats(s, k)).size] for k in ("head_min", "head_max", "head_sumsq")}
    sizes = {v.size for vs in got.values() for v in vs}
    if not all(got.values()) or len(sizes) != 1:
        return {}
    h = sizes.pop()
    n = sum(p.series.numel.get(s) or 0 for s in steps if p.stats(s, "head_sumsq").size)
    lo = np.nanmin(np.stack(got["head_min"]), axis=0)
    hi = np.nanmax(np.stack(got["head_max"]), axis=0)
    ss = np.sum(np.stack(got["head_sumsq"]), axis=0)
    amax = np.maximum(np.abs(lo), np.abs(hi))
    head_rms = np.sqrt(ss / (n / h)) if n else np.full(h, np.nan)
    ok = np.isfinite(amax)
    med = float(np.median(amax[ok])) if ok.any() else math.nan
    order = np.argsort(-np.where(ok, amax, -np.inf), kind="stable")
    dominant = [int(i) for i in order if ok[i] and med > 0 and amax[i] >= dominant_at * med]
    steps8 = {"tensor": 127.0 * rms / absmax if absmax > 0 else math.nan,
              "head": 127.0 * rms / math.sqrt(float(np.mean(amax[ok] ** 2))) if ok.any() else math.nan,
              "channel": math.nan}  # fmt: skip
    if chan.size and chan.size % h == 0 and np.isfinite(chan).any():
        steps8["channel"] = 127.0 * rms / math.sqrt(float(np.nanmean(chan**2)))
    gain = {k: math.log2(v / steps8["tensor"]) if v > 0 and steps8["tensor"] > 0 else math.nan
            for k, v in steps8.items() if k != "tensor"}  # fmt: skip
    recovers = (
        gain["head"] / gain["channel"] if gain["channel"] > 0 else (1.0 if gain["head"] >= 0 else math.nan)
    )
    return {"heads": h, "head_dim": chan.size // h if chan.size % h == 0 else None, "head_min": lo.tolist(),
            "head_max": hi.tolist(), "head_absmax": amax.tolist(), "head_rms": head_rms.tolist(),
            "head_steps": (127.0 * head_rms / np.where(amax > 0, amax, np.nan)).tolist(),
            "head_spread": float(np.nanmax(amax) / med) if med > 0 else math.nan, "dominant_heads": dominant,
            "int8_steps": steps8, "bits_gained": gain, "head_recovers": recovers}  # fmt: skip


def _channel_names(channels: list[int], head_dim: int | None) -> list[str]:
    """Flat (head, channel) indices as 'h{head}.{channel}' when the head_dim is known, else as they are."""
    return [f"h{c // head_dim}.{c % head_dim}" if head_dim else str(c) for c in channels]


def _kv(p: _Phased, cfg: MineConfig, out: list[Finding]) -> dict[str, dict[str, float]]:
    """kv_range and kv_outlier_channels on one KV-cache tensor; returns its figures per phase."""
    ranges, spreads = {}, {}
    chan_stat = _kv_chan_stat(p)
    for ph, steps in [*p.by_phase.items(), ("all", sorted(p.where))]:
        lo = [float(v[0]) for s in steps if (v := p.stats(s, "min")).size]
        hi = [float(v[0]) for s in steps if (v := p.stats(s, "max")).size]
        ss = [(float(v[0]), p.series.numel.get(s)) for s in steps if (v := p.stats(s, "sumsq")).size]
        n = sum(m or 0 for _, m in ss)
        chan = _chan_max(p, ph, chan_stat) if ph != "all" else _chan_over(p, steps, chan_stat)
        if lo and hi:
            absmax = max(abs(min(lo)), abs(max(hi)))
            rms = math.sqrt(sum(x for x, _ in ss) / n) if n else math.nan
            ranges[ph] = {"min": min(lo), "max": max(hi), "absmax": absmax, "rms": rms,
                          "crest": absmax / rms if rms > 0 else math.nan,
                          **(_heads(p, steps, rms, absmax, chan, cfg.kv_head_dominant) if chan_stat == "head_chan_maxabs" else {})}  # fmt: skip
        got = _spread(chan, cfg.kv_outlier_min) if ph != "all" else None
        if got is not None:
            spreads[ph] = got
    what = "key" if p.series.role == "key" else "value" if p.series.role == "value" else "KV"
    head_dim = (ranges.get("all") or {}).get("head_dim")
    fired = [ph for ph, g in spreads.items() if g["ratio"] > cfg.kv_outlier_min]
    if fired:
        worst = max(fired, key=lambda ph: spreads[ph]["ratio"])
        channels = list(dict.fromkeys(c for ph in fired for c in spreads[ph]["channels"]))
        named = ", ".join(_channel_names(channels[:TOP_CHANNELS], head_dim)) + (
            " ..." if len(channels) > TOP_CHANNELS else ""
        )
        ratio = spreads[worst]["ratio"]
        per_step = [(_spread(p.stats(s, chan_stat), cfg.kv_outlier_min) or {}).get("ratio", math.nan)
                    for ph in p.by_phase for s in p.by_phase[ph]]  # fmt: skip
        unit = "(head, channel)" if head_dim else "channel"
        out.append(_finding(
            p, "kv_outlier_channels", f"max/median of {chan_stat} {ratio:.1f} > {fmt_num(cfg.kv_outlier_min)} ({worst})",
            f"per-channel {what}-cache quant, or {unit}(s) {named} in fp16: {ratio:.1f}x the median {unit}",
            1.0 - cfg.kv_outlier_min / ratio, f"max/median of {chan_stat} > {fmt_num(cfg.kv_outlier_min)} on deployment prompts",
            {"basis": chan_stat, "phases": spreads, "channels": channels, "head_dim": head_dim,
             "named": _channel_names(channels, head_dim), "fired": fired},
            [r > cfg.kv_outlier_min for r in per_step if math.isfinite(r)], per_step, cfg))  # fmt: skip
    if "all" in ranges:
        r = ranges["all"]
        crest = r["crest"]
        heads = r.get("heads")
        if math.isfinite(crest) and crest <= cfg.kv_crest_max:
            verdict = "per-tensor"
            exploit = (f"per-tensor int8 {what} cache: scale {r['absmax'] / 127:.3g} (absmax {r['absmax']:.3g}), "
                       f"the RMS spans {127 / crest:.0f} int8 steps")  # fmt: skip
        elif heads:
            rec = r["head_recovers"]
            verdict = "per-head" if math.isfinite(rec) and rec >= cfg.kv_head_recovers else "per-channel"
            exploit = (f"{verdict} scales for the {what} cache: per-tensor int8 (absmax {r['absmax']:.3g}) leaves "
                       f"the RMS {127 / crest:.1f} int8 steps")  # fmt: skip
        else:
            verdict = "per-channel / per-head"
            exploit = (f"per-channel or per-head scales for the {what} cache: per-tensor int8 (absmax "
                       f"{r['absmax']:.3g}) leaves the RMS {127 / crest:.1f} int8 steps")  # fmt: skip
        if heads:
            st, gain = r["int8_steps"], r["bits_gained"]
            dom = ", ".join(map(str, r["dominant_heads"])) or "none"
            exploit += (f"; per-head scales {st['head']:.1f} steps ({gain['head']:+.1f} bits), per-(head, channel) "
                        f"{st['channel']:.1f} ({gain['channel']:+.1f} bits): per-head gets {_pct(r['head_recovers'])} "
                        f"of it; head absmax max/median {r['head_spread']:.2g} over {heads} heads, dominant: {dom}")  # fmt: skip
        out.append(_finding(
            p, "kv_range", f"range [{r['min']:.3g}, {r['max']:.3g}], crest absmax/RMS {crest:.1f} "
            f"({'<=' if crest <= cfg.kv_crest_max else '>'} {fmt_num(cfg.kv_crest_max)}), every step",
            exploit, min(crest / (2.0 * cfg.kv_crest_max), 1.0),
            f"|x| <= {r['absmax']:.3g} on deployment prompts (the scale clips beyond)",
            {"phases": ranges, "verdict": verdict}, [], [], cfg))  # fmt: skip
    figures: dict[str, dict[str, float]] = {}
    for ph in p.by_phase:
        f = {}
        if ph in ranges:
            f["absmax"] = ranges[ph]["absmax"]
            if "head_spread" in ranges[ph]:
                f["head_spread"] = ranges[ph]["head_spread"]
        if ph in spreads:
            f["outlier_ratio"] = spreads[ph]["ratio"]
        figures[ph] = f
    return figures


def _pct(x: float) -> str:
    return f"{x:.0%}" if math.isfinite(x) else "-"


# --------------------------------------------------------------------------------------------
# drift and the Finding itself


def _drift(p: _Phased, figures: Mapping[str, Mapping[str, float]], cfg: MineConfig) -> Finding | None:
    """phase_drift: decode / prefill of every figure both phases have, when one is beyond 1 ± phase_drift_min."""
    pre, dec = figures.get("prefill", {}), figures.get("decode", {})
    ratios = {}
    for name in pre:
        a, b = pre[name], dec.get(name)
        if b is not None and math.isfinite(a) and math.isfinite(b) and max(a, b) > 0:
            ratios[name] = {"prefill": a, "decode": b, "ratio": b / a if a > 0 else math.inf}
    bound = 1.0 + cfg.phase_drift_min
    moved = {k: v for k, v in ratios.items() if not 1.0 / bound <= v["ratio"] <= bound}
    if not moved:
        return None
    name, worst = max(
        moved.items(), key=lambda kv: abs(math.log(kv[1]["ratio"])) if kv[1]["ratio"] > 0 else math.inf
    )
    text = ", ".join(f"{k} {_times(v)}" for k, v in moved.items())
    return _finding(
        p, "phase_drift", f"decode/prefill {text} (outside 1/{fmt_num(bound)}..{fmt_num(bound)})",
        f"calibrate (and pick kernels) per phase: {name} {_times(worst)} from prefill to decode",
        min(abs(math.log10(worst["ratio"])) / 3.0, 1.0) if worst["ratio"] > 0 else 1.0,
        f"decode/prefill outside 1/{fmt_num(bound)}..{fmt_num(bound)} on deployment prompts", {"drift": ratios, "moved": sorted(moved)},
        [], [], cfg)  # fmt: skip


def _times(v: Mapping[str, float]) -> str:
    r = v["ratio"]
    return f"x{r:.2g}" if math.isfinite(r) else f"{v['prefill']:.3g} -> {v['decode']:.3g}"


def _finding(p: _Phased, rule: str, condition: str, exploit: str, score: float, guard: str, signals: dict,
             held: list[bool], per_step: list[float], cfg: MineConfig, note: str = "") -> Finding:  # fmt: skip
    s = p.series
    numels = [n for n in s.numel.values() if n is not None]
    ok = [x for x in per_step if math.isfinite(x)]
    sigma = float(np.std(ok)) if len(ok) > 1 else None
    stability = "n/a" if not per_step else "single step" if sigma is None else (
        "stable" if sigma < cfg.stable_sigma * max(abs(float(np.mean(ok))), 1.0) else "watch drift")  # fmt: skip
    steps = {ph: len(v) for ph, v in p.by_phase.items()}
    return Finding(
        site=s.site, op_type=s.op_type, role=s.role, run_id=s.run_id, provider=s.provider, dist=s.dist,
        M=s.dims[0], K=s.dims[1], N=s.dims[2], numel=max(numels) if numels else None, steps=len(s.steps),
        signals=_clean({"layer": layer_of(s.site), "steps": steps, **signals}), sigma={}, rule=rule,
        condition=condition, exploit=exploit, score=float(min(max(score, 0.0), 1.0)), guard=guard,
        guard_held=sum(held) / len(held) if held else None, stability=stability,
        stability_sigma=finite_or_none(sigma), note=note, kind=KIND,
    )  # fmt: skip


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, float | np.floating):
        return finite_or_none(float(x))
    return x
