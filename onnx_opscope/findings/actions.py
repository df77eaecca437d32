"""What to run next for a finding: the opscope commands that check or apply its exploit.

A finding is only worth reading if it says what to do; `next_steps` turns each rule into the
commands that exist for it, with the feeds the table was recorded on (`feed_flags`, from its
`.run.json`), so a copied command checks the pattern on the same data:

- sparse, coherent, memoize, delta: `opscope mine TABLE --measure` times the exploit against
  dense at the site's shape;
- outlier, heavy_tail, levels, concentrated: `opscope rewrite fakequant` (int8 round trip on
  every MatMul / Gemm input, per channel for outlier channels) checks the outputs keep, and
  `opscope calibrate ... --qdq` writes the quantized model (percentile ranges for heavy tails);
- nonfinite: `opscope record MODEL --name SITE --sketch nan_count,inf_count` records the site
  alone, and `opscope mine` shows its counts per step;
- weak_residual_branch: `opscope mine TABLE --validate` scores the skip on the recorded feeds,
  then the finding's own `opscope rewrite skip` command applies it.

Other verdicts (attention, experts, positional, prepack) have no opscope command: `next_steps`
returns none, and the report says so. `tests/test_reporting.py` parses every command emitted
here with the real `opscope` parser, so a renamed flag fails a test.
"""

from __future__ import annotations

import glob
import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .finding import ACTIONABLE_TEMPORAL, Finding

MEASURE_RULES = ("sparse", "coherent")
MEASURE_TEMPORAL = ("memoize", "delta")
QUANT_RULES = ("outlier", "heavy_tail", "levels", "concentrated")


@dataclass(frozen=True)
class Step:
    """One command for a finding: `what` it does (check, apply, show) and the shell line."""

    what: str
    command: str


def _fmt_value(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)


def feed_flags(feeds: Mapping[str, Any] | None) -> list[str]:
    """The `record` feed options (a `.run.json` "feeds" block) as command-line flags, so a check runs
    on the data the table saw. Batch counts are left to each command's default."""
    if not feeds:
        return []
    out: list[str] = []
    if feeds.get("data"):
        out += ["--data", str(feeds["data"])]
    else:
        if feeds.get("dist") and feeds["dist"] != "gaussian":
            out += ["--dist", str(feeds["dist"])]
        if feeds.get("seed"):
            out += ["--seed", str(int(feeds["seed"]))]
        for name, dims in (feeds.get("shapes") or {}).items():
            out += ["--shape", f"{name}:{_fmt_value(dims)}"]
        dims = feeds.get("dims") or {}
        if dims:
            out += ["--dim", ",".join(f"{k}={int(v)}" for k, v in dims.items())]
        for name, (lo, hi) in (feeds.get("ranges") or {}).items():
            out += ["--range", f"{name}:{int(lo)},{int(hi)}"]
    for name, v in (feeds.get("values") or {}).items():
        out += ["--value", f"{name}:{_fmt_value(v)}"]
    return out


def _cmd(*tokens: str) -> str:
    return " ".join(shlex.quote(t) for t in tokens)


def acts_per_batch(f: Finding) -> bool:
    """Whether the per-batch verdict names something to do (dense, too small and 'none: ...' do not)."""
    return f.rule not in ("dense", "small") and not f.exploit.startswith("none")


