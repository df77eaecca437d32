"""The miner's configuration: every threshold, with its reason, and how `--set` changes one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import OpscopeError, did_you_mean, listing


def _t(default: float, why: str) -> Any:
    """A threshold: its default and the one-line reason for it (shown by `--set` help and the report)."""
    return field(default=default, metadata={"why": why})


@dataclass(frozen=True)
class MineConfig:
    """Thresholds and knobs of the miner, one line of reason each. Defaults follow the reference
    harness except `pos_cv_min` (0.75 -> 1.0), the two added rules (`gaps_min`,
    `kurtosis_min`) and the guards (minimum sizes, `peak_min`, `fixed_norm_tol`,
    `stationary_chance`), which scripts/eval_findings.py measured; see the README section "Rules
    (first match wins)" for the measurements behind each. `opscope mine --set NAME=VALUE` changes one; `describe()` lists them."""

    nonfinite_max: float = _t(0.0, "share of NaN/Inf above this: fix the numerics before anything else")
    density_max: float = _t(0.5, "nnz/numel below: sparse GEMM")
    outlier_min: float = _t(6.0, "max/mean of per-channel max|x| above: per-channel int quant")
    gaps_min: float = _t(0.3, "empty-bin share inside the histogram's bulk above: few discrete levels (LUT)")
    gaps_mass: float = _t(0.01, "the bulk = bins between the gaps_mass and 1 - gaps_mass quantiles")
    kurtosis_min: float = _t(10.0, "above: heavy tails, per-tensor int quant loses resolution")
    histtop_min: float = _t(0.25, "largest bin share above: concentrated values, quantize / LUT")
    peak_min: float = _t(
        2.0,
        "concentrated also needs its largest bin this many times the fuller bin beside it: a pile on one value",
    )
    adj_max: float = _t(0.5, "mean(adj_sumsq)/mean(pos_sumsq) below: adjacent rows close, delta-compute")
    pos_cv_min: float = _t(1.0, "std/|mean| of per-row energy above: sequence / positional structure")
    stationary_cv: float = _t(1e-4, "l1 over steps with a smaller coefficient of variation: stationary")
    stationary_chance: float = _t(
        0.01,
        "stationary also needs l1's cv under this share of the cv fresh values give by chance (big tensors)",
    )
    repeat_dist: float = _t(
        1e-3, "a step whose elemsig is this close (relative L2) to an earlier one repeats"
    )
    repeat_share_min: float = _t(0.2, "repeat share above: memoize")
    drift_max: float = _t(0.3, "mean step-to-step elemsig distance below: delta-compute across steps")
    min_steps: int = _t(3, "temporal rules need at least this many steps")
    numel_min: int = _t(
        256, "no rule but NaN/Inf judges a tensor with fewer elements: its statistics are noise, its cost nil"
    )
    hist_per_bin_min: float = _t(
        4.0, "histogram rules (levels, concentrated) need this many counted elements per bin"
    )
    channels_min: int = _t(
        8,
        "outlier and positional need this many channels: a max/mean over fewer, a row energy over fewer is noise",
    )
    rows_min: int = _t(
        8, "row rules (coherent, positional) need this many rows; the outlier rule as many values per channel"
    )
    fixed_norm_tol: float = _t(
        1e-4, "l1 (sumsq) within this of numel/d (numel): rows normalised by construction, not stationary"
    )
    stable_sigma: float = _t(0.02, "sigma over steps of the fired rule's score below: stable guard")
    stationary_score: float = _t(
        0.25, "rank of precompute / prepack (runtimes often prepack weights already)"
    )
    delta_tau: float = _t(0.1, "delta-compute skips delta entries below tau x RMS of the tensor")
    measure_cap: int = _t(1024, "measured speed-ups cap M, K and N at this")
    measure_repeats: int = _t(3, "timed repeats (best of) per measurement")
    attn_peak_min: float = _t(0.3, "mean attn_qmax above: most queries put most of their mass on few keys")
    sink_share_min: float = _t(
        0.25, "a key with this share of attn_krecv (and 4x uniform) is an attention sink"
    )
    cold_share_max: float = _t(0.02, "experts below this share of the routed load: drop / merge candidates")
    hot_imbalance_min: float = _t(
        2.0, "the busiest expert's share over the uniform share above: prefetch / pin it"
    )
    residual_gap_max: float = _t(
        0.1, "sqrt(min/max) of a residual Add's input energies below: the block barely acts"
    )
    skip_min_cosine: float = _t(
        0.999, "a skip candidate is validated at this output cosine of the skipped model"
    )
    skip_min_top1: float = _t(0.99, "... and at this top-1 agreement (outputs that look like logits)")
    # decoder findings (`findings.decoder`, tables written by `generate`)
    massive_ratio_min: float = _t(
        40.0,
        "max/median of a residual-stream tensor's chan_maxabs above: massive-activation channels "
        "(SmolLM2-135M: 47-502 on 8 of its 60 block outputs, at most 37 on the rest)",
    )
    massive_rest_min: float = _t(
        50.0,
        "max|x| over the RMS of the other values above (no chan_maxabs): massive activations "
        "(SmolLM2-135M: 58-1045 on those 8, at most 54 on all but one of the rest)",
    )
    sink_keys: int = _t(1, "the first keys an attention sink is looked for in")
    attn_window: int = _t(32, "the recent keys a windowed-attention candidate keeps (beside the sink keys)")
    window_mass_min: float = _t(
        0.9, "sink keys + the last attn_window keys hold this share of decode attention: windowed attention"
    )
    kv_outlier_min: float = _t(
        4.0,
        "max/median of the head_chan_maxabs of what a step writes to the KV cache above: outlier channels (one scale "
        "costs the median channel log2(4) = 2 bits)",
    )
    kv_crest_max: float = _t(
        16.0,
        "absmax/RMS of a KV cache up to this: per-tensor int8 keeps the RMS >= 8 steps; above: finer scales",
    )
    kv_head_dominant: float = _t(
        2.0,
        "a KV head whose absmax is this many times the median head's dominates: it alone would set a "
        "per-tensor scale (1 bit lost to every other head)",
    )
    kv_head_recovers: float = _t(
        0.5,
        "per-head KV scales are the verdict when they get at least this share of per-channel scales' gain in "
        "bits (one scale per head is cheaper to store and apply than one per channel)",
    )
    phase_drift_min: float = _t(
        0.5, "decode/prefill of a decoder figure beyond 1 + this (either way): the phases drift apart"
    )


def config_with(
    base: MineConfig | None = None, overrides: Mapping[str, str] | Sequence[str] = ()
) -> MineConfig:
    """`base` with fields set from 'NAME=VALUE' strings (or a mapping); unknown names are an OpscopeError."""
    base = base or MineConfig()
    items = overrides.items() if isinstance(overrides, Mapping) else (_split_setting(s) for s in overrides)
    types = {f.name: f.type for f in fields(MineConfig)}
    changes: dict[str, Any] = {}
    for name, text in items:
        if name not in types:
            raise OpscopeError(
                f"--set {name}: no such threshold{did_you_mean(name, types)}; known: {listing(types, 30)}"
            )
        try:
            changes[name] = int(text) if types[name] == "int" else float(text)
        except ValueError:
            raise OpscopeError(f"--set {name}={text}: expected a number") from None
    return replace(base, **changes)


def _split_setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise OpscopeError(f"--set {text!r}: expected NAME=VALUE, e.g. density_max=0.4")
    return name.strip(), value.strip()


def describe() -> list[tuple[str, str, str]]:
    """(name, default, reason) of every threshold, for `--set`'s help and the report."""
    return [(f.name, f"{f.default:g}", f.metadata.get("why", "")) for f in fields(MineConfig)]
