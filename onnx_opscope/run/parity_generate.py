"""Parity of two decoders over one generated sequence: A decodes (greedy or sampled), B is fed A's tokens.

Comparing two independent generations stops meaning anything at the first token they pick
differently: from there on each side conditions on its own text. So B is teacher-forced: its KV
loop (`generate`'s `_Loop`) is given A's token at every step instead of its own pick, and the two
next-token distributions are compared position by position on the same prefix. Per step: does B's
argmax equal A's token (top-1 agreement), KL(A || B) of the softmax of the logits (float64, from
log-softmax, so a KL of 1e-12 is still a number and not rounding), and the largest logit difference.

With `sample`, A's sequence is `generate`'s sampled one for the same seed (Gumbel-max on logits / T, its
noise from `Decoding`'s rng), and top-1 agreement is B's argmax against A's argmax at the same positions
(A's token is a draw, so B's argmax against it would measure the sampling, not B). B's loop is seeded
alike, so it draws the same Gumbel noise at every step: `same_draw` says where B, given that noise, would
have drawn A's token, the agreement of two sampled servers run with one seed.

With `layers`, both models run the loop again with the same taps `parity` uses (`compare.layers`:
min, max, sum of squares and NaN / Inf counts of A's sites, kept where B still has their tensors),
copied out at one step only: the first step whose top-1 differs, else the step with the largest KL.
Decoders exported from one source keep their tensor names through onnxruntime's int4 quantizer
(`MatMulNBits` replaces a MatMul under the MatMul's own output name) and mostly through its fusions,
so the sites line up by name; each site is given its layer by the `/layers.{i}/` of its node name.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from onnx import ModelProto

from ..compare import DEFAULT_TOL, LAYER_SKETCHES, ParityReport
from ..errors import OpscopeError
from ..graph.io import ModelLike, load_model
from ..instrument import host_values, inject
from ..sites import Selection, find_sites, select
from .generate import Decoding, _check_length, _Loop, _prompt, _session_layout
from .parity import _compare, _label, _sites_in
from .recorder import in_place_if_big
from .session import RuntimeConfig, for_tapped, make_session, resolve_providers

# the block index in a node name: /layers.3/ (transformers, optimum), /h.3/ (GPT-2), /blocks.3/
_LAYER = re.compile(r"(?:^|/)(?:model\.)?(?:layers|layer|h|blocks|block)[._](\d+)(?=[/._]|$)")


def layer_of(name: str) -> int | None:
    """The decoder block of a node, from the `/layers.{i}/` in its name (None outside the blocks)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis in float64, shifted by the row's max: no overflow, no log(0)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def next_token_kl(logits_a: np.ndarray, logits_b: np.ndarray) -> np.ndarray:
    """KL(softmax(a) || softmax(b)) per row, in nats: 0 for identical rows, inf where B gives 0 to A's mass.

    Good to about 1e-16 nats (held against long double), so the 1e-12 of an int4 twin is a number."""
    la, lb = log_softmax(logits_a), log_softmax(logits_b)
    pa = np.exp(la)
    with np.errstate(invalid="ignore"):
        terms = np.where(pa > 0, pa * (la - lb), 0.0)
    return np.maximum(terms.sum(-1), 0.0)  # rounding can leave -1e-17 where the rows are one ulp apart


