"""Per-token costs of a decoder LLM: the prefill as a polynomial in its length, a decode step in the past's.

A decoder exported with a KV cache (`run.generate.cache_layout` reads which inputs are the tokens
and the cache) runs two kinds of step: the prefill, `seq` prompt tokens on an empty cache, and
decode steps, one token on a cache of `past` positions. `analyze` prices the graph with its input
symbols free; here the symbols are given their roles (input_ids [batch, seq], past_key_values.*
[batch, heads, past, head_dim], the attention mask's and the presents' `total` = seq + past), so
the prefill's FLOPs and bytes become a polynomial in `seq` (past = 0) and a decode step's a
polynomial in `past` (seq = 1). Their ratio is why the two phases are tuned apart: a decode step
reads every weight to produce one token (intensity ~0.5 FLOP/B in fp32, far left of any ridge:
memory-bound), a 512-token prefill reads them once for 512 tokens (compute-bound on a CPU).

Bytes are `analyze`'s: every op reads its inputs and writes its outputs once, unfused, so the
prefill's attention scores (seq x seq per head) count as traffic a fused kernel would not have.
The KV-cache bytes per token are what each position adds to the presents (all layers, keys and
values), the figure that sizes the cache: 2 x layers x kv_heads x head_dim x dtype bytes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from onnx import ModelProto

from ..errors import OpscopeError, listing
from ..files import write_document
from ..graph.io import ModelLike, load_model
from ..shapes import Dim, safe_symbol
from ..shapes.symbolic import Poly, evaluate, free_symbols, to_number, to_text
from ..shapes.symbolic import add as _add
from .costs import Report, analyze
from .roofline import Device, classify, est_time, get_device, intensity

if TYPE_CHECKING:
    from .bandwidth import Measured

SEQ, PAST = "seq", "past"  # the names the phase polynomials are written in
DEFAULT_SEQ, DEFAULT_PAST = 512, 1024
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Phase:
    """One kind of step: its costs as polynomials in `variable`, and their values at `length`.

    `tokens`: the tokens the step produces (batch x seq for the prefill, batch for a decode step);
    `weight_bytes`: initializer bytes read (the embedding counts the rows gathered);
    `flops_by_op`: the polynomial FLOPs per op kind, largest first at `length`."""

    name: str
    variable: str
    length: int
    tokens: int
    flops_poly: Dim
    bytes_poly: Dim
    weight_bytes_poly: Dim
    flops: float | None
    bytes: float | None
    weight_bytes: float | None
    intensity: float | None
    roofline: str
    est_time_s: float | None
    flops_by_op: dict[str, Dim] = field(default_factory=dict)

    @property
    def flops_per_token(self) -> float | None:
        return None if self.flops is None else self.flops / self.tokens

    @property
    def bytes_per_token(self) -> float | None:
        return None if self.bytes is None else self.bytes / self.tokens

    @property
    def tokens_per_s(self) -> float | None:
        """The roofline's bound on this step's throughput: tokens / max(FLOPs / peak, bytes / bandwidth)."""
        return self.tokens / self.est_time_s if self.est_time_s else None

    def to_dict(self) -> dict:
        return {
            "phase": self.name,
            "variable": self.variable,
            "length": self.length,
            "tokens": self.tokens,
            "flops_expr": to_text(self.flops_poly),
            "bytes_expr": to_text(self.bytes_poly),
            "weight_bytes_expr": to_text(self.weight_bytes_poly),
            "flops": self.flops,
            "bytes": self.bytes,
            "weight_bytes": self.weight_bytes,
            "flops_per_token": self.flops_per_token,
            "bytes_per_token": self.bytes_per_token,
            "intensity": self.intensity,
            "roofline": self.roofline,
            "est_time_s": self.est_time_s,
            "tokens_per_s": self.tokens_per_s,
            "flops_by_op": {k: to_text(v) for k, v in self.flops_by_op.items()},
        }


@dataclass(frozen=True)
class TokenCosts:
    """The result of `per_token`: both phases, the KV cache per token, and the roofline they sit on.

    `symbols`: role (batch, seq, past, total) -> the model's symbol names; `kv_bytes`: present output
    -> bytes per position (batch 1); `kv_bytes_per_token` is their sum."""

    model: str
    device: Device
    batch: int
    symbols: dict[str, list[str]]
    prefill: Phase
    decode: Phase
    kv_bytes: dict[str, int]
    params: float | None
    notes: list[str] = field(default_factory=list)

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(self.kv_bytes.values())

    @property
    def phases(self) -> tuple[Phase, Phase]:
        return self.prefill, self.decode

    def kv_cache_bytes(self, positions: int) -> int:
        """Bytes the cache holds after `positions` tokens, for the whole batch."""
        return self.kv_bytes_per_token * positions * self.batch

    def to_dict(self) -> dict:
        dev = self.device
        return {
            "model": self.model,
            "device": {
                "name": dev.name,
                "peak_flops": dev.peak_flops,
                "bandwidth": dev.bandwidth,
                "ridge": dev.ridge,
                "dtype": dev.dtype,
                "source": dev.source,
            },  # fmt: skip
            "batch": self.batch,
            "symbols": self.symbols,
            "params": self.params,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "kv_cache_bytes": self.kv_cache_bytes(self.prefill.length + self.decode.length),
            "phases": [p.to_dict() for p in self.phases],
            "notes": self.notes,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_arrow(self):
        """One row per phase (the per-op breakdown stays in the JSON)."""
        import pyarrow as pa

        rows = [{k: v for k, v in p.to_dict().items() if k != "flops_by_op"} for p in self.phases]
        for row in rows:
            row.update(model=self.model, batch=self.batch, kv_bytes_per_token=self.kv_bytes_per_token)
        return pa.Table.from_pylist(rows)

    def write(self, path: str | os.PathLike, fmt: str | None = None) -> Path:
        """Save as json, csv or parquet (by `fmt` or the suffix), whole or not at all."""
        return write_document(path, fmt, self.to_arrow, lambda: self.to_json(indent=1))


def per_token(
    model: ModelLike,
    *,
    seq: int = DEFAULT_SEQ,
    past: int = DEFAULT_PAST,
    batch: int = 1,
    dims: Mapping[str, int] | None = None,
    device: str = "cpu",
    ridge: float | None = None,
    measured: Measured | None = None,
    symbolic: bool | str = True,
) -> TokenCosts:
    """FLOPs and bytes of a decoder's prefill (a polynomial in seq) and decode step (in past), per token.

    The numbers are the prefill of `seq` tokens and a decode step on `past` cached positions, for
    `batch` sequences; `dims` gives values to any other input symbol. The roofline is `device`'s
    preset (`ridge` overrides its ridge), or `measured` (`bandwidth.measure`) when given. `symbolic`:
    onnxruntime's symbolic shape inference, on by default, as `analyze`'s "auto" skips it on graphs of
    over 4000 nodes and the rules alone leave a decoder's mask and RoPE shapes unknown (the 30-layer
    SmolLM2: 222 nodes without a cost).
    OpscopeError when the model is not a decoder with a recognisable KV cache (its inputs listed).
    """
    for flag, v in (("seq", seq), ("past", past), ("batch", batch)):
        if v < 1 and not (flag == "past" and v == 0):
            raise OpscopeError(f"{flag} must be a positive integer, got {v}")
    proto = load_model(model)
    roles, kv = _roles(proto)
    fixed = {safe_symbol(k) for k in dims or {}} & {s for names in roles.values() for s in names}
    if fixed:
        raise OpscopeError(
            f"--dim {listing(fixed)}: the decoder analysis sets the batch, sequence and past itself",
            hint="give --batch / --seq / --past instead",
        )
    dev = measured.device() if measured is not None else get_device(device, ridge)
    report = analyze(proto, dims=dims, device=device, ridge=ridge, symbolic=symbolic)
    s, p = Poly.symbol(SEQ), Poly.symbol(PAST)
    values: dict = {n: batch for n in roles["batch"]}
    values.update(
        {n: s for n in roles["seq"]} | {n: p for n in roles["past"]} | {n: s + p for n in roles["total"]}
    )
    phases = (
        _phase(report, "prefill", SEQ, seq, batch * seq, _at(values, {PAST: 0}), dev),
        _phase(report, "decode", PAST, past, batch, _at(values, {SEQ: 1}), dev),
    )
    notes = list(report.notes)
    unknown = sum(1 for r in report.records if r.counted and (r.flops is None or r.bytes_total is None))
    if unknown:
        notes.append(f"{unknown} nodes of unknown cost are left out of the sums")
    return TokenCosts(
        model=str(model) if not isinstance(model, ModelProto) else (proto.graph.name or "<model>"),
        device=dev,
        batch=batch,
        symbols=roles,
        prefill=phases[0],
        decode=phases[1],
        kv_bytes=kv,
        params=to_number(report.params),
        notes=notes,
    )


def _roles(proto: ModelProto) -> tuple[dict[str, list[str]], dict[str, int]]:
    """The model's symbols by role, and each present's bytes per position, from the cache layout."""
    from ..run.feeds import input_signature  # the run layer brings onnxruntime: only when asked
    from ..run.generate import cache_layout

    specs = {s.name: s for s in input_signature(proto)}
    try:
        layout = cache_layout(list(specs.values()), [o.name for o in proto.graph.output])
    except OpscopeError as e:
        why = str(e).split(": ", 1)[-1]  # past cache_layout's own "not a decoder ... generate can drive:"
        raise OpscopeError(f"not a decoder the per-token analysis recognises: {why}", hint=e.hint) from None

    def bad(why: str) -> OpscopeError:
        return OpscopeError(f"not a decoder the per-token analysis recognises: {why}; inputs: "
                            + ", ".join(s.describe() for s in specs.values()))  # fmt: skip

    ids = specs[layout.input_ids]
    if ids.rank != 2 or isinstance(ids.dims[1], int):
        raise bad(f"{layout.input_ids} is not [batch, seq] with a symbolic seq")
    roles: dict[str, list[str]] = {"batch": [], "seq": [], "past": [], "total": []}
    _add_role(roles, "seq", ids.name, 1, ids.dims[1])
    kv: dict[str, int] = {}
    axes: dict[str, int] = {}  # present -> its sequence axis
    for past_name, present in layout.cache:
        spec = specs[past_name]
        axes[present] = axis = next(a for a, d in enumerate(layout.past_shapes[past_name]) if d == 0)
        kv[present] = spec.dtype.itemsize * math.prod(
            d for a, d in enumerate(spec.dims) if a not in (0, axis)
        )
        _add_role(roles, "past", past_name, axis, spec.dims[axis])
    for spec in specs.values():
        if spec.dims:
            _add_role(roles, "batch", spec.name, 0, spec.dims[0])
    if layout.attention_mask and specs[layout.attention_mask].rank == 2:
        _add_role(roles, "total", layout.attention_mask, 1, specs[layout.attention_mask].dims[1])
    for out in proto.graph.output:
        dims = out.type.tensor_type.shape.dim
        if out.name in axes and len(dims) > axes[out.name] and dims[axes[out.name]].dim_param:
            _add_role(roles, "total", out.name, axes[out.name], dims[axes[out.name]].dim_param)
    return roles, kv


def _add_role(roles: dict[str, list[str]], role: str, name: str, axis: int, dim) -> None:
    """File a dim's symbol under `role` unless it already has one: a dim_param as `analyze` names it,
    an unnamed dim as INPUT_AXIS (its name there too); an expression such as `past + 1` is left to the
    substitution of its parts, a static dim has no symbol."""
    if isinstance(dim, int) or (isinstance(dim, str) and not dim.isidentifier()):
        return
    symbol = safe_symbol(dim if dim is not None else f"{name}_{axis}")
    if not any(symbol in names for names in roles.values()):
        roles[role].append(symbol)


def _at(values: Mapping[str, Dim], point: Mapping[str, int]) -> dict[str, Dim]:
    return {k: evaluate(v, point) for k, v in values.items()}


def _phase(
    report: Report, name: str, variable: str, length: int, tokens: int, values: Mapping, dev: Device
) -> Phase:
    flops: Dim = 0
    nbytes: Dim = 0
    weights: Dim = 0
    by_op: dict[str, Dim] = {}
    for r in report.records:
        if not r.counted:
            continue
        total = evaluate(r.bytes_total, values)
        nbytes = _add(nbytes, total) if total is not None else nbytes
        w = evaluate(r.bytes_weights, values)
        weights = _add(weights, w) if w is not None else weights
        if r.modelled and r.flops is not None:
            f = evaluate(r.flops, values)
            flops = _add(flops, f)
            kind = r.op_type if r.domain in ("", "ai.onnx") else f"{r.domain}.{r.op_type}"
            by_op[kind] = _add(by_op.get(kind, 0), f)
    left = (free_symbols(flops) | free_symbols(nbytes)) - {variable}
    if left:
        raise OpscopeError(
            f"the decoder's {name} cost still depends on {listing(left)} beside its {variable}",
            hint="give them values: --dim NAME=N (Python: dims={'NAME': N})",
        )
    point = {variable: length}
    f_at, b_at, w_at = (to_number(evaluate(x, point)) for x in (flops, nbytes, weights))
    order = sorted(by_op.items(), key=lambda kv: -(to_number(evaluate(kv[1], point)) or 0.0))
    return Phase(
        name=name,
        variable=variable,
        length=length,
        tokens=tokens,
        flops_poly=flops,
        bytes_poly=nbytes,
        weight_bytes_poly=weights,
        flops=f_at,
        bytes=b_at,
        weight_bytes=w_at,
        intensity=intensity(f_at, b_at),
        roofline=classify(f_at, b_at, dev.ridge),
        est_time_s=est_time(f_at, b_at, dev),
        flops_by_op=dict(order),
    )


def print_token_costs(costs: TokenCosts, file: IO[str] | None = None, width: int | None = None) -> None:
    """The two phases as a rich table, then the KV cache and the roofline used, to `file` (stdout)."""
    from rich.console import Console
    from rich.table import Table

    from .table import si

    con = Console(file=file, highlight=False)
    if width or not con.is_terminal:
        con.width = width or 150
    dev = costs.device
    con.print(f"[bold]{costs.model}[/bold]: decoder, batch {costs.batch}, {si(costs.params)} params")
    con.print(f"device {dev.name} ({dev.dtype}): ridge {dev.ridge:.1f} FLOP/B — {dev.source}")
    cols = ["phase", "FLOPs (polynomial)", "at", "FLOPs", "FLOPs/token", "bytes", "weights", "AI", "class",
            "est time", "tokens/s"]  # fmt: skip
    tab = Table(title="per step (bytes unfused: each op reads its inputs and writes its outputs)",
                title_justify="left")  # fmt: skip
    for c in cols:
        tab.add_column(c, justify="left" if c in ("phase", "FLOPs (polynomial)", "at", "class") else "right",
                       overflow="fold")  # fmt: skip
    for p in costs.phases:
        tab.add_row(
            p.name, to_text(p.flops_poly), f"{p.variable}={p.length}", si(p.flops, "FLOP"),
            si(p.flops_per_token, "FLOP"), si(p.bytes, "B"), si(p.weight_bytes, "B"),
            "?" if p.intensity is None else f"{p.intensity:.3g}", p.roofline, si(p.est_time_s, "s"),
            si(p.tokens_per_s),
        )  # fmt: skip
    con.print(tab)
    con.print(f"bytes (polynomial): prefill {to_text(costs.prefill.bytes_poly)}; "
              f"decode {to_text(costs.decode.bytes_poly)}")  # fmt: skip
    positions = costs.prefill.length + costs.decode.length
    con.print(
        f"KV cache: {si(costs.kv_bytes_per_token, 'B')} per token ({len(costs.kv_bytes)} present outputs), "
        f"{si(costs.kv_cache_bytes(positions), 'B')} at {positions} positions x batch {costs.batch}"
    )
    for note in costs.notes:
        con.print(f"[yellow]note[/yellow]: {note}")