def next_steps(
    finding: Finding, model: str = "MODEL", table: str = "TABLE", feeds: Sequence[str] = ()
) -> list[Step]:
    """The commands that check or apply `finding`'s exploit, in the order to run them ([] when opscope
    has none). `feeds`: feed flags for the commands that run the model (see `feed_flags`)."""
    f = finding
    steps: list[Step] = []
    if acts_per_batch(f):
        if f.rule == "nonfinite":
            out = "nonfinite.parquet"
            steps += [
                Step(
                    "record",
                    _cmd(
                        "opscope",
                        "record",
                        model,
                        "--name",
                        glob.escape(f.site),
                        "--sketch",
                        "nan_count,inf_count,min,max",
                        *feeds,
                        "-o",
                        out,
                    ),
                ),  # fmt: skip
                Step("show", _cmd("opscope", "mine", out, "--all")),
            ]
        elif f.rule in MEASURE_RULES:
            steps.append(Step("check", _cmd("opscope", "mine", table, "--measure")))
        elif f.rule in QUANT_RULES:
            mode = "channel" if f.rule == "outlier" else "token"
            steps.append(Step("check", _cmd("opscope", "rewrite", "fakequant", model, "--mode", mode, *feeds,
                                            "-o", "fakequant.onnx")))  # fmt: skip
            extra = ["--per-channel"] if f.rule == "outlier" else []
            extra += ["--method", "percentile"] if f.rule == "heavy_tail" else []
            steps.append(Step("apply", _cmd("opscope", "calibrate", model, *extra, *feeds, "-o", "ranges.json",
                                            "--qdq", "model.int8.onnx")))  # fmt: skip
        elif f.rule == "weak_residual_branch" and f.action:
            v = f.validation
            if v is None:
                steps.append(Step("check", _cmd("opscope", "mine", table, "--validate")))
            if v is None or v.get("passed"):
                steps.append(Step("apply", f.action))
    t = f.temporal
    if t is not None and t.rule in MEASURE_TEMPORAL:
        steps.append(Step("check", _cmd("opscope", "mine", table, "--measure")))
    return list(dict.fromkeys(steps))  # sparse + memoize: one --measure


def next_step(finding: Finding, model: str = "MODEL", table: str = "TABLE", feeds: Sequence[str] = ()) -> str:
    """The first command of `next_steps` ('' when opscope has none)."""
    steps = next_steps(finding, model, table, feeds)
    return steps[0].command if steps else ""


def _saving_key(f: Finding) -> tuple:
    return (f.saves is None, -(f.saves or 0.0), f.impact is None, -(f.impact or 0.0), -f.rank_score)


def top_actions(findings: Sequence[Finding], n: int = 3) -> list[Finding]:
    """The `n` actionable findings with the largest estimated saving (`Finding.saves`), then impact,
    then score; NaN/Inf findings are left to `fix_first`."""
    cands = [f for f in findings if f.actionable and f.rule != "nonfinite"]
    return sorted(cands, key=_saving_key)[:n]


def fix_first(findings: Sequence[Finding]) -> list[Finding]:
    """The NaN/Inf findings: every other number of the model is suspect until they are fixed."""
    return [f for f in findings if f.rule == "nonfinite"]


def rule_counts(findings: Sequence[Finding]) -> tuple[Counter, Counter, int]:
    """(per-batch rule -> count, across-steps rule -> count, non-actionable count) of the findings."""
    per_batch = Counter(f.rule for f in findings if f.actionable and acts_per_batch(f))
    temporal = Counter(
        f.temporal.rule for f in findings if f.temporal is not None and f.temporal.rule in ACTIONABLE_TEMPORAL
    )
    return per_batch, temporal, sum(not f.actionable for f in findings)


def findings_line(findings: Sequence[Finding]) -> str:
    """What the findings say in one line, counts per rule: 'found: 4 heavy_tail, 1 concentrated;
    across steps: 6 stationary; 14 of 27 tensors with nothing to act on'."""
    per_batch, temporal, idle = rule_counts(findings)

    def counts(c: Counter) -> str:
        return ", ".join(f"{n} {rule}" for rule, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))

    parts = [f"found: {counts(per_batch)}" if per_batch else "found: no per-batch pattern"]
    if temporal:
        parts.append(f"across steps: {counts(temporal)}")
    parts.append(f"{idle} of {len(findings)} tensors with nothing to act on (dense, too small or no exploit)")
    return "; ".join(parts)