@dataclass
class GenerationParity:
    """What `parity_generation` found: per-step arrays [steps, batch] and, with layers, the diverging site.

    `tokens`: A's whole sequence (prompt first); step s compares the distributions of the token at
    position prompt_len + s. `picks_a` / `picks_b`: each side's argmax per step (A's equal its tokens when
    greedy); `top1` compares them. `scale`: max |logit of A| per step, for the relative difference.
    `same_draw` (sampled runs): B's draw with A's Gumbel noise is A's token.
    `layers`: one row per (site, role, stat) at `layer_step`, in execution order, with its `layer`."""

    a: str
    b: str
    prompt_len: int
    tokens: np.ndarray
    picks_b: np.ndarray
    top1: np.ndarray
    kl: np.ndarray
    max_abs: np.ndarray
    scale: np.ndarray
    tol: float
    layer_tol: float
    layer_step: int | None = None
    layers: list[dict] = field(default_factory=list)
    first_divergent: dict | None = None
    sites_compared: int = 0
    sites_only_in_a: list[str] = field(default_factory=list)
    logits_a: np.ndarray | None = None
    logits_b: np.ndarray | None = None
    runtime: dict = field(default_factory=dict)
    picks_a: np.ndarray | None = None
    sample: bool = False
    temperature: float = 1.0
    same_draw: np.ndarray | None = None

    @property
    def steps(self) -> int:
        return int(self.top1.shape[0])

    @property
    def agreement(self) -> float:
        return float(self.top1.mean())

    @property
    def first_disagreement(self) -> int | None:
        """The first step where B's top-1 is not A's, in any row."""
        bad = np.flatnonzero(~self.top1.all(axis=1))
        return int(bad[0]) if bad.size else None

    @property
    def same_draw_agreement(self) -> float | None:
        """Sampled runs: the share of (step, row) where B, given A's Gumbel noise, draws A's token."""
        return None if self.same_draw is None else float(self.same_draw.mean())

    @property
    def worst_step(self) -> int:
        return int(np.argmax(np.nan_to_num(self.kl, nan=np.inf).max(axis=1)))

    @property
    def max_rel(self) -> float:
        top = float(self.scale.max())
        d = float(self.max_abs.max())
        return d / top if top > 0 else (0.0 if d == 0 else float("inf"))

    @property
    def passed(self) -> bool:
        """B's top-1 is A's at every step and its logits stay within `tol` of A's (max|Δ| / max|A|)."""
        return self.agreement == 1.0 and bool(np.isfinite(self.kl).all()) and self.max_rel <= self.tol

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "agreement": self.agreement,
            "mean_kl": float(self.kl.mean()),
            "max_kl": float(self.kl.max()),
            "max_abs": float(self.max_abs.max()),
            "max_rel": self.max_rel,
            "first_disagreement": self.first_disagreement,
            "worst_step": self.worst_step,
        } | ({"same_draw_agreement": self.same_draw_agreement} if self.sample else {})

    def by_layer(self) -> list[dict]:
        """Per block (None: outside the blocks), in execution order: the largest divergence and its site."""
        out: dict = {}
        for r in self.layers:
            got = out.get(r["layer"])
            if got is None or r["divergence"] > got["divergence"]:
                out[r["layer"]] = {"layer": r["layer"], "divergence": r["divergence"], "site": r["site"]}
        return list(out.values())

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, np.ndarray) and v is not None}
        d["tokens"] = self.tokens.tolist()
        d["per_step"] = self.per_step()
        d["summary"], d["passed"], d["by_layer"] = self.summary(), self.passed, self.by_layer()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=float)

    def per_step(self) -> list[dict]:
        """One row per step: the position compared, A's token and B's top-1 per row, how many rows agree, and
        the worst row's KL and max |Δ logit|; sampled runs add A's top-1 and how many rows B draws alike."""
        rows = []
        for s in range(self.steps):
            row = {
                "step": s,
                "position": self.prompt_len + s,
                "token_a": self.tokens[:, self.prompt_len + s].tolist(),
                "token_b": self.picks_b[s].tolist(),
                "agree": int(self.top1[s].sum()),
                "kl": float(self.kl[s].max()),
                "max_abs": float(self.max_abs[s].max()),
            }
            if self.sample:
                row["top1_a"] = self.picks_a[s].tolist()
                row["same_draw"] = int(self.same_draw[s].sum())
            rows.append(row)
        return rows

    def format(self, head: int = 5) -> str:
        """The summary, a per-step table (the first `head` steps, the first disagreement, the worst step)
        and, with layers, the first diverging site and each block's largest divergence."""
        s, first = self.summary(), self.first_disagreement
        at = "none" if first is None else f"step {first} (position {self.prompt_len + first})"
        how = f"sampled at T={self.temperature:g}" if self.sample else "greedy"
        lines = [
            f"parity over a generation: {self.a}  vs  {self.b}  (prompt {self.prompt_len} tokens, "
            f"{self.steps} steps {how}, B fed A's tokens)",
            f"  top-1 agreement {s['agreement']:.1%} ({int(self.top1.sum())}/{self.top1.size}); KL(A||B) "
            f"mean {s['mean_kl']:.3g}, max {s['max_kl']:.3g} nats; max |Δ logit| {s['max_abs']:.3g} "
            f"(rel {s['max_rel']:.3g}, tol {self.tol:g})",
            *self._draw_lines(),
            f"  first disagreement: {at}",
            *self._step_lines(sorted({*range(min(head, self.steps)), s["worst_step"], first} - {None})),
            *self._layer_lines(),
            "PASSED" if self.passed else "FAILED",
        ]
        return "\n".join(lines)

    def _draw_lines(self) -> list[str]:
        if not self.sample:
            return []
        n, size = int(self.same_draw.sum()), self.same_draw.size
        return [f"  same-seed draws: B draws A's token with A's Gumbel noise at {n / size:.1%} ({n}/{size})"]

    def _step_lines(self, shown: list[int]) -> list[str]:
        batch, rows = self.top1.shape[1], self.per_step()
        tokens = ("A token", "A top-1", "B top-1") if self.sample else ("A token", "B top-1")
        same = ["same draw"] if self.sample else []
        head = ("step", "position", *tokens, "agree", *same, "KL", "max |Δ|")
        widths = (5, 9, *[8] * len(tokens), 7, *[9] * len(same), 10, 10)
        lines = ["  " + " ".join(f"{h:>{w}}" for h, w in zip(head, widths))]
        for k, i in enumerate(shown):
            if k and i != shown[k - 1] + 1:
                lines.append(f"  {'...':>5}")
            r = rows[i]
            keys = ("token_a", "top1_a", "token_b") if self.sample else ("token_a", "token_b")
            toks = " ".join(f"{r[key][0] if batch == 1 else '-':>8}" for key in keys)
            same = f" {r['same_draw']:>5}/{batch:<3}" if self.sample else ""
            lines.append(f"  {i:>5} {r['position']:>9} {toks} {r['agree']:>3}/{batch:<3}{same} "
                         f"{r['kl']:>10.3g} {r['max_abs']:>10.3g}")  # fmt: skip
        return lines

    def _layer_lines(self) -> list[str]:
        if self.layer_step is None:
            return []
        lines = [f"  layers at step {self.layer_step}: {self.sites_compared} sites, {len(self.layers)} "
                 f"statistics compared (layer tol {self.layer_tol:g})"]  # fmt: skip
        f = self.first_divergent
        if f:
            where = "outside the blocks" if f["layer"] is None else f"layer {f['layer']}"
            ops = f["op_type"] if f["op_type_b"] == f["op_type"] else f"{f['op_type']} -> {f['op_type_b']}"
            lines.append(f"  first diverging layer: {where}, at {f['site']} ({ops}, {f['role']}, "
                         f"{f['stat']}): divergence {f['divergence']:.3g}")  # fmt: skip
        else:
            lines.append("  no site diverges beyond the layer tolerance")
        per = ", ".join(
            f"{'-' if r['layer'] is None else r['layer']}: {r['divergence']:.2g}" for r in self.by_layer()
        )
        return [*lines, f"  largest divergence per layer (-: outside the blocks): {per}"]


@dataclass(frozen=True)
class _AtStep(Decoding):
    """A loop that copies its taps out at step `at` only."""

    at: int = 0

    def records(self, step: int) -> bool:
        return step == self.at


class _Forced(_Loop):
    """The KV loop fed `forced` [batch, steps] instead of its own picks (teacher forcing); with `reference`
    [steps, batch, vocab] (A's logits) each step's logits are compared with A's as they come. A sampling
    `how` seeded as A's was draws A's Gumbel noise step by step (`_Loop._pick`): B's draw is kept."""

    def __init__(self, *args, forced: np.ndarray, reference: np.ndarray | None = None, keep: bool = False,
                 **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.forced, self.reference, self.keep = forced, reference, keep
        self.picks, self.top1, self.kl, self.max_abs, self.got, self.drawn = [], [], [], [], [], []

    def _pick(self, logits: np.ndarray) -> np.ndarray:
        step = self.runs - 1
        token = self.forced[:, step]
        if self.reference is not None:
            ref = self.reference[step]
            self.picks.append(logits.argmax(-1))
            self.top1.append(self.picks[-1] == ref.argmax(-1))  # A's token itself when A is greedy
            if self.how.sample:
                self.drawn.append(super()._pick(logits) == token)
            self.kl.append(next_token_kl(ref, logits))
            self.max_abs.append(np.abs(ref.astype(np.float64) - logits).max(-1))
            if self.keep:
                self.got.append(logits.copy())
        return token


def parity_generation(
    model_a: ModelLike,
    model_b: ModelLike,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | np.ndarray | None = None,
    *,
    tokens: int | None = None,
    steps: int = 16,
    seed: int = 0,
    sample: bool = False,
    temperature: float = 1.0,
    runtime: RuntimeConfig | None = None,
    runtime_a: RuntimeConfig | None = None,
    runtime_b: RuntimeConfig | None = None,
    tol: float = DEFAULT_TOL,
    layers: bool = True,
    layer_tol: float | None = None,
    selection: Selection | None = None,
    keep_logits: bool = False,
    base_dir_a: str | os.PathLike | None = None,
    base_dir_b: str | os.PathLike | None = None,
) -> GenerationParity:
    """A decodes `steps` tokens after the prompt, B is fed the same tokens: compared step by step.

    The prompt is `generate`'s: `prompt_ids` or `tokens=N` random ids (seeded with `seed`). A is greedy, or
    with `sample` draws from softmax(logits / `temperature`) as `generate(..., sample=True, seed=seed)` does;
    then B draws with the same noise too (`same_draw`).
    `runtime_a` / `runtime_b` (default `runtime`, else CPU) let one model be held against itself on
    another provider. `layers`: rerun both with `parity`'s taps and name the first site whose statistics
    diverge beyond `layer_tol` (default `tol`) at the first disagreeing step, else the largest-KL step.
    `keep_logits`: keep both sides' logits [steps, batch, vocab]. `base_dir_*`: where in-memory models'
    external weights live."""
    runtime_a = runtime_a or runtime or RuntimeConfig()
    runtime_b = runtime_b or runtime or RuntimeConfig()
    dir_a, dir_b = _weights_dir(model_a, base_dir_a), _weights_dir(model_b, base_dir_b)
    how = Decoding(steps=steps, sample=sample, temperature=temperature, seed=seed, keep_logits=True)
    sess_a = make_session(model_a, runtime_a, base_dir=dir_a)
    layout_a = _session_layout(sess_a)
    prompt = _prompt(prompt_ids, tokens, seed, layout_a)
    _check_length(sess_a, prompt.shape[1], steps)
    loop_a = _Loop(sess_a, layout_a, [], how)
    seq = loop_a.run(prompt, lambda step, outputs: None)
    logits_a = loop_a.logits()
    record = {"a": runtime_a.to_record(sess_a)}
    del loop_a, sess_a

    sess_b = make_session(model_b, runtime_b, base_dir=dir_b)
    layout_b = _session_layout(sess_b)
    if layout_a.vocab and layout_b.vocab and layout_a.vocab != layout_b.vocab:
        raise OpscopeError(
            f"the decoders have different vocabularies: {layout_a.vocab} vs {layout_b.vocab} logits",
            hint="parity over a generation compares variants of one decoder (fp32 vs int4, fused vs plain)",
        )
    _check_length(sess_b, prompt.shape[1], steps)
    forced = seq[:, prompt.shape[1] :]
    loop_b = _Forced(sess_b, layout_b, [], replace(how, keep_logits=False), forced=forced, reference=logits_a,
                     keep=keep_logits)  # fmt: skip
    loop_b.run(prompt, lambda step, outputs: None)
    record["b"] = runtime_b.to_record(sess_b)
    del sess_b
    labels = [_label(model_a), _label(model_b)]
    if runtime_a.providers != runtime_b.providers:
        labels = [f"{label} on {_providers(r)}" for label, r in zip(labels, (runtime_a, runtime_b))]
    result = GenerationParity(
        *labels, prompt.shape[1], seq, np.stack(loop_b.picks), np.stack(loop_b.top1), np.stack(loop_b.kl),
        np.stack(loop_b.max_abs), np.abs(logits_a.astype(np.float64)).max(axis=(1, 2)), tol,
        tol if layer_tol is None else layer_tol, runtime=record,
        logits_a=logits_a if keep_logits else None, logits_b=np.stack(loop_b.got) if keep_logits else None,
        picks_a=logits_a.argmax(-1), sample=sample, temperature=temperature,
        same_draw=np.stack(loop_b.drawn) if sample else None,
    )  # fmt: skip
    if layers:
        at = result.first_disagreement
        _layers_at(result, at if at is not None else result.worst_step, (model_a, model_b), (dir_a, dir_b),
                   (runtime_a, runtime_b), prompt, forced, selection)  # fmt: skip
    return result


def provider_runtimes(
    providers: str | Sequence[str], runtime: RuntimeConfig | None = None
) -> tuple[RuntimeConfig, RuntimeConfig]:
    """`runtime` on each of two providers ('cpu,cuda', the first the reference), both checked now."""
    items = [
        p.strip() for p in (providers.split(",") if isinstance(providers, str) else providers) if p.strip()
    ]
    if len(items) != 2:
        raise OpscopeError(
            f"--providers needs exactly two providers to compare, got {len(items)}: {','.join(items) or '-'}",
            hint="e.g. --providers cpu,cuda (the first is the reference)",
        )
    for p in items:
        resolve_providers(p)  # unknown / unavailable: one clear line before anything runs
    runtime = runtime or RuntimeConfig()
    a, b = (replace(runtime, providers=p, fallback=False) for p in items)
    return a, b


def _providers(runtime: RuntimeConfig) -> str:
    p = runtime.providers
    return p if isinstance(p, str) else ",".join(p)


def _weights_dir(model: ModelLike, base_dir: str | os.PathLike | None) -> Path | None:
    if base_dir is not None:
        return Path(base_dir)
    return None if isinstance(model, ModelProto) else Path(model).parent


def _layers_at(result: GenerationParity, step: int, models: tuple, dirs: tuple, runtimes: tuple,
               prompt: np.ndarray, forced: np.ndarray, selection: Selection | None) -> None:  # fmt: skip
    """Both decoders rerun to `step` on A's tokens with the same taps, copied out at `step`; `parity`'s
    layer comparison of the two (`run.parity._compare` on that one step) fills `result.layers`."""
    a, b = (load_model(in_place_if_big(m)) for m in models)  # big weights stay in their files, never parsed
    sites_a = select(find_sites(a), selection or Selection())
    sites_b, lost = _sites_in(b, sites_a)
    kept = {s.id for s in sites_b}
    tapped = [
        inject(a, [s for s in sites_a if s.id in kept], list(LAYER_SKETCHES)),
        inject(b, sites_b, list(LAYER_SKETCHES)),
    ]
    ops_b = {n.name: n.op_type for n in b.graph.node}  # the site's node in B: MatMulNBits for an int4 MatMul
    del a, b
    taken = []
    for (model, manifest), base, runtime in zip(tapped, dirs, runtimes):
        host = host_values(manifest, model, base)
        session = make_session(model, for_tapped(runtime), base_dir=base, take_weights=True)
        layout = _session_layout(session, manifest.original_outputs)
        got: dict = {}
        loop = _Forced(
            session, layout, manifest.output_names(), _AtStep(steps=step + 1, at=step), forced=forced
        )
        loop.run(prompt, lambda _, outputs, into=got: into.update(outputs))
        taken.append((manifest, host, got))
        del session, loop
    (man_a, host_a, out_a), (man_b, host_b, out_b) = taken
    report = ParityReport(result.a, result.b, result.tol, result.layer_tol)
    _compare(report, [None], lambda _: out_a, lambda _: out_b, man_a, man_b, [], host_a, host_b)
    node = {s.id: s.node or s.id for s in man_a.sites}
    for row in report.layers:
        name = node.get(row["site"], row["site"])
        row["layer"], row["op_type_b"] = layer_of(name), ops_b.get(name, row["op_type"])
    result.layer_step, result.layers = step, report.layers
    result.first_divergent, result.sites_compared, result.sites_only_in_a = (
        report.first_divergent, report.sites_compared, lost
    )  # fmt: skip
